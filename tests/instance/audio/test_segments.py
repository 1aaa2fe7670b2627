"""Long-text segments (cosyvoice_lb/instance/audio/segments.py): sentence splitting and the crossfaded join."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cosyvoice_lb.instance.audio.segments import Joiner, join, split_text


def squeezed(text: str) -> str:
    """The text without any whitespace: what splitting must keep, in order."""
    return "".join(text.split())


def check_segments(text: str, segments: list[str], max_chars: int) -> list[tuple[int, int]]:
    """The invariants every split must keep; returns where in the text each segment is."""
    assert squeezed("".join(segments)) == squeezed(text)
    spans = []
    pos = 0
    for seg in segments:
        assert seg and seg == seg.strip()
        assert len(seg) <= max_chars
        found = text.find(seg, pos)  # a slice of the text, in order
        assert found >= 0
        pos = found + len(seg)
        spans.append((found, pos))
    return spans


# --- sentences ---------------------------------------------------------------------------------


def sentences(text: str) -> list[str]:
    """The sentences split_text sees, one by one: with first_chars=1 the first segment is the first sentence."""
    found = []
    rest = text
    while rest.strip():
        first = split_text(rest, len(rest), first_chars=1)[0]
        found.append(first)
        rest = rest[rest.index(first) + len(first) :]
    return found


def test_english_sentence_ends():
    text = "Hello world. How are you today? I am fine! Thanks; and you."
    assert sentences(text) == ["Hello world.", "How are you today?", "I am fine!", "Thanks;", "and you."]


def test_english_sentences_are_packed_greedily():
    text = "Hello world. How are you today? I am fine! Thanks; and you."
    assert split_text(text, 20) == ["Hello world.", "How are you today?", "I am fine! Thanks;", "and you."]
    text = "One. Two. Three. Four. Five."
    assert split_text(text, 10) == ["One. Two.", "Three.", "Four.", "Five."]
    assert split_text(text, 16) == ["One. Two. Three.", "Four. Five."]


def test_a_text_that_fits_is_one_segment():
    text = "  Hello world. How are you?\nFine, thanks!  "
    assert split_text(text, len(text.strip())) == [text.strip()]
    assert split_text(text, len(text.strip()) - 1) == ["Hello world. How are you?", "Fine, thanks!"]


def test_chinese_ends_need_no_whitespace():
    text = "今天天气很好。我们去公园吧！你觉得呢？好；走吧…真的……"
    assert sentences(text) == ["今天天气很好。", "我们去公园吧！", "你觉得呢？", "好；", "走吧…", "真的……"]
    assert split_text(text, 7) == ["今天天气很好。", "我们去公园吧！", "你觉得呢？好；", "走吧…真的……"]


def test_mixed_chinese_and_english():
    text = "我喜欢Python. It is great。真的吗？Yes! 当然。"
    assert sentences(text) == ["我喜欢Python.", "It is great。", "真的吗？", "Yes!", "当然。"]
    assert split_text(text, 12) == ["我喜欢Python.", "It is great。", "真的吗？Yes! 当然。"]


def test_ascii_punctuation_needs_whitespace_after_it():
    assert sentences("Hello.World and Hi!There 你好.再见") == ["Hello.World and Hi!There 你好.再见"]


def test_closing_quotes_stay_with_their_sentence():
    assert sentences('He said "Stop!" Then he left.') == ['He said "Stop!"', "Then he left."]
    assert sentences("She asked (quietly.) Then left.") == ["She asked (quietly.)", "Then left."]
    assert sentences("“你好。”他说。「再见！」她答。") == ["“你好。”", "他说。", "「再见！」", "她答。"]
    assert sentences("It’s ‘done.’ Yes.") == ["It’s ‘done.’", "Yes."]


def test_numbers_are_not_split():
    text = "Pi is 3.14 and the total is 1,000 dollars. Version 2.0.1 is out."
    assert sentences(text) == ["Pi is 3.14 and the total is 1,000 dollars.", "Version 2.0.1 is out."]


def test_a_thousands_comma_is_not_a_clause_break():
    assert split_text("Alpha beta, 1,000,000 items", 20) == ["Alpha beta,", "1,000,000 items"]


def test_a_dot_before_a_lowercase_word_is_not_a_sentence_end():
    text = "Use a tool, e.g. a hammer. Then stop... and wait. Done... Next."
    assert sentences(text) == ["Use a tool, e.g. a hammer.", "Then stop... and wait.", "Done...", "Next."]


def test_newlines_end_sentences():
    text = "Title\nFirst paragraph here\n\n  second paragraph\r\nlast"
    assert sentences(text) == ["Title", "First paragraph here", "second paragraph", "last"]
    assert split_text(text, 20) == ["Title", "First paragraph here", "second paragraph", "last"]
    assert sentences("第一段\n第二段") == ["第一段", "第二段"]


def test_newlines_inside_a_packed_segment_are_kept():
    assert split_text("Title\n\nBody text.", 100) == ["Title\n\nBody text."]


# --- long sentences ----------------------------------------------------------------------------


def test_a_long_sentence_is_cut_at_its_last_clause_break_that_fits():
    text = "First part, second part, third part: and the rest of it"
    assert split_text(text, 30) == ["First part, second part,", "third part: and the rest of it"]


def test_a_long_chinese_sentence_is_cut_at_clause_breaks():
    text = "我们今天去了公园，看到了很多花、草和树：真是美好的一天"
    assert split_text(text, 12) == ["我们今天去了公园，", "看到了很多花、草和树：", "真是美好的一天"]
    assert split_text(text, 10) == ["我们今天去了公园，", "看到了很多花、", "草和树：", "真是美好的一天"]


def test_a_long_sentence_without_clause_breaks_is_cut_at_whitespace():
    text = "the quick brown fox jumps over the lazy dog"
    segments = split_text(text, 15)
    assert segments == ["the quick brown", "fox jumps over", "the lazy dog"]


def test_a_long_text_without_punctuation_is_cut_hard():
    text = "x" * 25_000
    segments = split_text(text, 1000)
    assert segments == ["x" * 1000] * 25
    assert split_text("abcdefg", 3) == ["abc", "def", "g"]


def test_a_long_text_of_words_without_punctuation_is_cut_between_words():
    words = [f"word{i}" for i in range(3000)]
    text = " ".join(words)
    segments = split_text(text, 200)
    check_segments(text, segments, 200)
    assert [w for seg in segments for w in seg.split()] == words  # no word cut in two
    assert all(len(seg) > 190 for seg in segments[:-1])  # and packed tight


def test_pieces_of_a_long_sentence_pack_with_the_next_sentence():
    assert split_text("aaaa bbbb cccc. Dd.", 10) == ["aaaa bbbb", "cccc. Dd."]


# --- first_chars -------------------------------------------------------------------------------


def test_first_chars_makes_the_first_segment_short():
    text = "Hi. This is a test. Of the first segment. And the rest of it."
    assert split_text(text, 100) == [text]
    assert split_text(text, 100, first_chars=20) == ["Hi. This is a test.", "Of the first segment. And the rest of it."]
    assert split_text(text, 100, first_chars=5) == ["Hi.", "This is a test. Of the first segment. And the rest of it."]


def test_a_first_sentence_longer_than_first_chars_is_the_first_segment():
    text = "This first sentence is long. Short. Another one."
    assert split_text(text, 100, first_chars=10) == ["This first sentence is long.", "Short. Another one."]


def test_a_first_sentence_longer_than_max_chars_is_cut_even_with_first_chars():
    text = "This first sentence is rather long, really. Short."
    assert split_text(text, 40, first_chars=10) == ["This first sentence is rather long,", "really. Short."]


def test_first_chars_above_max_chars_is_max_chars():
    text = "One. Two. Three."
    assert split_text(text, 10, first_chars=50) == split_text(text, 10) == ["One. Two.", "Three."]


@pytest.mark.parametrize("max_chars, first_chars", [(0, None), (-5, None), (10, 0)])
def test_limits_below_one_are_refused(max_chars, first_chars):
    with pytest.raises(ValueError):
        split_text("Hello.", max_chars, first_chars)


@pytest.mark.parametrize("text", ["", "   ", "\n\n\t ", " \u3000 "])
def test_nothing_to_say_is_no_segments(text):
    assert split_text(text, 10) == []


# --- properties --------------------------------------------------------------------------------

PUNCTUATION = ".!?;,:。！？；，、：…\"'“”‘’「」（）()\n\r\t  \u3000"
any_text = st.text(
    alphabet=st.one_of(
        st.characters(),
        st.sampled_from(PUNCTUATION),
        st.characters(min_codepoint=0x4E00, max_codepoint=0x4FFF),
    ),
    max_size=400,
)
limits = st.integers(min_value=1, max_value=120)
first_limits = st.none() | st.integers(min_value=1, max_value=150)

word = st.one_of(
    st.from_regex(r"[A-Za-z][a-z]{0,11}", fullmatch=True),
    st.from_regex(r"[0-9]{1,4}([.,][0-9]{1,3})?", fullmatch=True),
    st.text(alphabet=st.characters(min_codepoint=0x4E00, max_codepoint=0x4FFF), min_size=1, max_size=8),
)
separator = st.sampled_from([" ", " ", " ", ", ", "，", "、", ": ", "\n", "  "])
ending = st.sampled_from([". ", "! ", "? ", "; ", "。", "！", "？", "…", '." ', "」", "\n\n", ".\n"])
sentence = st.builds(
    lambda words, seps, end: "".join(w + s for w, s in zip(words, seps)) + words[-1] + end,
    st.lists(word, min_size=1, max_size=30),
    st.lists(separator, min_size=30, max_size=30),
    ending,
)
sentence_text = st.lists(sentence, max_size=40).map("".join)


@settings(max_examples=200, deadline=None)
@given(any_text, limits, first_limits)
def test_any_text_keeps_every_character_in_order_within_the_limit(text, max_chars, first_chars):
    check_segments(text, split_text(text, max_chars, first_chars), max_chars)


@settings(max_examples=50, deadline=None)
@given(sentence_text, limits, first_limits)
def test_sentence_like_text_keeps_every_character_in_order_within_the_limit(text, max_chars, first_chars):
    segments = split_text(text, max_chars, first_chars)
    spans = check_segments(text, segments, max_chars)
    if first_chars is None:
        # greedy: no two neighbours would have fitted in one segment
        for (start, _), (_, end) in zip(spans, spans[1:]):
            assert end - start > max_chars


@settings(max_examples=30, deadline=None)
@given(any_text | sentence_text)
def test_a_text_that_fits_is_one_segment_whatever_it_holds(text):
    stripped = text.strip()
    expected = [stripped] if stripped else []
    assert split_text(text, max(1, len(stripped))) == expected


# --- joining -----------------------------------------------------------------------------------

RATE = 1000  # 30 ms = 30 samples: easy to count
FADE = 30


def noise(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.5, 0.5, n).astype(np.float32)


def streamed(segments: list[np.ndarray], rate: int = RATE, crossfade_ms: float = 30.0) -> tuple[list[int], np.ndarray]:
    """The lengths of what each feed returned, and all outputs put together."""
    joiner = Joiner(rate, crossfade_ms)
    parts = [joiner.feed(s) for s in segments]
    parts.append(joiner.finish())
    for part in parts:
        assert part.dtype == np.float32 and part.ndim == 1
    return [p.size for p in parts], np.concatenate(parts)


def expected_length(lengths: list[int], fade: int = FADE) -> int:
    kept = [n for n in lengths if n]
    return sum(kept) - sum(min(fade, a // 2, b // 2) for a, b in zip(kept, kept[1:]))


LENGTHS = [
    [],
    [0],
    [1],
    [500],
    [500, 400],
    [500, 0, 400],
    [0, 500, 0],
    [500, 1, 400],
    [500, 20, 400],  # shorter than twice the fade: its fades shrink to 10
    [500, 59, 60, 61, 400],
    [7, 3, 2, 1, 1, 5],
    [30, 30],
    [200] * 10,
]


@pytest.mark.parametrize("lengths", LENGTHS)
def test_join_length_is_the_total_less_the_fades(lengths):
    segments = [noise(n, i) for i, n in enumerate(lengths)]
    out = join(segments, RATE)
    assert out.dtype == np.float32 and out.ndim == 1
    assert out.size == expected_length(lengths)


def test_join_length_with_full_fades():
    # 720-sample fades at 24 kHz, shrunk to half the shorter neighbour
    assert join([noise(500, 1), noise(400, 2), noise(300, 3)], 24000, crossfade_ms=30.0).size == 1200 - 200 - 150
    assert join([noise(5000, 1), noise(4000, 2), noise(3000, 3)], 24000, crossfade_ms=30.0).size == 12000 - 2 * 720


@pytest.mark.parametrize("lengths", LENGTHS)
def test_streaming_equals_join_exactly(lengths):
    segments = [noise(n, i) for i, n in enumerate(lengths)]
    sizes, out = streamed(segments)
    np.testing.assert_array_equal(out, join(segments, RATE))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=150), max_size=8), st.sampled_from([0.0, 5.0, 30.0, 100.0]))
def test_streaming_equals_join_exactly_for_any_lengths(lengths, crossfade_ms):
    segments = [noise(n, i) for i, n in enumerate(lengths)]
    _, out = streamed(segments, crossfade_ms=crossfade_ms)
    np.testing.assert_array_equal(out, join(segments, RATE, crossfade_ms))
    assert out.size == expected_length(lengths, round(crossfade_ms))


def test_feed_holds_back_only_the_tail_that_the_next_segment_fades_into():
    sizes, _ = streamed([noise(500, 1), noise(400, 2), noise(20, 3), noise(300, 4)])
    # first: all but its last 30; second: 30 faded + 400 - 30 - 30 held back;
    # third (fades shrink to 10): 20 of the second's tail unfaded + 10 faded + 0, 10 held back;
    # fourth: 10 faded + 300 - 10 - 30 held back; finish: the last 30
    assert sizes == [470, 370, 30, 270, 30]


def test_a_constant_passes_a_boundary_at_its_level():
    out = join([np.full(500, 0.5, np.float32), np.full(400, 0.5, np.float32)], RATE)
    assert out.size == 870
    np.testing.assert_allclose(out, 0.5, atol=1e-6)


def test_the_boundary_is_a_smooth_fade_from_one_segment_to_the_next():
    out = join([np.ones(100, np.float32), np.zeros(100, np.float32)], RATE)
    assert out.size == 170
    assert np.all(out[:70] == 1.0) and np.all(out[100:] == 0.0)
    ramp = out[70:100]
    assert np.all(np.diff(ramp) < 0)  # falls steadily
    assert 0.0 < ramp[-1] < 0.01 and 0.99 < ramp[0] < 1.0  # from (almost) one to (almost) zero
    assert ramp[14] > 0.5 > ramp[15]  # half-way at the middle


def test_segments_without_a_neighbour_are_unchanged():
    seg = noise(300, 5)
    np.testing.assert_array_equal(join([seg], RATE), seg)
    np.testing.assert_array_equal(join([seg, np.zeros(0, np.float32)], RATE), seg)
    assert join([], RATE).size == 0


def test_no_crossfade_is_plain_concatenation():
    a, b = noise(100, 1), noise(50, 2)
    np.testing.assert_array_equal(join([a, b], RATE, crossfade_ms=0), np.concatenate([a, b]))


def test_other_dtypes_and_shapes_come_out_float32_mono():
    a = np.linspace(-1, 1, 200)  # float64
    b = np.full((1, 200), 0.25)  # what a model often returns
    out = join([a, b], RATE)
    assert out.dtype == np.float32 and out.shape == (370,)
    _, joined = streamed([a, b])
    np.testing.assert_array_equal(joined, out)
    with pytest.raises(ValueError):
        join([np.zeros((2, 100))], RATE)


def test_a_joiner_can_be_used_again_after_finish():
    segs = [noise(100, 1), noise(100, 2)]
    joiner = Joiner(RATE)
    first = np.concatenate([joiner.feed(s) for s in segs] + [joiner.finish()])
    again = np.concatenate([joiner.feed(s) for s in segs] + [joiner.finish()])
    np.testing.assert_array_equal(first, again)


def test_feeding_does_not_keep_a_view_of_the_callers_buffer():
    seg = noise(100, 1)
    joiner = Joiner(RATE)
    joiner.feed(seg)
    expected = seg[-FADE:].copy()
    seg[:] = 0
    np.testing.assert_array_equal(joiner.finish(), expected)


@pytest.mark.parametrize("rate, crossfade_ms", [(0, 30.0), (24000, -1.0), (24000, float("nan")), (24000, float("inf"))])
def test_bad_settings_are_refused(rate, crossfade_ms):
    with pytest.raises(ValueError):
        Joiner(rate, crossfade_ms)
    with pytest.raises(ValueError):
        join([noise(10, 1)], rate, crossfade_ms)
