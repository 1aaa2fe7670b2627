"""The embedded engine: espeak-ng, real speech with no model weights.

It stands in for CosyVoice3 wherever the weights are absent (this repo's tests, a first
try on a new box). English and other Latin text goes to an English voice; Chinese
characters are turned into numbered pinyin and spoken by ``cmn-latn-pinyin``, because
espeak-ng's ``cmn`` voice reads the tone digits of its own transliteration as English.
"""

from __future__ import annotations

import io
import logging
import re
import shutil
import subprocess
from collections.abc import Iterator

import numpy as np
import soundfile

from cosyvoice_lb.instance.engines import EngineError, SynthesisRequest, Unspeakable

log = logging.getLogger("cosyvoice_lb.instance")

BASE_WPM = 175  # espeak-ng's default rate; speed 1.0 maps to it
SAMPLE_RATE = 22050
# CJK ideographs and CJK punctuation/full-width forms form the "Chinese" runs.
_CJK = r"\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
_RUNS = re.compile(rf"[{_CJK}]+|[^{_CJK}]+")
_HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
# A long chain of dotted single letters ("a.b.c.d....") overflows a buffer in espeak-ng
# (it aborts: "stack smashing detected"); spaced out, the same letters are spoken one by one.
_INITIALS = re.compile(r"(?<!\w)(?:[^\W\d_]\.){8,}(?:[^\W\d_](?!\w))?")
_CJK_PUNCT = str.maketrans("，。！？；：、（）《》“”‘’「」【】…—", ',.!?;:,()""""\'\'""[]. ')


def speakable(text: str) -> str:
    """``text`` with what espeak-ng is known to crash on rewritten into what it speaks."""
    return _INITIALS.sub(lambda m: m.group(0).replace(".", ". ").rstrip(), text)


def split_runs(text: str) -> list[tuple[str, str]]:
    """[(voice, text)]: Chinese runs as numbered pinyin for cmn-latn-pinyin, the rest English."""
    from pypinyin import Style, lazy_pinyin

    runs: list[tuple[str, str]] = []
    for run in _RUNS.findall(text):
        if _HAN.search(run):
            syllables = lazy_pinyin(run, style=Style.TONE3, neutral_tone_with_five=True)
            spoken = " ".join(s.translate(_CJK_PUNCT) for s in syllables)
            runs.append(("cmn-latn-pinyin", re.sub(r"\s+([,.!?;:])", r"\1", spoken)))
        elif re.search(r"\w", run):  # skip runs of only spaces or punctuation
            runs.append(("en", speakable(run.translate(_CJK_PUNCT))))
    return runs


class EspeakEngine:
    name = "espeak"
    sample_rate = SAMPLE_RATE
    modes = ("sft",)  # one built-in voice per language; no cloning

    def speakers(self) -> list[str]:
        return []

    def __init__(self, binary: str = "espeak-ng", timeout: float = 60.0):
        self.binary = binary
        self.timeout = timeout

    def load(self) -> None:
        path = shutil.which(self.binary)
        if path is None:
            raise EngineError(f"{self.binary} not found: install it (Debian/Ubuntu: apt-get install espeak-ng)")
        self.binary = path
        # One real synthesis proves the voices and pinyin data are there.
        for voice, text in split_runs("ready 准备"):
            self._speak(voice, text, BASE_WPM)

    def synthesize(self, request: SynthesisRequest) -> Iterator[np.ndarray]:
        wpm = int(round(BASE_WPM * request.speed))
        for voice, text in split_runs(request.text):
            yield self._speak(voice, text, wpm)

    def _speak(self, voice: str, text: str, wpm: int) -> np.ndarray:
        # Own session: a stop signal sent to the instance's process group must not kill
        # a synthesis in flight; the server drains requests before it exits.
        try:
            done = subprocess.run(
                [self.binary, "-b", "1", "--stdout", "-v", voice, "-s", str(wpm)],
                input=text.encode("utf-8"),
                capture_output=True,
                timeout=self.timeout,
                start_new_session=True,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise EngineError(f"espeak-ng took longer than {self.timeout:.0f}s") from exc
        if done.returncode < 0:  # killed by a signal: it crashed on this text
            log.warning(
                "espeak-ng crashed (signal %d) on a %d-character text: %s",
                -done.returncode,
                len(text),
                done.stderr.decode(errors="replace").strip()[-300:],
            )
            raise Unspeakable(
                "the engine cannot speak this text (espeak-ng crashed on it): reword it, e.g. write out "
                "long runs of letters, dots or symbols, then send it again"
            )
        if done.returncode != 0 or not done.stdout:
            raise EngineError(
                f"espeak-ng failed (exit {done.returncode}): {done.stderr.decode(errors='replace')[-300:]}"
            )
        audio, rate = soundfile.read(io.BytesIO(done.stdout), dtype="float32")
        if rate != SAMPLE_RATE:
            raise EngineError(f"espeak-ng answered at {rate} Hz, expected {SAMPLE_RATE} Hz")
        return audio if audio.ndim == 1 else audio.mean(axis=1)
