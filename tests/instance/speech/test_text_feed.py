"""Text as a voice agent writes it (speech.text_feed): complete sentences out of pieces, and
the word-bounded feed an engine reads while it speaks."""

from __future__ import annotations

import threading

import pytest

from cosyvoice_lb.instance.speech.text_feed import Sentences, Stopped, TextFeed, word_pieces


def fed(pieces: list[str], max_chars: int = 300) -> list[list[str]]:
    sentences = Sentences(max_chars)
    return [sentences.feed(piece) for piece in pieces] + [sentences.finish()]


def test_a_sentence_goes_out_once_the_next_character_shows_it_ended():
    assert fed(["Hello there", ".", " How", " are you"]) == [[], [], ["Hello there."], [], ["How are you"]]


def test_question_and_exclamation_marks_and_full_width_ends_need_nothing_after_them():
    assert fed(["Really?", " Yes!", "你好。", "世界"]) == [["Really?"], ["Yes!"], ["你好。"], [], ["世界"]]
    assert fed(['He said "stop!"', " then"]) == [['He said "stop!"'], [], ["then"]]


def test_numbers_and_abbreviations_do_not_end_a_sentence():
    assert fed(["Pi is 3", ".14 today", ". Next"]) == [[], [], ["Pi is 3.14 today."], ["Next"]]
    assert fed(["Bring fruit, e.g. apples", ", and more."]) == [[], [], ["Bring fruit, e.g. apples, and more."]]


def test_a_line_break_ends_a_sentence():
    assert fed(["A heading\n", "The body"]) == [["A heading"], [], ["The body"]]


def test_a_run_on_sentence_goes_out_in_pieces_at_clause_breaks():
    out = fed(["one two three, four five six, seven eight nine, ten"], max_chars=20)
    assert out[0] == ["one two three,", "four five six,", "seven eight nine,"] and out[-1] == ["ten"]
    assert all(len(s) <= 20 for group in out for s in group)


def test_nothing_is_lost_or_reordered_whatever_the_pieces():
    text = "First one. Second one? Third, with a clause! 第四。 Fifth 3.5 and e.g. six.\nSeventh"
    for size in (1, 2, 3, 7, 50):
        groups = fed([text[i : i + size] for i in range(0, len(text), size)])
        joined = " ".join(s for group in groups for s in group)
        assert joined.replace(" ", "") == text.replace(" ", "").replace("\n", ""), size


def test_word_pieces_never_split_a_word():
    assert word_pieces("Hello wor") == ("Hello ", "wor")
    assert word_pieces("Hello") == ("", "Hello")
    assert word_pieces("Hello, ") == ("Hello, ", "")
    assert word_pieces("你好世") == ("你好世", "")  # (each CJK character stands alone)
    assert word_pieces("half", final=True) == ("half", "")


def test_a_feed_hands_the_engine_whole_words_as_they_come_and_ends_with_the_text():
    feed = TextFeed(poll=0.01)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.extend(feed))
    reader.start()
    for delta in ("Hel", "lo wor", "ld, this", " ends"):
        feed.put(delta)
    feed.end()
    reader.join(5)
    assert got == ["Hello ", "world, ", "this ", "ends"]
    assert feed.so_far() == "Hello world, this ends" and feed.tail() == "world, this ends"


def test_a_stopped_feed_lets_a_waiting_engine_go():
    class Lease:
        def __init__(self) -> None:
            self.marks: list[bool] = []

        def waiting(self, idle: bool) -> None:
            self.marks.append(idle)

    lease = Lease()
    feed = TextFeed(lease, poll=0.01)
    feed.put("One ")
    errors: list[BaseException] = []

    def read() -> None:
        try:
            list(feed)
        except Stopped as exc:
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    threading.Event().wait(0.1)
    feed.stop()
    reader.join(5)
    assert not reader.is_alive() and len(errors) == 1
    assert lease.marks[:2] == [True, False]  # it waited for the client (no stall), then went on


@pytest.mark.parametrize("text", ["", "   ", "\n\n"])
def test_blank_text_makes_no_sentence(text):
    assert fed([text]) == [[], []]
