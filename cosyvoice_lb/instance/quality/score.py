"""How far a transcript is from the text it should say (pure; jiwer and num2words).

Texts in a space-separated language are scored by word error rate (WER), Chinese and
Japanese by character error rate (CER): the edit distance over the reference's length, so 0
is word for word and 1 is as many errors as the text has words (a ratio above 1 says the
answer said more than the text: repeated phrases). Both sides are normalised first, the same
way: case folded, punctuation dropped, numbers as words (English; in CER texts each digit as
its character, 2 -> 二, so a year read digit by digit matches and a quantity read as a
number does not: the threshold allows for that).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

# Chinese ideographs, kana: scored by character.
_CJK = re.compile(r"[\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_WORDS = re.compile(r"[^\W\d_]+")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_CJK_DIGITS = str.maketrans("0123456789", "零一二三四五六七八九")
_KEEP = re.compile(r"[^\w\s']|_")  # punctuation and symbols (an apostrophe stays: "don't")


@dataclass(frozen=True)
class Score:
    """``kind`` "wer" or "cer"; ``ratio`` the error rate; both sides as they were compared."""

    kind: str
    ratio: float
    reference: str
    hypothesis: str


def scored_by_character(text: str) -> bool:
    """Whether ``text`` is scored by character: at least half of what it says (each CJK
    character, each word of another script) is CJK."""
    cjk = len(_CJK.findall(text))
    words = len(_WORDS.findall(_CJK.sub(" ", text)))
    return cjk > 0 and cjk * 2 >= cjk + words


def _spoken_number(match: re.Match[str]) -> str:
    from num2words import num2words

    digits = match.group(0).replace(",", "")
    try:
        return " " + num2words(float(digits) if "." in digits else int(digits)) + " "
    except (ValueError, OverflowError, NotImplementedError):
        return " " + " ".join(num2words(int(d)) for d in digits if d.isdigit()) + " "


def normalise(text: str, by_character: bool) -> str:
    """``text`` as it is compared: NFKC, case folded, no punctuation, numbers as words;
    for CER, the characters alone (spaces dropped)."""
    text = unicodedata.normalize("NFKC", text).casefold()
    if by_character:
        text = _KEEP.sub("", text.translate(_CJK_DIGITS))
        return "".join(text.split())
    text = _NUMBER.sub(_spoken_number, text)
    text = _KEEP.sub(" ", text.replace("-", " "))
    words = [w.strip("'") for w in text.split()]
    return " ".join(w for w in words if w)


def score(reference: str, hypothesis: str) -> Score:
    """``hypothesis`` (what was heard) against ``reference`` (what should have been said).
    A reference with nothing to say scores 0 against silence and 1 against any word."""
    import jiwer

    by_character = scored_by_character(reference)
    ref, hyp = normalise(reference, by_character), normalise(hypothesis, by_character)
    kind = "cer" if by_character else "wer"
    if not ref:
        return Score(kind, 0.0 if not hyp else 1.0, ref, hyp)
    if not hyp:
        return Score(kind, 1.0, ref, hyp)
    ratio = jiwer.cer(ref, hyp) if by_character else jiwer.wer(ref, hyp)
    return Score(kind, float(ratio), ref, hyp)
