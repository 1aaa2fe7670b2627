"""Long texts in segments: split at sentence boundaries, join the segments' audio with a crossfade.

A long text (an article, a chapter) is cut into segments that are synthesized in parallel; the
audio comes back per segment and is joined in order. ``split_text`` decides the segments,
``Joiner`` joins audio as it arrives (streaming) and ``join`` does the same in one call.

Instance side: standard library and numpy only.

Splitting rules, in order of preference:

- sentence ends: ``. ! ? ;`` followed by whitespace or the end of the text (so ``3.14`` stays
  whole; a run of dots followed by a lowercase word, as in "e.g. this", is not an end either),
  the full-width ``。 ！ ？ ；`` and ``…`` (no whitespace needed), and line breaks. Closing
  quotes and brackets right after the punctuation stay with their sentence.
- consecutive sentences are packed greedily into segments of at most ``max_chars`` characters
  (the first one at most ``first_chars`` when given).
- a sentence longer than ``max_chars`` is cut at its last clause break that fits (``, :``
  followed by whitespace, ``， 、 ：``), else at its last whitespace that fits, else hard.

Segments are slices of the text without surrounding whitespace; nothing else is dropped or
reordered, and whitespace inside a segment is kept as it was.

The crossfade is a raised-cosine one whose two gains always add up to exactly one (like a linear
fade, unlike an equal-power fade whose gains add up to as much as 1.41 mid-way). Material that is
the same on both sides of a boundary -- a constant, a held vowel, the room tone both segments
start and end with -- therefore passes at its level, without the up to +3 dB bump an equal-power
fade would put on it; the cosine shape (rather than a straight line) starts and ends the fade
without a kink. Unrelated material dips by at most 3 dB at the middle of a 30 ms fade, which at a
sentence boundary (mostly near-silence) is not heard.
"""

from __future__ import annotations

import bisect
import math
import re

import numpy as np

# Sentence ends that need no whitespace after them.
_CJK_ENDS = "。｡！？；…"
# Sentence ends that do (English and other space-separated scripts).
_ASCII_ENDS = ".!?;"
# Closing quotes and brackets that belong to the sentence they follow.
_CLOSERS = "\"'”’」』）)]】》〕»"
_LINE_BREAKS = "\n\r\u2028\u2029"

_END_OR_BREAK = re.compile("[" + re.escape(_ASCII_ENDS + _CJK_ENDS) + "]+|[" + _LINE_BREAKS + "]")
# Clause breaks inside a sentence: where a too-long sentence is cut first. The end of a match is the cut.
_CLAUSE_BREAK = re.compile(r"[，、：]|[,:](?=\s)")
_WHITESPACE = re.compile(r"\s")


def split_text(text: str, max_chars: int, first_chars: int | None = None) -> list[str]:
    """Split ``text`` into segments of at most ``max_chars`` characters at sentence boundaries.

    The first segment is at most ``first_chars`` characters when given (a short first segment
    makes the first audio come sooner when streaming), but always holds at least the first
    sentence (or the first ``max_chars``-sized piece of it). A text that fits in ``max_chars``
    comes back as one segment when ``first_chars`` is None.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be at least 1, not {max_chars}")
    if first_chars is not None and first_chars < 1:
        raise ValueError(f"first_chars must be at least 1, not {first_chars}")
    units: list[tuple[int, int]] = []
    for start, end in _sentences(text):
        units.extend(_cut_long(text, start, end, max_chars))
    if not units:
        return []
    limit = max_chars if first_chars is None else min(first_chars, max_chars)
    segments: list[str] = []
    seg_start, seg_end = units[0]
    for start, end in units[1:]:
        if end - seg_start <= limit:
            seg_end = end
        else:
            segments.append(text[seg_start:seg_end])
            seg_start, seg_end = start, end
            limit = max_chars
    segments.append(text[seg_start:seg_end])
    return segments


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence of ``text`` by the rules above, whitespace excluded."""
    return _sentences(text)


def _sentences(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence, surrounding whitespace excluded; whitespace-only ones left out."""
    n = len(text)
    bounds: list[int] = [0]
    for match in _END_OR_BREAK.finditer(text):
        run = match.group()
        end = match.end()
        if run[0] in _LINE_BREAKS:
            bounds.append(end)
            continue
        while end < n and text[end] in _CLOSERS:
            end += 1
        if not any(c in _CJK_ENDS for c in run):
            if end < n and not text[end].isspace():
                continue  # "3.14", "Hello.World": not an end
            if run.strip(".") == "" and _lowercase_follows(text, end):
                continue  # "e.g. this", "and so on... and on"
        bounds.append(end)
    bounds.append(n)
    spans = []
    for start, end in zip(bounds, bounds[1:]):
        while start < end and text[start].isspace():
            start += 1
        while end > start and text[end - 1].isspace():
            end -= 1
        if start < end:
            spans.append((start, end))
    return spans


def _lowercase_follows(text: str, pos: int) -> bool:
    """Whether the next word on the same line, after ``pos``, starts with a lowercase letter."""
    n = len(text)
    while pos < n and text[pos].isspace():
        if text[pos] in _LINE_BREAKS:
            return False
        pos += 1
    return pos < n and text[pos].islower()


def _cut_long(text: str, start: int, end: int, max_chars: int) -> list[tuple[int, int]]:
    """The sentence text[start:end] in pieces of at most ``max_chars``: clause breaks, else whitespace, else hard."""
    if end - start <= max_chars:
        return [(start, end)]
    sentence = text[start:end]
    clauses = [start + m.end() for m in _CLAUSE_BREAK.finditer(sentence)]
    spaces = [start + m.start() for m in _WHITESPACE.finditer(sentence)]
    pieces = []
    while end - start > max_chars:
        window_end = start + max_chars
        cut = _last_in(clauses, start, window_end)
        if cut is not None:
            piece_end = cut
        else:
            cut = _last_in(spaces, start, window_end)
            if cut is None:
                cut = piece_end = window_end
            else:
                piece_end = cut
                while text[piece_end - 1].isspace():
                    piece_end -= 1
        pieces.append((start, piece_end))
        start = cut
        while text[start].isspace():
            start += 1
    pieces.append((start, end))
    return pieces


def _last_in(positions: list[int], low: int, high: int) -> int | None:
    """The largest of the sorted ``positions`` with low < p <= high, if any."""
    i = bisect.bisect_right(positions, high)
    if i and positions[i - 1] > low:
        return positions[i - 1]
    return None


class Joiner:
    """Joins segment audio in order with a crossfade; streaming-friendly.

    Each ``feed`` returns all of the joined audio that is final so far: everything except the
    tail of the latest segment, which the next segment will fade into. ``finish`` returns that
    tail. The outputs put together equal ``join`` of the same segments, sample for sample.
    """

    def __init__(self, rate: int, crossfade_ms: float = 30.0):
        self._fade = _fade_samples(rate, crossfade_ms)
        self._tail = np.zeros(0, dtype=np.float32)  # the latest segment's end, for the next one to fade into

    def feed(self, audio: np.ndarray) -> np.ndarray:
        """Take the next segment (mono); return the joined audio that can go out now (float32)."""
        seg = _mono(audio)
        if seg.size == 0:
            return np.zeros(0, dtype=np.float32)
        hold = min(self._fade, seg.size // 2)
        k = min(self._tail.size, seg.size // 2)  # nothing to fade into before the first segment
        kept = self._tail.size - k
        out = np.concatenate([self._tail[:kept], _crossfade(self._tail[kept:], seg[:k]), seg[k : seg.size - hold]])
        self._tail = seg[seg.size - hold :].copy()
        return out

    def finish(self) -> np.ndarray:
        """The held-back tail of the last segment; the joiner is then ready for a new sequence."""
        out = self._tail
        self._tail = np.zeros(0, dtype=np.float32)
        return out


def join(segments: list[np.ndarray], rate: int, crossfade_ms: float = 30.0) -> np.ndarray:
    """The segments' audio (mono) in order, each boundary crossfaded; float32.

    A boundary's fade is ``crossfade_ms`` long, shortened to half the shorter neighbour where a
    segment is too short for full fades at both its ends; empty segments are skipped. The length
    is therefore the segments' total length less the fade of every boundary.
    """
    fade = _fade_samples(rate, crossfade_ms)
    segs = [s for s in (_mono(a) for a in segments) if s.size]
    if not segs:
        return np.zeros(0, dtype=np.float32)
    fades = [min(fade, a.size // 2, b.size // 2) for a, b in zip(segs, segs[1:])]
    out = np.empty(sum(s.size for s in segs) - sum(fades), dtype=np.float32)
    pos = 0
    head = 0  # how much of the current segment's start is already in ``out`` (faded into the previous one)
    for i, seg in enumerate(segs):
        tail = fades[i] if i < len(fades) else 0
        body = seg[head : seg.size - tail]
        out[pos : pos + body.size] = body
        pos += body.size
        if tail:
            out[pos : pos + tail] = _crossfade(seg[seg.size - tail :], segs[i + 1][:tail])
            pos += tail
        head = tail
    return out


def _fade_samples(rate: int, crossfade_ms: float) -> int:
    if rate < 1:
        raise ValueError(f"rate must be a positive number of samples per second, not {rate}")
    if not (crossfade_ms >= 0 and math.isfinite(crossfade_ms)):
        raise ValueError(f"crossfade_ms must be zero or more, not {crossfade_ms}")
    return int(round(rate * crossfade_ms / 1000.0))


def _mono(audio: np.ndarray) -> np.ndarray:
    """``audio`` as 1-D float32; a (1, n) or (n, 1) array counts as mono."""
    a = np.asarray(audio, dtype=np.float32)
    if a.ndim == 1:
        return a
    if a.ndim == 2 and 1 in a.shape:
        return a.reshape(-1)
    raise ValueError(f"expected mono audio (one channel), got an array of shape {a.shape}")


def _crossfade(out_going: np.ndarray, in_coming: np.ndarray) -> np.ndarray:
    """Raised-cosine crossfade of two equally long pieces; the two gains add up to one at every sample."""
    k = out_going.size
    if k == 0:
        return np.zeros(0, dtype=np.float32)
    rise = (np.sin(0.5 * np.pi * (np.arange(k) + 0.5) / k) ** 2).astype(np.float32)
    return out_going * (np.float32(1.0) - rise) + in_coming * rise
