"""The warm-up and the canary speak and are heard, in-process: on the flite engine with the
real pocketsphinx recogniser, a model that says another text is taken out like bad audio, a
live answer that fails its check owes a canary, an engine no recogniser understands shows as
unchecked (never as passed), and a model that only clones speaks with a prompt."""

from __future__ import annotations

import random
import shutil
import time
import wave
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from cosyvoice_lb.instance.engines import SynthesisRequest, create_engine
from cosyvoice_lb.instance.quality.checker import SpeechChecker
from cosyvoice_lb.instance.quality.probe import CHECK_TEXT, SHIPPED_PROMPT, speaking_prompt
from cosyvoice_lb.instance.quality.recognizers import Pocketsphinx, choose
from cosyvoice_lb.instance.server import build_app
from cosyvoice_lb.instance.speech.admission import Admission, Phase
from cosyvoice_lb.instance.speech.pipeline import Pipeline
from cosyvoice_lb.instance.speech.voices import Registry

pytestmark = pytest.mark.skipif(not shutil.which("flite"), reason="flite is not installed")
OTHER = "The birch canoe slid on the smooth planks. Glue the sheet to the dark blue background."


class Saying:
    """The flite engine, saying ``OTHER`` instead of the text once ``wrong`` is set."""

    name, sample_rate, modes = "flite", 16000, ("sft",)

    def __init__(self):
        self.flite, self.wrong, self.said = create_engine("flite"), False, []

    def speakers(self):
        return self.flite.speakers()

    def load(self):
        self.flite.load()

    def synthesize(self, request):
        self.said.append(request.text)
        yield from self.flite.synthesize(SynthesisRequest(text=OTHER) if self.wrong else request)


def pipeline(engine, sample: float = 0.0, speech: bool = True) -> Pipeline:
    make, why, language = choose("auto", engine.name, "")
    checker = SpeechChecker(make, sample, 0.6, language, rng=random.Random(1), unavailable=why) if speech else None
    return Pipeline(engine, Admission(1, 4), speech=checker)


def series(c: TestClient, name: str) -> dict[tuple, float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(c.get("/metrics").text)
        for s in family.samples
        if s.name == name
    }


def test_a_warm_up_that_says_its_text_passes_and_ping_says_so():
    p = pipeline(Saying())
    p.load()
    assert p.admission.phase is Phase.READY and p.probe.verdict.state == "passed"
    with TestClient(build_app(p, "flite", 7870, ui=False)) as c:
        speech = c.get("/ping").json()["speech"]
        assert speech["verdict"] == "passed" and speech["recognizer"] == "pocketsphinx"
        (check,) = speech["last"]
        assert check["kind"] == "warm_up" and check["metric"] == "wer" and check["error"] <= 0.3
        assert "short check" in check["transcript"]
        assert series(c, "cosyvoice_speech_checks_total")[(("kind", "warm_up"), ("outcome", "passed"))] == 1
        assert series(c, "cosyvoice_speech_unchecked")[()] == 0


def test_a_model_that_says_another_text_is_taken_out_at_its_warm_up():
    engine = Saying()
    engine.wrong = True
    p = pipeline(engine)
    p.load()
    assert p.admission.phase is Phase.BAD_AUDIO and p.probe.verdict.state == "failed"
    with TestClient(build_app(p, "flite", 7871, ui=False), raise_server_exceptions=False) as c:
        ping = c.get("/ping")
        assert ping.status_code == 503 and "the recogniser heard" in ping.json()["error"]
        assert ping.json()["bad_audio"] == {"speech_error": 1}
        bad = series(c, "cosyvoice_bad_audio_total")
        assert bad[(("during", "warm_up"), ("reason", "speech_error"))] == 1


def test_a_live_answer_that_fails_its_check_owes_a_canary_which_takes_the_instance_out():
    engine = Saying()
    p = pipeline(engine, sample=1.0)
    p.load()
    with TestClient(build_app(p, "flite", 7872, ui=False), raise_server_exceptions=False) as c:
        assert c.post("/v1/tts", json={"text": CHECK_TEXT}).status_code == 200
        engine.wrong = True  # the model goes wrong: its audio still passes the audio check
        assert c.post("/v1/tts", json={"text": CHECK_TEXT}).status_code == 200  # sent, then checked
        deadline = time.monotonic() + 20
        while not p.watch.owed.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.watch.owed.is_set()  # the live check failed: a canary is owed
        assert p.canary() is not None and p.probe.verdict.state == "failed"
        checks = series(c, "cosyvoice_speech_checks_total")
        assert checks[(("kind", "request"), ("outcome", "passed"))] == 1
        assert checks[(("kind", "request"), ("outcome", "failed"))] == 1
        errors = series(c, "cosyvoice_speech_error_ratio_count")
        assert errors[(("kind", "request"),)] == 2 and errors[(("kind", "warm_up"),)] == 1


def test_an_engine_no_recogniser_understands_is_unchecked_never_passed():
    p = pipeline(create_engine("espeak"))
    p.load()
    assert p.admission.phase is Phase.READY  # its audio passed the audio check
    assert p.probe.verdict.state == "unchecked" and "--engine flite" in p.probe.verdict.unchecked
    with TestClient(build_app(p, "espeak", 7873, ui=False)) as c:
        speech = c.get("/ping").json()["speech"]
        assert speech["verdict"] == "unchecked" and speech["recognizer"] is None and "espeak" in speech["why"]
        assert series(c, "cosyvoice_speech_unchecked")[()] == 1


class Cloning:
    """A model that only clones (as CosyVoice3): says what prompt it was given."""

    name, sample_rate, modes = "cloning", 16000, ("zero_shot",)

    def __init__(self):
        self.prompts: list[tuple[str, str]] = []

    def speakers(self):
        return []

    def load(self):
        pass

    def synthesize(self, request):
        self.prompts.append((request.prompt_wav, request.prompt_text))
        yield (0.3 * np.sin(np.arange(48000) / 5)).astype(np.float32)


def wav(path: Path, seconds: float = 3.0) -> Path:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes((np.sin(np.arange(int(16000 * seconds)) / 7) * 8000).astype("<i2").tobytes())
    return path


def test_a_model_that_only_clones_warms_up_with_the_prompt_this_package_ships():
    engine = Cloning()
    p = pipeline(engine, speech=False)
    p.load()
    assert engine.prompts == [SHIPPED_PROMPT] and Path(SHIPPED_PROMPT[0]).stat().st_size > 50_000
    assert p.probe.verdict.state == "unchecked"  # (no speech check here: said, not passed)


def test_the_prompt_to_speak_with_is_the_operators_then_a_saved_voice_then_the_models_then_ours(tmp_path):
    mine, voice, bundled = wav(tmp_path / "mine.wav"), wav(tmp_path / "voice.wav"), wav(tmp_path / "bundled.wav")
    voices = [(str(voice), "a voice"), (str(bundled), "another")]
    assert speaking_prompt((str(mine), "mine"), voices, (str(bundled), "b")) == (str(mine), "mine")
    assert speaking_prompt(("", ""), voices, (str(bundled), "b")) == (str(voice), "a voice")
    assert speaking_prompt(("", ""), [], (str(bundled), "b")) == (str(bundled), "b")
    assert speaking_prompt((str(tmp_path / "gone.wav"), "x"), [], ("", "")) == SHIPPED_PROMPT


def test_the_first_saved_voice_and_the_operators_prompt_reach_the_model(tmp_path):
    engine = Cloning()
    ticks = iter(range(1_000_000, 1_000_100))
    registry = Registry(tmp_path / "voices", clock=lambda: float(next(ticks)))  # (one saved after the other)
    audio = (np.sin(np.arange(48000) / 7) * 0.3).astype(np.float32)
    first = registry.create("first", audio, 16000, "the first voice", consent="yes")
    registry.create("second", audio, 16000, "the second voice", consent="yes")
    p = Pipeline(engine, Admission(1, 4), registry=registry)
    p.load()
    assert engine.prompts[-1] == (registry.audio_path(first), "the first voice")
    p = Pipeline(engine, Admission(1, 4), check_prompt=(str(wav(tmp_path / "op.wav")), "the operator's"))
    p.load()
    prepared, text = engine.prompts[-1]
    assert text == "the operator's" and Path(prepared).is_file() and prepared != str(tmp_path / "op.wav")


def test_an_operators_prompt_that_is_no_prompt_fails_the_load_saying_which(tmp_path):
    from cosyvoice_lb.instance.engines import EngineError

    (tmp_path / "not.wav").write_bytes(b"RIFF nothing")
    p = Pipeline(Cloning(), Admission(1, 4), check_prompt=(str(tmp_path / "not.wav"), "text"))
    with pytest.raises(EngineError, match="--canary-prompt .*not.wav"):
        p.load()


def test_pocketsphinx_hears_the_shipped_prompt():
    import soundfile

    audio, rate = soundfile.read(SHIPPED_PROMPT[0], dtype="float32")
    from cosyvoice_lb.instance.quality.score import score

    assert score(SHIPPED_PROMPT[1], Pocketsphinx().transcribe(audio, rate)).ratio < 0.5
