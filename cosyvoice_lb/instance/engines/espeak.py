"""The embedded engine: espeak-ng, real speech with no model weights.

It stands in for CosyVoice3 wherever the weights are absent (this repo's tests, a first
try on a new box). English and other Latin text goes to an English voice; Chinese
characters are turned into numbered pinyin and spoken by ``cmn-latn-pinyin``, because
espeak-ng's ``cmn`` voice reads the tone digits of its own transliteration as English.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator

import numpy as np

from cosyvoice_lb.instance.engines import EngineError, SynthesisRequest
from cosyvoice_lb.instance.engines.tool import mono, run_tool

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
        wav = run_tool([self.binary, "-b", "1", "--stdout", "-v", voice, "-s", str(wpm)], self.timeout, text.encode())
        return mono(wav, SAMPLE_RATE, "espeak-ng")
