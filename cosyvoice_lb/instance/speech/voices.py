"""Saved voices: one registry for the whole cluster, in one directory every instance reads.

A voice is a prepared prompt (mono WAV, already checked and trimmed by the prompt rules)
and its transcript, stored as ``<root>/<id>/voice.json`` + ``prompt.wav``. It is built in a
hidden directory and renamed into place, so every instance sees a voice whole or not at
all; a deleted voice is renamed away first, so it stops working everywhere at once. Each
instance reads the directory when a request names a voice: nothing to keep in sync, and
the registry survives restarts and ``down``/``up`` (it lives in the state dir, or in
``--voices-dir``, e.g. a volume shared by several hosts).

Instance side: standard library, numpy and ``audio``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.instance.audio.wav import PRIVATE, write_wav
from cosyvoice_lb.instance.speech.validation import BadRequest, safe

VOICE_ID = re.compile(r"voice_[0-9a-f]{24}")
MAX_NAME = 64
MAX_VOICES = 1000
META, AUDIO = "voice.json", "prompt.wav"
CLAIM_ID = "id"  # in a name's claim: the id of the voice that has the name
CLAIM_SECONDS = 60.0  # a name claimed this long ago with no voice behind it was abandoned
CONSENT_YES = ("yes", "true")  # an explicit yes: a voice is someone's, and cloning it needs their agreement


class VoiceNotFound(LookupError):
    """A request named a voice the registry does not hold (never saved, or deleted)."""

    def __init__(self, key: str, known: list[str]):
        listing = ", ".join(known[:10]) + (", ..." if len(known) > 10 else "") if known else "none saved yet"
        super().__init__(
            f"no saved voice {safe(key)!r} (saved: {listing}): list them with GET /v1/audio/voices, "
            "save one with POST /v1/audio/voices"
        )


class RegistryFull(BadRequest):
    def __init__(self) -> None:
        super().__init__(f"the voice registry holds {MAX_VOICES} voices: delete some first", status=409)


@dataclass(frozen=True)
class Voice:
    id: str
    name: str
    created_at: int
    prompt_text: str
    consent: str = ""

    def public(self) -> dict[str, object]:
        """What the API shows (OpenAI's ``audio.voice`` object, plus the transcript)."""
        return {
            "object": "audio.voice",
            "id": self.id,
            "name": self.name,
            "created_at": self.created_at,
            "prompt_text": self.prompt_text,
        }


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name.strip():
        raise BadRequest('"name" is missing: name the voice, e.g. name=narrator', status=400)
    name = name.strip()
    if len(name) > MAX_NAME or not name.isprintable():
        raise BadRequest(f'"name" must be at most {MAX_NAME} printable characters, not {safe(name)!r}')
    if VOICE_ID.fullmatch(name):
        raise BadRequest(f'"name" {name!r} has the form of a voice id: choose another name')
    return name


def check_consent(consent: object) -> str:
    """The speaker's consent as stored ("yes"); anything but an explicit yes is refused."""
    if isinstance(consent, str) and consent.strip().lower() in CONSENT_YES:
        return "yes"
    given = "is missing" if consent is None or consent == "" else f"is {safe(consent)!r}, not yes"
    raise BadRequest(
        f'"consent" {given}: a voice is saved only with its speaker\'s agreement to be cloned; '
        "send consent=yes once they have agreed"
    )


class Registry:
    """The voices under ``root`` (created on first write, 0700: prompts are someone's voice)."""

    def __init__(self, root: str | os.PathLike, clock: Callable[[], float] = time.time):
        self.root = Path(root)
        self.clock = clock

    # --- reading ---------------------------------------------------------------------------

    def ids(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.root) if VOICE_ID.fullmatch(n))
        except FileNotFoundError:
            return []

    def get(self, voice_id: str) -> Voice | None:
        if not VOICE_ID.fullmatch(voice_id):
            return None
        try:
            data = json.loads((self.root / voice_id / META).read_text(encoding="utf-8"))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return Voice(**{k: data[k] for k in ("id", "name", "created_at", "prompt_text", "consent") if k in data})

    def all(self) -> list[Voice]:
        found = [v for v in (self.get(i) for i in self.ids()) if v is not None]
        return sorted(found, key=lambda v: (v.created_at, v.id))

    def find(self, key: str) -> Voice | None:
        """A voice by id, or by its name (names are unique): one file read either way (a
        name's claim holds its voice's id), not a scan of every voice."""
        if VOICE_ID.fullmatch(key):
            return self.get(key)
        try:
            voice = self.get((self.claim_path(key) / CLAIM_ID).read_text(encoding="utf-8").strip())
        except OSError:
            return None
        return voice if voice is not None and voice.name == key else None

    def claim_path(self, name: str) -> Path:
        return self.root / ".names" / hashlib.sha256(name.encode("utf-8")).hexdigest()[:32]

    def require(self, key: str) -> Voice:
        voice = self.find(key)
        if voice is None:
            raise VoiceNotFound(key, [f"{v.name} ({v.id})" for v in self.all()])
        return voice

    def audio_path(self, voice: Voice) -> str:
        return str(self.root / voice.id / AUDIO)

    # --- writing ---------------------------------------------------------------------------

    def claim(self, name: str) -> Path:
        """Take ``name`` for a new voice, atomically across instances (and hosts sharing the
        dir): a directory per name, which only one mkdir can create. A claim whose voice
        never appeared (its instance died while saving) is taken over after CLAIM_SECONDS."""
        claim = self.claim_path(name)
        claim.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        for _ in range(2):
            try:
                claim.mkdir(mode=0o700)
                return claim
            except FileExistsError:
                owner = self.find(name)
                if owner is not None:
                    raise BadRequest(
                        f"a voice named {name!r} exists ({owner.id}): delete it first or choose another name",
                        status=409,
                    ) from None
                try:
                    stale = self.clock() - claim.stat().st_mtime > CLAIM_SECONDS
                except FileNotFoundError:  # released meanwhile: try again
                    continue
                if not stale:
                    raise BadRequest(
                        f"a voice named {name!r} is being saved right now: retry shortly", status=409
                    ) from None
                shutil.rmtree(claim, ignore_errors=True)
        raise BadRequest(f"a voice named {name!r} is being saved right now: retry shortly", status=409)

    def create(self, name: str, audio: np.ndarray, rate: int, prompt_text: str, consent: str = "") -> Voice:
        """Store a voice whole (OSError when the disk refuses; nothing half-written stays)."""
        name = check_name(name)
        consent = check_consent(consent)
        if len(self.ids()) >= MAX_VOICES:
            raise RegistryFull()
        voice = Voice(
            id=f"voice_{uuid.uuid4().hex[:24]}",
            name=name,
            created_at=int(self.clock()),
            prompt_text=prompt_text,
            consent=consent,
        )
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        claim = self.claim(name)
        building = self.root / f".new-{voice.id}"
        try:
            # the name's way to its id, written first: it finds the voice once the rename below makes it whole
            write_atomic(claim / CLAIM_ID, voice.id, mode=PRIVATE)
            building.mkdir(mode=0o700)
            write_wav(building / AUDIO, audio, rate)
            write_atomic(building / META, json.dumps(asdict(voice), ensure_ascii=False), mode=PRIVATE)
            os.rename(building, self.root / voice.id)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            shutil.rmtree(claim, ignore_errors=True)
            raise
        return voice

    def delete(self, key: str) -> Voice:
        voice = self.require(key)
        gone = self.root / f".gone-{voice.id}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.root / voice.id, gone)  # one step: no instance finds it after this
        except FileNotFoundError:  # deleted meanwhile by another instance
            raise VoiceNotFound(key, []) from None
        shutil.rmtree(gone, ignore_errors=True)
        # the name is free again
        shutil.rmtree(self.claim_path(voice.name), ignore_errors=True)
        return voice

    def borrow(self, voice: Voice, directory: str) -> str:
        """A private copy of the voice's prompt for one request (a hard link when the dir
        is on the same disk): a voice deleted while a request uses it does not pull the
        file from under the model. The caller removes it."""
        path = os.path.join(directory, f"voice-{voice.id}-{uuid.uuid4().hex[:12]}.wav")
        try:
            os.link(self.audio_path(voice), path)
        except FileNotFoundError:  # deleted just now
            raise VoiceNotFound(voice.id, []) from None
        except OSError:  # another disk, or no hard links there
            try:
                shutil.copyfile(self.audio_path(voice), path)
            except FileNotFoundError:
                raise VoiceNotFound(voice.id, []) from None
            os.chmod(path, 0o600)
        return path
