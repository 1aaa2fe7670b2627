"""The audio check: every synthesis is judged before it is answered (pure, numpy only).

A model can go wrong for a whole instance and still answer 200: TensorRT with fp16 gives
NaN audio on some cards, a broken engine says nothing or screams. :class:`AudioCheck` is fed
a synthesis chunk by chunk, and says what is wrong (a :class:`Fault`) or nothing:

* every chunk, before it is sent: each sample finite, and within ±1 with a margin of
  one half-precision step (``LIMIT``: an fp16 model's 1.0 may round to 1 + 2**-10; the WAV
  writer clips that away, while a broken model's values run far past it);
* the whole, at the end: not silent when the text has something to say (its peak at least
  ``SILENCE_PEAK``, -60 dBFS: quieter than any voice, louder than a model's zeros), and a
  duration plausible for the text (:func:`duration_bounds`).

The bounds are there to catch broken output, not a style of speaking, and are generous on
purpose (the reasons are in docs/operations.md, "Bad audio"). A synthesis with no audio at
all is not judged here: the pipeline answers that as "no audio" (422), as before.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# The reasons a synthesis is bad, as the metrics count them.
REASONS = ("non_finite", "out_of_range", "silent", "too_short", "too_long")

LIMIT = 1.0 + 2.0**-10  # ±1 plus one float16 step above 1.0 (1.000977)
SILENCE_PEAK = 1e-3  # -60 dBFS: a whole synthesis quieter than this said nothing

# Duration bounds, at speed 1. The shortest: per speech unit of the text (a CJK character, a
# word of another script, a digit), far below the fastest speech (a syllable takes ~0.1 s;
# CosyVoice's LLM makes at least 2 speech tokens, 0.08 s, per text token; espeak speaks every
# word). The longest: a fixed allowance (a model's trailing breath; the random-weight test
# model's tail of a few dozen tokens) plus, per character that is not a space, more than a
# voice spelling it out letter by letter at half speed takes (~0.8 s): a word no voice knows
# ("aaaaaaaa") may be spelled, a symbol read out ("%": "percent").
MIN_SECONDS_PER_UNIT = 0.03
MAX_BASE_SECONDS = 10.0
MAX_SECONDS_PER_CHAR = 1.0

# CJK ideographs, kana and Hangul syllables: each one is spoken as (about) a syllable.
_CJK = "\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\U00020000-\U0003134f"
_UNIT = re.compile(rf"[{_CJK}]|\d|[^\W\d_{_CJK}]+")
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class Fault:
    """What is wrong with a synthesis: ``reason`` (one of REASONS) and the detail for people."""

    reason: str
    detail: str

    def __str__(self) -> str:
        return self.detail


@dataclass(frozen=True)
class Bounds:
    """The durations a text's synthesis may have: ``units`` spoken units (0: nothing to say,
    so neither silence nor a minimum is judged), ``shortest`` and ``longest`` in seconds."""

    units: int
    shortest: float
    longest: float


def speech_units(text: str) -> int:
    """What a voice says of ``text``, counted: each CJK character, each digit, each word of
    another script (a run of letters)."""
    return sum(1 for _ in _UNIT.finditer(text))


def characters(text: str) -> int:
    """The characters of ``text`` that are not spaces."""
    return len(_SPACE.sub("", text))


def duration_bounds(text: str, speed: float = 1.0) -> Bounds:
    """The plausible durations of ``text`` spoken at ``speed``. A speed only ever widens the
    bounds (faster: a lower minimum; slower: a higher maximum), never narrows them: an engine
    may ignore it (upstream does when streaming)."""
    units = speech_units(text)
    speed = speed if speed > 0 and math.isfinite(speed) else 1.0
    shortest = MIN_SECONDS_PER_UNIT * units / max(speed, 1.0)
    allowance = MAX_BASE_SECONDS + MAX_SECONDS_PER_CHAR * characters(text)
    return Bounds(units, shortest, allowance / min(speed, 1.0))


class AudioCheck:
    """One synthesis judged as it is made: :meth:`chunk` for each chunk (before it is sent),
    :meth:`finish` once at the end. Each returns a :class:`Fault`, or None when all is well."""

    def __init__(self, text: str | Callable[[], str], speed: float = 1.0, sample_rate: int = 16000):
        # (a callable: the text as it grows, a streaming session's; the bounds follow it)
        self.text = text if callable(text) else lambda: text
        self.speed = speed
        self.bounds = duration_bounds(self.text(), speed)
        self.rate = max(1, int(sample_rate))
        self.samples = 0
        self.peak = 0.0

    @property
    def seconds(self) -> float:
        return self.samples / self.rate

    def chunk(self, audio: np.ndarray) -> Fault | None:
        audio = np.asarray(audio).reshape(-1)
        if audio.size == 0:
            return None
        peak = float(np.max(np.abs(audio)))  # (NaN propagates: one pass finds both faults)
        if not math.isfinite(peak):
            bad = int(np.count_nonzero(~np.isfinite(audio)))
            return Fault("non_finite", f"{bad} of {audio.size} samples of a chunk are NaN or infinite")
        if peak > LIMIT:
            over = int(np.count_nonzero(np.abs(audio) > LIMIT))
            return Fault("out_of_range", f"{over} of {audio.size} samples of a chunk are beyond ±1 (peak {peak:.3g})")
        self.samples += audio.size
        self.peak = max(self.peak, peak)
        if self.seconds > self.bounds.longest:
            self.bounds = duration_bounds(self.text(), self.speed)
        if self.seconds > self.bounds.longest:  # (a runaway is stopped as it runs, not at its end)
            return Fault(
                "too_long",
                f"{self.seconds:.1f}s of audio so far for a text of {self.bounds.units} speech unit(s) "
                f"(at most {self.bounds.longest:.1f}s)",
            )
        return None

    def finish(self) -> Fault | None:
        self.bounds = duration_bounds(self.text(), self.speed)
        if self.samples == 0 or self.bounds.units == 0:
            return None  # no audio: the pipeline's "no audio"; nothing to say: nothing to judge
        if self.peak < SILENCE_PEAK:
            return Fault(
                "silent",
                f"{self.seconds:.2f}s of silence (peak {self.peak:.2g}, below {SILENCE_PEAK:g}) for "
                f"{self.bounds.units} speech unit(s) of text",
            )
        if self.seconds < self.bounds.shortest:
            return Fault(
                "too_short",
                f"{self.seconds * 1000:.0f} ms of audio for {self.bounds.units} speech unit(s) of text "
                f"(at least {self.bounds.shortest * 1000:.0f} ms)",
            )
        return None


def check_audio(audio: np.ndarray, text: str, speed: float = 1.0, sample_rate: int = 16000) -> Fault | None:
    """A whole synthesis judged at once (what :class:`AudioCheck` says fed it in one chunk)."""
    check = AudioCheck(text, speed, sample_rate)
    return check.chunk(audio) or check.finish()
