"""The speech check: scoring (pure), the recognisers behind their adapters (pocketsphinx for
real, on real speech from flite, on espeak-ng's, on a tone and on noise), the worker that keeps
it off the hot path, and the choice of recogniser."""

from __future__ import annotations

import random
import shutil
import threading
import time

import numpy as np
import pytest

from cosyvoice_lb.instance.engines import SynthesisRequest, create_engine
from cosyvoice_lb.instance.quality.checker import NO_TAP, QUEUE, WORKER_NICENESS, Check, SpeechChecker, Tap
from cosyvoice_lb.instance.quality.isolated import Isolated
from cosyvoice_lb.instance.quality.recognizers import (
    Pocketsphinx,
    RecognizerError,
    SherpaOnnx,
    choose,
    resampled,
    sherpa_files,
)
from cosyvoice_lb.instance.quality.score import normalise, score, scored_by_character

TEXT = "Hello, this is a short check of the voice. The weather is nice today."
needs_flite = pytest.mark.skipif(not shutil.which("flite"), reason="flite is not installed")

# --- scoring (pure) ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reference, heard, kind, ratio",
    [
        (TEXT, "hello this is a short check of the voice the weather is nice today", "wer", 0.0),
        ("Hello, this is a short check of the voice.", "hello this is a short check of the boys", "wer", 1 / 9),
        ("It costs 42 dollars.", "it costs forty two dollars", "wer", 0.0),  # digits as words, both sides
        ("A well-known fact", "a well known fact", "wer", 0.0),
        ("Don't stop!", "don't stop", "wer", 0.0),
        ("Hello there", "", "wer", 1.0),  # nothing heard
        ("hello", "hello hello hello", "wer", 2.0),  # repeated: more words than the text
        ("今天天气很好，我们一起去公园散步吧。", "今天天气很好我们一起去公园散步吧", "cer", 0.0),
        ("今天天气很好。", "今天天汽很好", "cer", 1 / 6),
        ("2024年", "二零二四年", "cer", 0.0),  # a year read digit by digit
        ("こんにちは", "こんにちわ", "cer", 0.2),
        ("...", "", "wer", 0.0),  # nothing to say, nothing said
        ("...", "words", "wer", 1.0),
    ],
)
def test_what_was_heard_is_scored_against_the_text(reference, heard, kind, ratio):
    scored = score(reference, heard)
    assert scored.kind == kind and scored.ratio == pytest.approx(ratio)


def test_chinese_and_japanese_are_scored_by_character_the_rest_by_word():
    assert scored_by_character("你好世界") and scored_by_character("こんにちは") and scored_by_character("你好 world")
    assert (
        not scored_by_character("Hello world 你")
        and not scored_by_character("Привет мир")
        and not scored_by_character("")
    )
    assert normalise("Ｈｅｌｌｏ， WORLD！", False) == "hello world"  # (full-width forms folded)
    assert normalise("你好， 世界！ 3", True) == "你好世界三"


# --- the recognisers ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sphinx():
    return Pocketsphinx()


def speech(engine_name: str, text: str = TEXT, **request) -> tuple[np.ndarray, int]:
    engine = create_engine(engine_name)
    engine.load()
    return np.concatenate(list(engine.synthesize(SynthesisRequest(text=text, **request)))), engine.sample_rate


@needs_flite
@pytest.mark.parametrize("voice", ["slt", "awb"])
def test_flites_speech_passes_the_check(sphinx, voice):
    audio, rate = speech("flite", speaker=voice)
    scored = score(TEXT, sphinx.transcribe(audio, rate))
    assert scored.ratio <= 0.3, scored


@needs_flite
def test_what_is_heard_does_not_depend_on_what_was_heard_before():
    """The same answer, heard first and heard after others, is heard the same (the decoder's
    noise estimate adapts across utterances unless each starts afresh: measured, "nice today"
    then became "nice to date")."""
    said = "The weather is nice today. Please call me back tomorrow morning."
    answer, rate = speech("flite", said, speaker="awb")
    other, _ = speech("flite", speaker="slt")
    fresh = Pocketsphinx()
    heard = [fresh.transcribe(audio, rate) for audio in (answer, other, answer, answer, other, answer)]
    assert heard[0] == heard[2] == heard[3] == heard[5] and heard[1] == heard[4], heard


def test_espeaks_voice_is_not_understood(sphinx):
    """(Why ``--asr auto`` gives the espeak engine no recogniser.)"""
    audio, rate = speech("espeak")
    assert score(TEXT, sphinx.transcribe(audio, rate)).ratio > 0.6


def test_a_tone_noise_and_silence_say_nothing(sphinx):
    t = np.arange(3 * 16000) / 16000
    tone = (0.5 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    noise = np.random.default_rng(7).normal(0, 0.3, t.size).astype(np.float32)
    for audio in (tone, noise, np.zeros(t.size, dtype=np.float32)):
        assert score(TEXT, sphinx.transcribe(audio, 16000)).ratio >= 0.9


@needs_flite
def test_speech_that_says_another_text_fails(sphinx):
    audio, rate = speech(
        "flite", "The birch canoe slid on the smooth planks. Glue the sheet to the dark blue background."
    )
    assert score(TEXT, sphinx.transcribe(audio, rate)).ratio > 0.8


def test_nan_audio_is_heard_as_silence_not_an_error(sphinx):
    silence = sphinx.transcribe(np.zeros(16000, dtype=np.float32), 16000)
    assert sphinx.transcribe(np.full(16000, np.nan, dtype=np.float32), 16000) == silence


def test_resampling_keeps_the_duration():
    audio = np.sin(np.arange(22050) / 10).astype(np.float32)
    assert resampled(audio, 22050).size == 16000 and resampled(audio, 16000) is not None
    assert resampled(np.zeros(0, dtype=np.float32), 24000).size == 0


def test_sherpa_onnx_finds_each_family_and_says_what_a_dir_lacks(tmp_path):
    def folder(name: str, *files: str):
        d = tmp_path / name
        d.mkdir()
        for f in files:
            (d / f).write_bytes(b"")
        return d

    family, files = sherpa_files(folder("sherpa-onnx-sense-voice-zh-en", "model.int8.onnx", "model.onnx", "tokens.txt"))
    assert family == "sense_voice" and files["model"].endswith("model.int8.onnx") and files["use_itn"]
    family, files = sherpa_files(folder("paraformer-zh", "model.onnx", "tokens.txt"))
    assert family == "paraformer" and files["paraformer"].endswith("model.onnx")
    whisper = folder("whisper-tiny", "tiny-encoder.onnx", "tiny-decoder.onnx", "tiny-tokens.txt")
    family, files = sherpa_files(whisper)
    assert family == "whisper" and files["tokens"].endswith("tiny-tokens.txt")
    with pytest.raises(RecognizerError, match="needs tokens.txt and model.onnx"):
        sherpa_files(folder("empty"))
    with pytest.raises(RecognizerError, match="is not a directory"):
        SherpaOnnx(str(tmp_path / "missing"))


def test_the_recogniser_auto_picks_for_each_engine():
    assert choose("auto", "flite", "")[0] is Pocketsphinx and choose("auto", "flite", "")[2] == "en"
    make, why, _ = choose("auto", "espeak", "")
    assert make is None and "--engine flite" in why
    assert choose("auto", "cosyvoice3", "")[0] is None  # (until the box names its recogniser)
    assert choose("pocketsphinx", "cosyvoice3", "")[0] is Pocketsphinx
    assert choose("auto", "simulated", "")[0] is None
    assert choose("pocketsphinx", "espeak", "")[0] is Pocketsphinx  # asked for: given
    make, why, language = choose("auto", "cosyvoice3", "/models/sense-voice")
    assert make is not None and language == "" and why == ""
    assert choose("off", "flite", "/models/x")[0] is None


# --- the worker ---------------------------------------------------------------------------------


class Heard:
    """A recogniser that hears what it is told to, and counts its calls."""

    name = "scripted"

    def __init__(self, words: str = "hello there", gate: threading.Event | None = None):
        self.words, self.gate, self.calls = words, gate, 0

    def transcribe(self, audio, rate):
        if self.gate is not None:
            self.gate.wait(10)
        self.calls += 1
        return self.words


def test_a_share_of_live_answers_is_tapped():
    checker = SpeechChecker(Heard, sample=0.25, rng=random.Random(3))
    tapped = sum(checker.tap("hello", 16000) is not NO_TAP for _ in range(4000))
    assert 850 < tapped < 1150
    assert SpeechChecker(Heard, sample=0.0).tap("hello", 16000) is NO_TAP


def test_a_tap_keeps_the_answer_whole_unless_it_is_too_long():
    tap = Tap("hello", 10, limit=2.0)
    tap.add(np.ones(10, dtype=np.float32))
    tap.add(np.zeros(5, dtype=np.float32))
    assert tap.whole is not None and tap.whole.size == 15
    tap.add(np.ones(10, dtype=np.float32))
    assert tap.whole is None  # (25 samples: past 2 s at 10 Hz, not kept)


def test_live_answers_never_wait_for_the_worker():
    gate = threading.Event()
    recognizer = Heard(gate=gate)
    seen: list[Check] = []
    checker = SpeechChecker(lambda: recognizer, record=seen.append)
    for _ in range(QUEUE + 6):
        tap = Tap("hello there", 16000)
        tap.add(np.ones(1600, dtype=np.float32))
        checker.submit(tap)  # returns at once, the worker held at the gate
    assert checker.skipped >= 5
    gate.set()
    for _ in range(200):
        if len(seen) >= QUEUE:
            break
        threading.Event().wait(0.02)
    assert {c.kind for c in seen} == {"request"} and all(c.outcome == "passed" for c in seen)


def test_a_canary_waits_for_its_verdict_and_a_failing_one_is_failed():
    checker = SpeechChecker(lambda: Heard("something else entirely"), max_error=0.5)
    check = checker.check_now("canary", "hello there", np.ones(1600, dtype=np.float32), 16000)
    assert check.failed and check.outcome == "failed" and check.score is not None and check.score.ratio == 1.5
    assert checker.state()["last"][-1]["transcript"] == "something else entirely"


def test_could_not_check_is_never_a_pass():
    def broken():
        raise RecognizerError("pocketsphinx is not installed")

    check = SpeechChecker(broken).check_now("warm_up", "hello", np.ones(10, dtype=np.float32), 16000)
    assert check.outcome == "unchecked" and "not installed" in check.unchecked and not check.failed
    english = SpeechChecker(Heard, language="en").check_now("canary", "你好世界", np.ones(10, dtype=np.float32), 16000)
    assert english.outcome == "unchecked" and "English only" in english.unchecked
    none = SpeechChecker(None, unavailable="no recogniser understands the espeak engine's voice")
    assert none.check_now("canary", "hi", np.ones(10, dtype=np.float32), 16000).unchecked.startswith("no recogniser")


def test_answers_no_check_could_judge_are_never_kept():
    """(The hot path keeps and queues nothing that could only come back unchecked.)"""
    assert SpeechChecker(None, sample=1.0).tap("hello there", 16000) is NO_TAP
    assert SpeechChecker(Heard, sample=1.0, language="en").tap("今天天气很好。", 16000) is NO_TAP
    assert SpeechChecker(Heard, sample=1.0, language="").tap("今天天气很好。", 16000) is not NO_TAP


def test_the_worker_outlives_a_check_that_breaks():
    class Broken(Heard):
        def transcribe(self, audio, rate):
            raise ZeroDivisionError("inside the recogniser")

    checker = SpeechChecker(Broken)
    first = checker.check_now("canary", "hello", np.ones(10, dtype=np.float32), 16000, timeout=10)
    assert first.outcome == "unchecked" and "ZeroDivisionError" in first.unchecked
    assert checker.check_now("canary", "hello", np.ones(10, dtype=np.float32), 16000, timeout=10).outcome == "unchecked"


def test_the_worker_runs_below_the_syntheses_priority():
    import os

    seen: list[int] = []

    class Niceness:
        name = "niceness"

        def transcribe(self, audio, rate):
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return "hello"

    checker = SpeechChecker(Niceness)
    checker.check_now("canary", "hello", np.ones(1600, dtype=np.float32), 16000)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen and seen[0] >= min(19, mine + WORKER_NICENESS)


# --- the recogniser in a process of its own -----------------------------------------------------


class Broken:
    name = "broken"

    def __init__(self):
        raise RecognizerError("no model here: install one")


@needs_flite
def test_the_recogniser_in_its_own_process_hears_the_same_and_leaves_the_instance_running():
    """pocketsphinx holds the GIL while it decodes: in a thread it stalled the instance's
    other threads for most of a check; in its own process another thread keeps running."""
    said = "The weather is nice today. Please call me back tomorrow morning."
    answer, rate = speech("flite", said)
    isolated = Isolated(Pocketsphinx)
    try:
        assert isolated.name == "pocketsphinx"
        gaps, stop = [], threading.Event()

        def ticker():
            last = time.perf_counter()
            while not stop.is_set():
                time.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        thread = threading.Thread(target=ticker)
        thread.start()
        heard = [isolated.transcribe(answer, rate) for _ in range(3)]
        stop.set()
        thread.join()
        assert heard == [Pocketsphinx().transcribe(answer, rate)] * 3
        assert max(gaps) < 0.15, max(gaps)  # (in a thread: ~0.36 s, measured)
        isolated._proc.kill()  # the process dies: the next check starts another
        isolated._proc.join(5)
        assert isolated.transcribe(answer, rate) == heard[0]
    finally:
        isolated.close()


def test_a_recogniser_that_cannot_load_in_its_process_says_why():
    with pytest.raises(RecognizerError, match="no model here"):
        Isolated(Broken)
