"""The flite engine on Debian's real flite: its voices, speed, sentences as they are made,
and text it cannot speak refused as such."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from cosyvoice_lb.instance.engines import EngineError, SynthesisRequest, Unspeakable, create_engine
from cosyvoice_lb.instance.engines.flite import SAMPLE_RATE, VOICES, FliteEngine, sentences

pytestmark = pytest.mark.skipif(not shutil.which("flite"), reason="flite is not installed (apt-get install flite)")

TEXT = "Hello, this is a short check of the voice. The weather is nice today."


@pytest.fixture(scope="module")
def flite():
    engine = create_engine("flite")
    engine.load()
    return engine


def seconds(chunks) -> float:
    return sum(c.size for c in chunks) / SAMPLE_RATE


def test_each_sentence_is_a_chunk_of_real_speech_at_16_khz(flite):
    chunks = list(flite.synthesize(SynthesisRequest(text=TEXT)))
    assert len(chunks) == 2 and all(c.dtype == np.float32 and c.ndim == 1 for c in chunks)
    assert 1.5 < seconds(chunks[:1]) < 5 and 1 < seconds(chunks[1:]) < 4
    assert all(0.05 < float(np.max(np.abs(c))) <= 1.0 for c in chunks)  # speech, not silence, not clipped


def test_every_voice_speaks_in_its_own_voice(flite):
    assert flite.speakers() == list(VOICES) == ["slt", "rms", "awb", "kal"]
    made = {
        v: np.concatenate(list(flite.synthesize(SynthesisRequest(text="Good morning.", speaker=v)))) for v in VOICES
    }
    lengths = {v: a.size for v, a in made.items()}
    assert len(set(lengths.values())) == len(VOICES)  # four different voices, not one voice four times


def test_speed_shortens_and_lengthens_the_speech(flite):
    def length(speed: float) -> float:
        return seconds(list(flite.synthesize(SynthesisRequest(text=TEXT, speed=speed))))

    normal = length(1.0)
    assert length(2.0) < normal * 0.6 and length(0.5) > normal * 1.6


@pytest.mark.parametrize("text", ["你好，世界。", "...", "  ", "— ! ?"])
def test_text_with_nothing_it_can_say_is_unspeakable(flite, text):
    with pytest.raises(Unspeakable, match="English only"):
        list(flite.synthesize(SynthesisRequest(text=text)))


def test_other_scripts_in_english_text_are_left_out(flite):
    assert sentences("Hello 你好 world. 再见") == ["Hello   world."]
    assert sentences("One. Two!  Three? four; five\nsix") == ["One.", "Two!", "Three?", "four;", "five", "six"]
    chunks = list(flite.synthesize(SynthesisRequest(text="Hello 你好 world.")))
    assert len(chunks) == 1 and seconds(chunks) > 0.3


def test_a_client_that_left_stops_it_between_sentences(flite):
    import threading

    cancel = threading.Event()
    made = flite.synthesize(SynthesisRequest(text="One. Two. Three. Four.", cancel=cancel))
    next(made)
    cancel.set()
    assert list(made) == []


def test_without_flite_the_load_says_how_to_install_it():
    with pytest.raises(EngineError, match="apt-get install flite"):
        FliteEngine(binary="flite-that-is-not-here").load()
