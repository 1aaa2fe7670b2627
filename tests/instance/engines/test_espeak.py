"""The embedded engine: real espeak-ng speech, Chinese spoken as Mandarin."""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest

from cosyvoice_lb.instance.engines import SynthesisRequest, Unspeakable, create_engine
from cosyvoice_lb.instance.engines.espeak import EspeakEngine, speakable, split_runs


@pytest.fixture(scope="module")
def engine():
    e = EspeakEngine()
    e.load()
    return e


def speak(engine, text, speed=1.0) -> np.ndarray:
    return np.concatenate(list(engine.synthesize(SynthesisRequest(text, speed))))


def test_split_runs_sends_chinese_to_the_pinyin_voice_with_tone_numbers():
    assert split_runs("Hello, 你好，世界。") == [("en", "Hello, "), ("cmn-latn-pinyin", "ni3 hao3, shi4 jie4.")]
    assert split_runs("  ") == []
    assert split_runs("！！") == []


def test_chinese_is_spoken_with_mandarin_tones_not_english_digits():
    for voice, text in split_runs("你好世界"):
        phonemes = subprocess.run(
            ["espeak-ng", "-q", "-x", "-v", voice, text], capture_output=True, text=True, check=True
        ).stdout
        assert "Tr'i:" not in phonemes  # "three" read as English: the known espeak-ng cmn failure
        # Four syllables, each with a Mandarin tone contour (e.g. 35, 21, 51), no English words.
        assert len(re.findall(r"'[^_|]*?\d{2,3}_", phonemes)) == 4, phonemes


@pytest.mark.parametrize("text", ["Hello world.", "你好，世界。", "Mixed 中文 and English."])
def test_speech_is_not_silent(engine, text):
    audio = speak(engine, text)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert np.sqrt(np.mean(audio**2)) > 0.01
    assert np.abs(audio).max() <= 1.0


def test_length_grows_with_text_and_shrinks_with_speed(engine):
    one = speak(engine, "One sentence here.")
    three = speak(engine, "One sentence here. Another sentence here. A third sentence here.")
    assert len(three) > 2 * len(one)
    zh_short, zh_long = speak(engine, "你好。"), speak(engine, "你好。今天天气很好，我们去公园散步吧。")
    assert len(zh_long) > 2 * len(zh_short)
    assert len(speak(engine, "One sentence here.", 2.0)) < 0.75 * len(one)


def test_missing_binary_is_a_clear_error():
    from cosyvoice_lb.instance.engines import EngineError

    with pytest.raises(EngineError, match="apt-get install espeak-ng"):
        EspeakEngine(binary="espeak-ng-missing").load()


def test_create_engine_refuses_unknown_names():
    assert create_engine("espeak").name == "espeak"
    with pytest.raises(ValueError, match="unknown engine 'nope'"):
        create_engine("nope")


# --- texts espeak-ng crashes on --------------------------------------------------------------

CRASHES = "a." * 100  # a long chain of dotted letters: espeak-ng aborts ("stack smashing detected")


def test_espeak_ng_itself_crashes_on_a_long_chain_of_dotted_letters():
    done = subprocess.run(["espeak-ng", "-q", "-v", "en"], input=CRASHES.encode(), capture_output=True)
    assert done.returncode < 0  # killed by a signal: what the engine rewrites the text against


@pytest.mark.parametrize("text", [CRASHES, "A." * 100, "a.b." * 60, "x " + "a." * 200 + "b end"])
def test_a_long_chain_of_dotted_letters_is_spoken_letter_by_letter(engine, text):
    assert ". " in speakable(text)
    audio = speak(engine, text)
    assert np.sqrt(np.mean(audio**2)) > 0.01


@pytest.mark.parametrize("text", ["U.S.A. is big.", "e.g. this, i.e. that.", "a.b.c.d.e.f.g.", "v1.2.3 and 3.14"])
def test_short_abbreviations_and_numbers_are_left_as_they_are(text):
    assert speakable(text) == text


def test_a_crash_is_unspeakable_with_a_message_for_the_client_and_the_details_in_the_log(engine, caplog):
    with caplog.at_level("WARNING", logger="cosyvoice_lb.instance"), pytest.raises(Unspeakable) as caught:
        engine._speak("en", CRASHES, 175)  # (past the rewrite: what an unknown crash does)
    message = str(caught.value)
    assert "cannot speak this text" in message and "reword" in message
    assert "stack smashing" not in message  # (stderr is for the log, not the client)
    assert "stack smashing" in caplog.text and "crashed (signal" in caplog.text
    assert len(speak(engine, "Still speaking.")) > 0  # the engine lives on
