"""The audio check (cosyvoice_lb/instance/audio/check.py), pure: what counts as speech units,
the duration bounds, and what each fault looks like fed whole or chunk by chunk; and that the
engines that run here (espeak, the simulated load model) pass it."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cosyvoice_lb.instance.audio.check import (
    LIMIT,
    MAX_BASE_SECONDS,
    MIN_SECONDS_PER_UNIT,
    REASONS,
    SILENCE_PEAK,
    AudioCheck,
    check_audio,
    duration_bounds,
    speech_units,
)
from cosyvoice_lb.instance.engines import SynthesisRequest

RATE = 16000


def voice(seconds: float, level: float = 0.3, rate: int = RATE) -> np.ndarray:
    """A stand-in for speech: a tone of ``seconds`` at peak ``level``."""
    t = np.arange(int(seconds * rate)) / rate
    return (level * np.sin(2 * np.pi * 180 * t)).astype(np.float32)


def fed(audio: np.ndarray, text: str, cuts: list[int], speed: float = 1.0):
    """The check fed ``audio`` cut at ``cuts``: the first fault, or None."""
    check = AudioCheck(text, speed, RATE)
    for piece in np.split(audio, sorted(set(c % (audio.size + 1) for c in cuts))):
        fault = check.chunk(piece)
        if fault is not None:
            return fault
    return check.finish()


# --- speech units and bounds ------------------------------------------------------------


@pytest.mark.parametrize(
    "text, units",
    [
        ("Hello, world!", 2),
        ("Warm-up.", 2),
        ("你好世界", 4),  # each ideograph
        ("こんにちは", 5),  # each kana
        ("안녕하세요", 5),  # each Hangul syllable
        ("Call 911 now", 5),  # each digit
        ("Hello世界", 3),
        ("...!?", 0),
        ("* * *", 0),
        ("", 0),
        ("snake_case", 2),
        ("Привет, мир", 2),
        ("naïve café", 2),
    ],
)
def test_speech_units_count_what_a_voice_says(text, units):
    assert speech_units(text) == units


def test_the_bounds_follow_the_text_and_a_speed_only_widens_them():
    short, long = duration_bounds("Hi."), duration_bounds("Hi. " * 50)
    assert short.units == 1 and long.units == 50
    assert short.shortest == pytest.approx(MIN_SECONDS_PER_UNIT)
    assert long.shortest == pytest.approx(50 * MIN_SECONDS_PER_UNIT)
    assert MAX_BASE_SECONDS < short.longest < long.longest
    at = {speed: duration_bounds("Hello there, general Kenobi.", speed) for speed in (0.25, 0.5, 1.0, 2.0, 4.0)}
    assert at[2.0].shortest == at[1.0].shortest / 2 and at[4.0].shortest == at[1.0].shortest / 4
    assert at[0.5].shortest == at[1.0].shortest  # (slower never raises the minimum: an engine may ignore it)
    assert at[0.5].longest == 2 * at[1.0].longest and at[0.25].longest == 4 * at[1.0].longest
    assert at[2.0].longest == at[1.0].longest  # (faster never lowers the maximum)
    nothing = duration_bounds("...")
    assert (nothing.units, nothing.shortest) == (0, 0.0) and nothing.longest > 0


@given(st.text(max_size=300), st.floats(min_value=0.25, max_value=4.0))
def test_bounds_are_ordered_and_grow_with_the_text(text, speed):
    bounds = duration_bounds(text, speed)
    assert 0 <= bounds.shortest < bounds.longest
    more = duration_bounds(text + " and more words", speed)
    assert more.shortest >= bounds.shortest and more.longest >= bounds.longest


@pytest.mark.parametrize("speed", [0.0, -1.0, float("nan"), float("inf")])
def test_a_speed_that_is_not_one_counts_as_1(speed):
    assert duration_bounds("Hello there.", speed) == duration_bounds("Hello there.", 1.0)


# --- good audio passes --------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(["Hello.", "Good morning, how are you today?", "你好，世界。", "Call 911.", "Warm-up."]),
    st.floats(min_value=0.5, max_value=2.0),
    st.floats(min_value=0.01, max_value=1.0),
    st.lists(st.integers(min_value=0, max_value=10**6), max_size=8),
)
def test_speech_of_a_plausible_length_passes_however_it_is_chunked(text, per_unit, level, cuts):
    seconds = max(0.05, per_unit * 0.3 * speech_units(text))  # 0.15-0.6 s a unit
    assert fed(voice(seconds, level), text, cuts) is None


def test_audio_at_exactly_full_scale_and_one_fp16_step_above_passes():
    audio = voice(1.0, 1.0)
    audio[100], audio[200] = 1.0, -LIMIT
    assert check_audio(audio, "Hello there.") is None
    assert LIMIT == pytest.approx(1.0 + 2**-10)


def test_no_audio_at_all_is_left_to_the_pipeline():
    check = AudioCheck("Hello there.")
    assert check.chunk(np.zeros(0, np.float32)) is None and check.finish() is None


def test_text_with_nothing_to_say_is_not_judged_silent_or_short():
    assert check_audio(np.zeros(160, np.float32), "...") is None
    assert check_audio(voice(0.005), "* * *") is None


# --- each fault ---------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    st.integers(min_value=0, max_value=RATE - 1),
    st.sampled_from([np.nan, np.inf, -np.inf]),
    st.lists(st.integers(min_value=0, max_value=RATE), max_size=6),
)
def test_one_non_finite_sample_anywhere_is_found_in_its_chunk(where, value, cuts):
    audio = voice(1.0)
    audio[where] = value
    fault = fed(audio, "Hello there, friend.", cuts)
    assert fault is not None and fault.reason == "non_finite"
    assert "NaN or infinite" in str(fault)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(min_value=0, max_value=RATE - 1),
    st.floats(min_value=1.002, max_value=1e6),
    st.booleans(),
    st.lists(st.integers(min_value=0, max_value=RATE), max_size=6),
)
def test_one_sample_beyond_the_limit_anywhere_is_out_of_range(where, value, negative, cuts):
    audio = voice(1.0)
    audio[where] = -value if negative else value
    fault = fed(audio, "Hello there, friend.", cuts)
    assert fault is not None and fault.reason == "out_of_range"
    assert "beyond ±1" in str(fault)


@pytest.mark.parametrize("level", [0.0, 1e-5, SILENCE_PEAK * 0.99])
def test_silence_for_words_is_bad(level):
    fault = check_audio(voice(1.0, level), "Hello there, friend.")
    assert fault is not None and fault.reason == "silent" and "silence" in str(fault)


def test_a_quiet_voice_just_above_the_threshold_passes():
    assert check_audio(voice(1.0, SILENCE_PEAK * 1.5), "Hello there, friend.") is None


@pytest.mark.parametrize("speed", [0.5, 1.0, 2.0])
def test_a_few_ms_for_words_is_too_short(speed):
    text = "Hello there, my good friend."  # 5 units: at least 0.15 s at speed 1
    fault = check_audio(voice(0.005), text, speed)
    assert fault is not None and fault.reason == "too_short" and "at least" in str(fault)
    assert check_audio(voice(duration_bounds(text, speed).shortest * 1.01), text, speed) is None


def test_a_runaway_is_stopped_at_the_chunk_that_passes_the_maximum():
    text = "Hi."
    longest = duration_bounds(text).longest
    check = AudioCheck(text, 1.0, RATE)
    second = voice(1.0)
    results = [check.chunk(second) for _ in range(int(longest) + 2)]
    first_fault = next(i for i, f in enumerate(results) if f is not None)
    assert first_fault == int(longest)  # the first chunk that takes it past the bound
    assert results[first_fault].reason == "too_long"


def test_every_fault_reason_is_one_the_metrics_count():
    faults = [
        check_audio(np.full(RATE, np.nan, np.float32), "Hello."),
        check_audio(np.full(RATE, 4.0, np.float32), "Hello."),
        check_audio(np.zeros(RATE, np.float32), "Hello."),
        check_audio(voice(0.001), "Hello there."),
        check_audio(voice(MAX_BASE_SECONDS + 20), "Hello."),
    ]
    assert [f.reason for f in faults if f is not None] == list(REASONS)


# --- the engines that run here pass it ------------------------------------------------------


@pytest.mark.parametrize("speed", [0.25, 0.5, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("text", ["I", "Hi.", "Warm-up.", "你", "2024", "Hello, this is a short check of the voice."])
def test_the_simulated_engine_passes_at_every_speed(text, speed):
    from cosyvoice_lb.instance.engines.simulated import SimulatedEngine

    engine = SimulatedEngine(simulated_ms_per_char=0)
    audio = np.concatenate(list(engine.synthesize(SynthesisRequest(text, speed=speed))))
    assert check_audio(audio, text, speed, engine.sample_rate) is None


@pytest.mark.parametrize("fault, reason", [("nan", "non_finite"), ("silence", "silent"), ("loud", "out_of_range"), ("short", "too_short")])  # fmt: skip
def test_the_simulated_engines_faults_are_what_the_check_finds(tmp_path, fault, reason):
    from cosyvoice_lb.instance.engines.simulated import SimulatedEngine

    engine = SimulatedEngine(simulated_ms_per_char=0, simulated_fault_dir=str(tmp_path), port=7860)
    text = "Hello, this is a short check of the voice."
    assert check_audio(np.concatenate(list(engine.synthesize(SynthesisRequest(text)))), text) is None
    (tmp_path / "7861").write_text("nan")  # another instance's file: not this one's
    assert check_audio(np.concatenate(list(engine.synthesize(SynthesisRequest(text)))), text) is None
    (tmp_path / "7860").write_text(f"{fault}\n")
    found = check_audio(np.concatenate(list(engine.synthesize(SynthesisRequest(text)))), text)
    assert found is not None and found.reason == reason
    (tmp_path / "7860").unlink()  # read at each synthesis: gone, the audio is good again
    assert check_audio(np.concatenate(list(engine.synthesize(SynthesisRequest(text)))), text) is None


def test_a_fault_file_that_says_something_else_is_an_engine_error(tmp_path):
    from cosyvoice_lb.instance.engines import EngineError
    from cosyvoice_lb.instance.engines.simulated import SimulatedEngine

    (tmp_path / "7860").write_text("purple")
    engine = SimulatedEngine(simulated_ms_per_char=0, simulated_fault_dir=str(tmp_path), port=7860)
    with pytest.raises(EngineError, match="says 'purple': write one of nan, silence, loud, short"):
        list(engine.synthesize(SynthesisRequest("Hello.")))


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")
@pytest.mark.parametrize("speed", [0.5, 2.0])
@pytest.mark.parametrize("text", ["Hi.", "Hello, this is a short check of the voice.", "Call 911 at 10:30.", "a" * 40])
def test_espeaks_real_speech_passes(text, speed):
    from cosyvoice_lb.instance.engines.espeak import EspeakEngine

    engine = EspeakEngine()
    engine.load()
    audio = np.concatenate(list(engine.synthesize(SynthesisRequest(text, speed=speed))))
    assert check_audio(audio, text, speed, engine.sample_rate) is None
