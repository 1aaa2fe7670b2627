"""Speaker similarity in the speech check (cosyvoice_lb/instance/quality/speaker.py): the
cosine (pure), the checker with a speaker model handed in (a scripted one: the model is a
collaborator), its failures never breaking a check, the prompt reaching it from a live
answer, the probe and the metrics; and, marked ``upstream``, the real adapter on a model
dir's ``campplus.onnx`` in upstream's Python, beside upstream's own embedding."""

from __future__ import annotations

import logging
import math
import os
import threading
import types

import numpy as np
import pytest
from conftest import ROOT
from prometheus_client.parser import text_string_to_metric_families
from upstream_support import probe

from cosyvoice_lb.instance.metrics import Metrics
from cosyvoice_lb.instance.quality.checker import NO_TAP, Check, SpeechChecker
from cosyvoice_lb.instance.quality.probe import CHECK_TEXT, Probe
from cosyvoice_lb.instance.quality.speaker import FILE, SpeakerError, SpeakerModel, cosine, speaker_model_for

AUDIO = np.full(1600, 0.1, dtype=np.float32)
PROBE = ROOT / "tests" / "upstream" / "speaker_probe.py"
PROMPT = ROOT / "tests" / "fake_cosyvoice" / "asset" / "zero_shot_prompt.wav"  # 4.4 s of a voice at 16 kHz

# --- the cosine (pure) ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], 1.0),
        ([1.0, 2.0, 3.0], [2.0, 4.0, 6.0], 1.0),  # (the length does not count)
        ([1.0, 0.0], [0.0, 5.0], 0.0),
        ([1.0, -2.0], [-1.0, 2.0], -1.0),
        ([1.0, 1.0], [1.0, 0.0], math.sqrt(0.5)),
        ([0.0, 0.0], [1.0, 0.0], 0.0),  # nothing to point anywhere
        ([math.nan, 1.0], [1.0, 0.0], 0.0),
    ],
)
def test_cosine(a, b, expected):
    assert cosine(np.array(a, dtype=np.float32), b) == pytest.approx(expected)


def test_cosine_of_embeddings_of_different_sizes_is_an_error():
    with pytest.raises(ValueError, match="different sizes"):
        cosine([1.0, 2.0], [1.0, 2.0, 3.0])


def test_a_model_dir_has_a_speaker_model_only_with_campplus(tmp_path):
    assert speaker_model_for(tmp_path) is None and speaker_model_for("") is None
    (tmp_path / FILE).write_bytes(b"onnx")
    model = speaker_model_for(str(tmp_path))
    assert isinstance(model, SpeakerModel) and model.path == tmp_path / FILE


def test_every_failure_of_the_adapter_is_a_speaker_error(tmp_path):
    with pytest.raises(SpeakerError, match="not installed|is not there"):
        SpeakerModel(tmp_path / FILE).load()  # (the launcher's venv has no onnxruntime; a model dir without it)
    (tmp_path / "prompt.wav").write_bytes(b"not audio")
    with pytest.raises(SpeakerError, match="cannot be read"):
        SpeakerModel(tmp_path / FILE).embed_prompt(str(tmp_path / "prompt.wav"))
    with pytest.raises(SpeakerError, match="cannot be read"):
        SpeakerModel(tmp_path / FILE).embed_prompt(str(tmp_path / "gone.wav"))


# --- the checker, with a speaker model handed in -------------------------------------------------


class Heard:
    name = "scripted"

    def transcribe(self, audio, rate):
        return "hello there"


class Speaker:
    """A scripted speaker model: ``similar`` for every answer; what it was handed is kept."""

    def __init__(self, similar: float = 0.83, broken: str = "", failing: str = ""):
        self.similar, self.broken, self.failing = similar, broken, failing
        self.loads, self.prompts = 0, []

    def load(self):
        self.loads += 1
        if self.broken:
            raise SpeakerError(self.broken)

    def similarity(self, audio, rate, prompt):
        if self.failing:
            raise SpeakerError(self.failing)
        self.prompts.append(prompt if isinstance(prompt, str) else prompt.read())
        return self.similar


@pytest.fixture
def prompt(tmp_path) -> str:
    path = tmp_path / "prompt.wav"
    path.write_bytes(b"the prompt's bytes")
    return str(path)


def test_an_answer_spoken_with_a_prompt_gets_its_similarity(prompt):
    speaker = Speaker()
    checker = SpeechChecker(Heard, speaker=speaker)
    check = checker.check_now("canary", "hello there", AUDIO, 16000, timeout=10, prompt=prompt)
    assert check.outcome == "passed" and check.similarity == 0.83 and check.summary()["similarity"] == 0.83
    assert speaker.prompts == [b"the prompt's bytes"]  # (read through the file opened when it was queued)
    assert check.cost >= 0.0
    without = checker.check_now("canary", "hello there", AUDIO, 16000, timeout=10)
    assert without.similarity is None and without.summary()["similarity"] is None
    assert speaker.loads == 1


def test_without_a_speaker_model_there_is_no_similarity(prompt):
    check = SpeechChecker(Heard).check_now("warm_up", "hello there", AUDIO, 16000, timeout=10, prompt=prompt)
    assert check.outcome == "passed" and check.similarity is None


def test_the_similarity_needs_no_recogniser(prompt):
    checker = SpeechChecker(None, speaker=Speaker(0.5))
    check = checker.check_now("canary", "hello there", AUDIO, 16000, timeout=10, prompt=prompt)
    assert check.outcome == "unchecked" and check.similarity == 0.5  # (still never a pass)
    english = SpeechChecker(Heard, language="en", speaker=Speaker(0.5))
    assert english.check_now("canary", "你好世界", AUDIO, 16000, timeout=10, prompt=prompt).similarity == 0.5


def test_a_speaker_model_that_does_not_load_warns_once_and_never_breaks_the_check(prompt, caplog):
    speaker = Speaker(broken="onnxruntime is not installed in this Python")
    checker = SpeechChecker(Heard, speaker=speaker)
    with caplog.at_level(logging.WARNING, logger="cosyvoice_lb.instance"):
        checks = [checker.check_now("canary", "hello there", AUDIO, 16000, timeout=10, prompt=prompt) for _ in "ab"]
    assert all(c.outcome == "passed" and c.similarity is None for c in checks)
    warned = [r.getMessage() for r in caplog.records if "speaker" in r.getMessage()]
    assert warned == ["no speaker similarity in the speech check: onnxruntime is not installed in this Python"]
    assert speaker.loads == 1 and checker.speaker is None


def test_an_answer_it_cannot_embed_has_no_similarity_and_its_check_stands(prompt):
    checker = SpeechChecker(Heard, speaker=Speaker(failing="too short"))
    check = checker.check_now("canary", "hello there", AUDIO, 16000, timeout=10, prompt=prompt)
    assert check.outcome == "passed" and check.similarity is None


def test_a_live_answers_prompt_is_read_after_its_request_removed_it(prompt):
    speaker = Speaker()
    seen: list[Check] = []
    checker = SpeechChecker(Heard, sample=1.0, speaker=speaker, record=seen.append)
    tap = checker.tap("hello there", 16000, prompt=prompt)
    tap.add(AUDIO)
    tap.done()  # queued: the prompt is opened now
    os.unlink(prompt)  # the request is done with its own copy of the prompt
    for _ in range(200):
        if seen:
            break
        threading.Event().wait(0.02)
    assert seen and seen[0].kind == "request" and seen[0].similarity == 0.83
    assert speaker.prompts == [b"the prompt's bytes"]


def test_answers_only_the_similarity_could_judge_are_kept(prompt):
    """(Kept and queued when the speaker model could say something, recogniser or not.)"""
    speaker = Speaker()
    assert SpeechChecker(None, sample=1.0, speaker=speaker).tap("hello", 16000, prompt=prompt) is not NO_TAP
    assert SpeechChecker(None, sample=1.0, speaker=speaker).tap("hello", 16000) is NO_TAP
    assert SpeechChecker(None, sample=1.0).tap("hello", 16000, prompt=prompt) is NO_TAP
    assert SpeechChecker(Heard, sample=0.0, speaker=speaker).tap("hello", 16000, prompt=prompt) is NO_TAP


def test_the_probe_checks_with_the_prompt_it_speaks_with(prompt):
    asked = []

    class Checker:
        def check_now(self, kind, text, audio, rate, timeout=120.0, prompt=""):
            asked.append((kind, text, prompt))
            return Check(kind, text, similarity=0.9)

    request = types.SimpleNamespace(text=CHECK_TEXT, prompt_wav=prompt)
    pipeline = types.SimpleNamespace(
        speak=lambda r: AUDIO, speech=Checker(), engine=types.SimpleNamespace(sample_rate=16000)
    )
    checked = Probe(pipeline)
    checked.request = lambda: request
    assert checked.run("canary").check.similarity == 0.9
    assert asked == [("canary", CHECK_TEXT, prompt)]


def test_the_pipeline_taps_a_live_answer_with_its_prompt():
    from cosyvoice_lb.instance.engines import SynthesisRequest
    from cosyvoice_lb.instance.speech.pipeline import Pipeline

    tapped = []
    speech = types.SimpleNamespace(tap=lambda text, rate, prompt="": tapped.append((text, rate, prompt)) or NO_TAP)
    pipeline = types.SimpleNamespace(speech=speech, engine=types.SimpleNamespace(sample_rate=24000))
    Pipeline.tap(pipeline, SynthesisRequest(text="hi", prompt_wav="/scratch/prompt-1.wav"), count=True)
    assert tapped == [("hi", 24000, "/scratch/prompt-1.wav")]


def test_each_similarity_is_observed_by_kind():
    metrics = Metrics("flite", "test")
    metrics.speech_checked("canary", "passed", 0.1, 0.93)
    metrics.speech_checked("request", "unchecked", None, 0.4)
    metrics.speech_checked("warm_up", "passed", 0.0)  # (no prompt: no similarity)
    body = metrics.exposition()[0].decode()
    count = {
        s.labels["kind"]: s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == "cosyvoice_speaker_similarity_count"
    }
    assert count == {"request": 1.0, "warm_up": 0.0, "canary": 1.0}


# --- the real speaker model, in upstream's Python ----------------------------------------------


@pytest.mark.upstream
def test_the_real_campplus_embeds_as_upstream_does(upstream, tmp_path):
    facts = probe(
        upstream,
        PROBE,
        "--model-dir",
        str(upstream.model_dir),
        "--prompt",
        str(PROMPT),
        "--scratch",
        str(tmp_path),
        timeout=300,
    )
    assert facts["shape"] == [192] and facts["finite"]
    assert facts["self"] == pytest.approx(1.0, abs=1e-5) and facts["self_held"] == pytest.approx(1.0, abs=1e-5)
    assert facts["other"] < 1.0 - 1e-3  # (the small model's weights are random: only "not the same")
    assert facts["cached"]
    # upstream's frontend's own embedding of the same prompt file, at 16 kHz and at 24 kHz
    assert facts["upstream_16k"] < 1e-4 and facts["upstream_24k"] < 1e-4
    assert "too short" in facts["too_short"]
    assert facts["check"]["similarity"] == pytest.approx(1.0, abs=1e-4) and facts["check"]["unchecked"]
