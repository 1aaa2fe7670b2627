"""Audio in and out of an instance: prompt uploads, WAV answers, the outputs dir.

Instance side: numpy and soundfile only (both are in every CosyVoice environment).
"""

from __future__ import annotations

import io
import os
import struct
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile

from cosyvoice_lb.instance.speech.validation import MIN_PROMPT_SECONDS, prompt_span

MIN_PROMPT_RATE = 16000  # upstream's load_wav refuses anything below
FORMATS = "WAV, FLAC, MP3 or OGG"


class PromptError(ValueError):
    """An upload that cannot be a voice prompt; the message says what to send instead."""


@dataclass
class Prompt:
    audio: np.ndarray  # mono float32
    rate: int
    notices: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.audio.size / self.rate


def read_prompt(data: bytes, max_seconds: float) -> Prompt:
    """Decode an upload into a mono prompt of at most ``max_seconds`` (trimmed, with a notice).

    Refuses, with what to do: nothing sent, not audio or corrupt, below 16 kHz (upsampling
    cannot add the detail cloning needs, so it is refused rather than upsampled), shorter
    than MIN_PROMPT_SECONDS, silence.
    """
    span = prompt_span(max_seconds)
    if not data:
        raise PromptError(f"prompt_audio is empty: upload a {FORMATS} file of {span} of speech")
    try:
        # Decode no more than is kept: a small compressed upload can hold hours of audio.
        info = soundfile.info(io.BytesIO(data))
        limit = int(max_seconds * info.samplerate) + 1
        audio, rate = soundfile.read(io.BytesIO(data), frames=limit, dtype="float32", always_2d=True)
    except (RuntimeError, soundfile.LibsndfileError, TypeError, ValueError) as exc:
        # (libsndfile names the in-memory file it was handed: keep only its reason)
        reason = str(exc).rsplit(": ", 1)[-1] if "<_io." in str(exc) else str(exc)
        raise PromptError(f"prompt_audio is not audio this server can read ({reason}): upload {FORMATS}") from None
    total_seconds = info.frames / info.samplerate if info.frames > 0 else audio.shape[0] / rate
    if audio.size == 0:
        raise PromptError(f"prompt_audio has no samples: upload a recording of {span} of speech")
    if rate < MIN_PROMPT_RATE:
        raise PromptError(
            f"prompt_audio is sampled at {rate} Hz: CosyVoice needs 16 kHz or more "
            "(record or export it at 16 kHz, 24 kHz or 44.1 kHz)"
        )
    # Judged as shown (to 0.1 s): a 3.0 s file whose decoder reports 2.97 s is not refused.
    if round(total_seconds, 1) < MIN_PROMPT_SECONDS:
        raise PromptError(
            f"prompt_audio is {total_seconds:.1f} s long: cloning a voice needs {span} of speech; "
            "upload a longer recording"
        )
    mono = audio.mean(axis=1).astype(np.float32)
    if not np.isfinite(mono).all() or float(np.abs(mono).max()) < 1e-4:
        raise PromptError("prompt_audio is silent: upload a recording of the voice to clone")
    prompt = Prompt(mono, rate)
    if audio.shape[1] > 1:
        prompt.notices.append(f"prompt audio mixed down from {audio.shape[1]} channels to mono")
    if total_seconds > max_seconds:
        prompt.notices.append(
            f"prompt audio trimmed from {total_seconds:.1f} s to the first {max_seconds:g} s "
            "(--max-prompt-seconds); its transcript should match what is left"
        )
        prompt.audio = mono[: int(max_seconds * rate)]
    return prompt


def write_wav(path: Path, audio: np.ndarray, rate: int) -> None:
    """Write a WAV file whole or not at all: encoded in memory first (libsndfile reports a
    full disk only as "System error." and leaves half a file), then written through a temp
    file; an OSError (ENOSPC, EACCES, EROFS...) leaves nothing behind."""
    write_file(path, wav_bytes(audio, rate))


def write_file(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` whole or not at all (see ``write_wav``)."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.part")
    try:
        # Readable by the service's user only: prompts are someone's voice.
        with os.fdopen(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as handle:
            handle.write(data)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def wav_bytes(audio: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.clip(audio, -1.0, 1.0), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1.0, 1.0) * 32767).astype("<i2").tobytes()


class WavBuilder:
    """A 16-bit mono WAV file built chunk by chunk as the audio comes.

    A long text's audio is hundreds of MB as float32: kept as float chunks, joined, clipped
    and encoded it was held four times over. Here each chunk is encoded as it arrives, so
    the whole is held once, at half the float size, and ``data`` hands it out uncopied.
    """

    HEADER = 44

    def __init__(self, rate: int):
        self.rate = rate
        self._buffer = bytearray(self.HEADER)  # (the header is written once the size is known)
        self._view: memoryview | None = None

    def feed(self, audio: np.ndarray) -> None:
        self._buffer += pcm16(audio)

    @property
    def samples(self) -> int:
        return (len(self._buffer) - self.HEADER) // 2

    @property
    def seconds(self) -> float:
        return self.samples / self.rate

    @property
    def data(self) -> memoryview:
        """The whole WAV file (no more chunks may be fed after this)."""
        if self._view is None:
            size = len(self._buffer) - self.HEADER
            self._buffer[: self.HEADER] = (
                b"RIFF"
                + struct.pack("<I", 36 + size)
                + b"WAVEfmt "
                + struct.pack("<IHHIIHH", 16, 1, 1, self.rate, self.rate * 2, 2, 16)
                + b"data"
                + struct.pack("<I", size)
            )
            self._view = memoryview(self._buffer)
        return self._view


def streaming_wav_header(rate: int) -> bytes:
    """A WAV header for a stream of unknown length (sizes at their maximum, as streaming
    servers and players agree), 16-bit mono."""
    unknown = 0xFFFFFFFF
    return (
        b"RIFF"
        + struct.pack("<I", unknown)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", unknown - 36)
    )


# --- outputs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredFile:
    name: str
    mtime: float
    size: int


def expired(files: list[StoredFile], now: float, max_age: float, max_bytes: int) -> list[str]:
    """Names to delete: older than ``max_age``, then the oldest until the rest fit ``max_bytes``."""
    doomed = {f.name for f in files if now - f.mtime > max_age}
    kept = sorted((f for f in files if f.name not in doomed), key=lambda f: (f.mtime, f.name))
    total = sum(f.size for f in kept)
    for f in kept:
        if total <= max_bytes:
            break
        doomed.add(f.name)
        total -= f.size
    return sorted(doomed)


class Outputs:
    """The shared outputs dir: every instance writes unique names and keeps it bounded."""

    def __init__(self, directory: str, port: int, max_age: float, max_bytes: int, sweep_every: float = 30.0):
        self.dir = Path(directory) if directory else None
        self.port, self.max_age, self.max_bytes, self.sweep_every = port, max_age, max_bytes, sweep_every
        self.last_sweep = 0.0
        if self.dir:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def name(self, suffix: str = ".wav") -> str:
        return f"{time.strftime('%Y%m%d-%H%M%S')}-{self.port}-{uuid.uuid4().hex[:12]}{suffix}"

    def save(self, audio: np.ndarray | WavBuilder, rate: int) -> str:
        """Write one result (samples, or a built WAV file); returns its file name ("" without
        an outputs dir)."""
        if not self.dir:
            return ""
        name = self.name()
        if isinstance(audio, WavBuilder):
            write_file(self.dir / name, audio.data)
        else:
            write_wav(self.dir / name, audio, rate)
        self.sweep()
        return name

    def sweep(self, force: bool = False) -> list[str]:
        now = time.time()
        if not self.dir or (not force and now - self.last_sweep < self.sweep_every):
            return []
        self.last_sweep = now
        files = []
        for entry in os.scandir(self.dir):
            if entry.is_file() and entry.name.endswith(".wav"):
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # another instance swept it
                    continue
                files.append(StoredFile(entry.name, stat.st_mtime, stat.st_size))
        doomed = expired(files, now, self.max_age, self.max_bytes)
        for name in doomed:
            try:
                (self.dir / name).unlink()
            except FileNotFoundError:
                pass
        return doomed
