"""Bad audio on one instance, in-process: the pipeline checks every synthesis before it is
answered (a 502 nginx retries elsewhere, or a stream cut off), counts it against the instance
(/ping, /metrics), and a bad warm-up or canary takes the instance out. The engine is the
simulated one with its fault file, as in a real cluster; a stream that goes bad after its first
chunk runs on a real uvicorn (the client must see the connection end early)."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
import requests
import soundfile
from conftest import uvicorn_serving
from fastapi.testclient import TestClient

from cosyvoice_lb.instance.audio.check import check_audio
from cosyvoice_lb.instance.engines import SynthesisRequest
from cosyvoice_lb.instance.engines.simulated import SimulatedEngine
from cosyvoice_lb.instance.server import build_app
from cosyvoice_lb.instance.speech.admission import Admission, Phase
from cosyvoice_lb.instance.speech.pipeline import Job, Pipeline

TEXT = "Hello there, this is a test."


def pipeline(engine, port: int = 7860, ready: bool = True) -> Pipeline:
    admission = Admission(1, 2)
    if ready:
        admission.become_ready()
    return Pipeline(engine, admission, port=port)


def simulated(tmp_path, port: int = 7860, fault: str = "") -> SimulatedEngine:
    if fault:
        (tmp_path / str(port)).write_text(fault)
    return SimulatedEngine(simulated_ms_per_char=0, simulated_fault_dir=str(tmp_path), port=port)


def client(p: Pipeline) -> TestClient:
    return TestClient(build_app(p, p.engine.name, p.port, ui=False), raise_server_exceptions=False)


def bad_samples(c: TestClient) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.labels["reason"], s.labels["during"]): s.value
        for family in text_string_to_metric_families(c.get("/metrics").text)
        if family.name == "cosyvoice_bad_audio"
        for s in family.samples
        if s.name == "cosyvoice_bad_audio_total"
    }


@pytest.mark.parametrize(
    "fault, reason", [("nan", "non_finite"), ("silence", "silent"), ("loud", "out_of_range"), ("short", "too_short")]
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_audio_is_never_answered_but_a_502_and_counted_against_the_instance(tmp_path, fault, reason, stream):
    p = pipeline(simulated(tmp_path, fault=fault), port=7860)
    with client(p) as c:
        r = c.post("/v1/tts", json={"text": TEXT, "stream": stream})
        if stream and reason in ("silent", "too_short"):
            # (found only at the end: the status went out with the first chunk; the stream is cut,
            # shown on a real connection below)
            assert r.status_code == 200
        else:
            assert r.status_code == 502 and r.headers["content-type"] == "application/json"
            message = r.json()["error"]["message"]
            assert "instance 7860 made bad audio for this request" in message and "retry" in message
            assert "x-should-retry" not in r.headers  # (nginx, the fan-out and clients retry it)
        ping = c.get("/ping")
        assert ping.status_code == 200 and ping.json()["bad_audio"] == {reason: 1}  # still serving: one bad answer
        assert bad_samples(c)[(reason, "request")] == 1
        assert sum(bad_samples(c).values()) == 1
    assert p.admission.snapshot().failed == 1 and p.admission.snapshot().served == 0
    assert p.watch.owed.is_set()  # a canary is owed as soon as it is idle


def test_good_audio_is_answered_and_the_instance_counts_nothing(tmp_path):
    p = pipeline(simulated(tmp_path), port=7861)
    with client(p) as c:
        r = c.post("/v1/tts", json={"text": TEXT})
        assert r.status_code == 200
        audio, rate = soundfile.read(io.BytesIO(r.content), dtype="float32")
        assert check_audio(audio, TEXT, 1.0, rate) is None
        assert "bad_audio" not in c.get("/ping").json()
        assert sum(bad_samples(c).values()) == 0
    assert not p.watch.owed.is_set()


@pytest.mark.parametrize("fault", ["nan", "silence"])
def test_a_bad_warm_up_leaves_the_instance_out_saying_why(tmp_path, fault):
    p = pipeline(simulated(tmp_path, port=7862, fault=fault), port=7862, ready=False)
    p.load()
    assert p.admission.phase is Phase.BAD_AUDIO
    with client(p) as c:
        ping = c.get("/ping")
        body = ping.json()
        assert ping.status_code == 503 and body["state"] == "bad-audio" and body["ready"] is False
        assert body["error"].startswith("the warm-up synthesis made bad audio: ")
        assert body["bad_audio"] == {"nan": {"non_finite": 1}, "silence": {"silent": 1}}[fault]
        refused = c.post("/v1/tts", json={"text": TEXT})
        assert refused.status_code == 503 and "makes bad audio" in refused.json()["error"]["message"]
        assert bad_samples(c)[({"nan": "non_finite", "silence": "silent"}[fault], "warm_up")] == 1
    assert p.admission.snapshot().failed == 0  # (the warm-up is no request)


def test_the_canary_synthesis_is_checked_and_never_counted_as_served(tmp_path):
    p = pipeline(simulated(tmp_path, port=7863), port=7863)
    assert p.canary() is None
    (tmp_path / "7863").write_text("nan")
    fault = p.canary()
    assert fault is not None and fault.reason == "non_finite"
    seen = p.admission.snapshot()
    assert (seen.served, seen.failed, seen.inflight) == (0, 0, 0)
    assert p.watch.counts() == {}  # (the canary's caller counts it: see test_canary)


def test_a_request_whose_audio_passes_counts_as_good_audio(tmp_path):
    now = [100.0]
    admission = Admission(1, 2, clock=lambda: now[0])
    admission.become_ready()
    p = Pipeline(simulated(tmp_path), admission, port=7864)
    now[0] = 500.0
    p.synthesize(Job(SynthesisRequest(TEXT)))
    assert p.watch.last_good == 500.0  # the periodic canary counts from here


# --- a stream that goes bad after its first chunk ----------------------------------------------


class GoesBad:
    """A model that breaks mid-stream: good chunks, then NaN; or silence throughout (found
    only at the end)."""

    name, sample_rate, modes = "goesbad", 16000, ("sft",)

    def __init__(self, silent: bool = False):
        self.silent = silent

    def speakers(self):
        return []

    def synthesize(self, request):
        tone = (0.0 if self.silent else 0.2) * np.sin(np.arange(4000) / 5).astype(np.float32)
        yield tone
        time.sleep(0.05)
        yield tone
        yield tone if self.silent else np.full(4000, np.nan, dtype=np.float32)
        yield tone


def serving(p: Pipeline):
    return uvicorn_serving(build_app(p, p.engine.name, p.port, ui=False))


@pytest.mark.parametrize("silent", [False, True])
def test_a_stream_that_goes_bad_is_cut_off_before_its_end(silent):
    p = pipeline(GoesBad(silent), port=7865)
    with serving(p) as url, requests.Session() as session:
        session.trust_env = False
        r = session.post(url + "/v1/tts", json={"text": TEXT, "stream": True}, stream=True, timeout=30)
        assert r.status_code == 200
        got = b""
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            for piece in r.iter_content(4096):
                got += piece
        # (the connection ended without the stream's last chunk: no client takes it for complete)
        samples = np.frombuffer(got[44 : 44 + (len(got) - 44) // 2 * 2], dtype="<i2")
        if not silent:  # the good chunks came, the bad one and the rest never did
            assert 0 < samples.size <= 8000 and np.abs(samples).max() < 32767 * 0.25
        ping = session.get(url + "/ping", timeout=5).json()
        assert ping["bad_audio"] == {"silent" if silent else "non_finite": 1} and ping["failed"] == 1
