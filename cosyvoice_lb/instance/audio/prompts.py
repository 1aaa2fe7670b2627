"""Prompt audio in: an upload decoded into the mono voice prompt cloning needs, or refused
with what to send instead."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

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
