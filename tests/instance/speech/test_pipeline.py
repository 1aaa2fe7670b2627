"""The instance's one pipeline (cosyvoice_lb/instance/speech/pipeline.py): the error table every entry point
answers from, and the steps between validation and the kept result."""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import pytest
import soundfile

from cosyvoice_lb.instance.audio.prompts import PromptError
from cosyvoice_lb.instance.engines import EngineError, SynthesisRequest
from cosyvoice_lb.instance.speech.admission import Admission, Cancelled, NotReady, Overloaded, TimedOut
from cosyvoice_lb.instance.speech.failures import ERRORS, NoAudio, describe
from cosyvoice_lb.instance.speech.pipeline import Job, Pipeline
from cosyvoice_lb.instance.speech.validation import BadRequest


@pytest.mark.parametrize(
    "exc, status, words, headers",
    [
        (BadRequest("too long", status=413), 413, "too long", {}),
        (BadRequest("no text"), 400, "no text", {}),
        (PromptError("not audio"), 400, "not audio", {}),
        (NotReady("still loading"), 503, "still loading", {"Retry-After": "2"}),
        (Overloaded("busy"), 503, "busy", {"Retry-After": "1"}),
        (TimedOut("too slow"), 504, "too slow", {}),
        (NoAudio(), 422, "no audio for this text", {}),
        (AssertionError("<|endofprompt|> not detected"), 422, "refused this input: <|endofprompt|>", {}),
        (EngineError("espeak-ng crashed"), 500, "synthesis failed: espeak-ng crashed", {}),
        (Cancelled(), 499, "went away", {}),
    ],
)
def test_the_error_table(exc, status, words, headers):
    failure = describe(exc)
    assert failure is not None
    assert (failure.status, failure.headers) == (status, headers) and words in failure.message


def test_what_the_table_does_not_know_is_left_to_the_caller():
    assert describe(KeyError("x")) is None and describe(ValueError("x")) is None


def test_server_errors_are_logged_loudly_and_client_errors_quietly():
    assert describe(EngineError("x")).level >= logging.ERROR  # type: ignore[union-attr]
    assert describe(BadRequest("x")).level < logging.WARNING  # type: ignore[union-attr]


def test_each_exception_kind_has_one_row():
    kinds = [kind for kind, _ in ERRORS]
    assert len(kinds) == len(set(kinds))


class Tone:
    name, sample_rate, modes = "tone", 16000, ("sft",)

    def __init__(self):
        self.closed = threading.Event()

    def speakers(self):
        return []

    def load(self):
        pass

    def synthesize(self, request):
        try:
            for _ in range(3):
                yield np.full(160, 0.25, dtype=np.float32)
        finally:
            self.closed.set()


def ready_pipeline(engine, **kwargs) -> Pipeline:
    admission = Admission()
    admission.become_ready()
    return Pipeline(engine, admission, **kwargs)


def test_prepare_validates_before_it_says_not_ready():
    p = Pipeline(Tone())  # loading
    with pytest.raises(BadRequest, match="empty"):
        p.prepare({"text": " "})
    with pytest.raises(NotReady, match="still loading"):
        p.prepare({"text": "hi"})


def test_a_refused_prompt_leaves_no_file_behind(tmp_path):
    p = ready_pipeline(Tone(), scratch=str(tmp_path))
    with pytest.raises(PromptError):
        p.prepare({"text": "hi"}, b"not audio at all")
    assert os.listdir(tmp_path) == []


def test_a_prompt_file_lives_as_long_as_its_job(tmp_path):
    import io

    buffer = io.BytesIO()
    rate = 16000
    t = np.arange(3 * rate) / rate
    soundfile.write(buffer, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV")
    p = ready_pipeline(Tone(), scratch=str(tmp_path))
    job = p.prepare({"text": "hi"}, buffer.getvalue())
    assert job.prompt_path and os.path.exists(job.prompt_path)
    p.finish(job)
    assert not os.path.exists(job.prompt_path or "") and os.listdir(tmp_path) == []


def test_closing_a_stream_frees_the_slot_and_closes_the_engine_generator():
    engine = Tone()
    p = ready_pipeline(engine)
    chunks = p.chunks(Job(SynthesisRequest("hi")))
    next(chunks)
    assert p.admission.snapshot().inflight == 1
    chunks.close()
    assert p.admission.snapshot().inflight == 0 and engine.closed.is_set()
    assert (p.admission.snapshot().served, p.admission.snapshot().failed) == (0, 0)


def test_a_cancelled_stream_stops_at_its_next_chunk_uncounted():
    p = ready_pipeline(Tone())
    cancelled = threading.Event()
    chunks = p.chunks(Job(SynthesisRequest("hi")), cancelled=cancelled)
    next(chunks)
    cancelled.set()
    assert list(chunks) == []
    snapshot = p.admission.snapshot()
    assert (snapshot.inflight, snapshot.served, snapshot.failed) == (0, 0, 0)


def test_silence_is_not_an_answer():
    p = ready_pipeline(Tone())
    with pytest.raises(NoAudio):
        p.encode_wav(np.zeros(0, dtype=np.float32))
    assert p.encode_wav(np.full(160, 0.1, dtype=np.float32))[:4] == b"RIFF"
