"""The instance's metrics (cosyvoice_lb/instance/metrics.py): each synthesis observed once, by route,
never the warm-up; each speech request counted once by route and outcome; /metrics in
Prometheus's format, and refused when it came through nginx."""

from __future__ import annotations

import subprocess
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from cosyvoice_lb.instance.engines import EngineError
from cosyvoice_lb.instance.metrics import OUTCOMES, ROUTES, Metrics, outcome_of
from cosyvoice_lb.instance.server import build_app
from cosyvoice_lb.instance.speech.admission import Admission
from cosyvoice_lb.instance.speech.pipeline import Pipeline


class Tone:
    """Three chunks of 0.1 s each; a text holding "FAIL" fails after the first chunk."""

    name, sample_rate, modes = "tone", 16000, ("sft",)

    def speakers(self):
        return []

    def load(self):
        pass

    def synthesize(self, request):
        for i in range(3):
            if i == 1 and "FAIL" in request.text:
                raise EngineError("broke mid-way")
            yield np.full(1600, 0.25, dtype=np.float32)


def samples(p: Pipeline) -> dict[tuple[str, tuple], float]:
    """Every sample of the pipeline's registry: (name, sorted labels) -> value."""
    body, _ = p.metrics.exposition()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def value(p: Pipeline, name: str, **labels: str) -> float:
    return samples(p).get((name, tuple(sorted(labels.items()))), 0.0)


def loaded(engine=None) -> Pipeline:
    p = Pipeline(engine or Tone(), Admission())
    p.load()  # (its warm-up synthesis is no request)
    return p


@pytest.mark.parametrize(
    "status, outcome",
    [
        (200, "ok"),
        (204, "ok"),
        (400, "invalid"),
        (404, "invalid"),
        (413, "invalid"),
        (422, "invalid"),
        (429, "refused"),
        (503, "refused"),
        (408, "timeout"),
        (504, "timeout"),
        (499, "cancelled"),
        (500, "failed"),
        (502, "failed"),
        (507, "failed"),
        (0, "failed"),
    ],
)
def test_outcomes_from_statuses(status, outcome):
    assert outcome_of(status) == outcome and outcome in OUTCOMES


def test_the_warm_up_is_not_observed():
    p = loaded()
    assert value(p, "cosyvoice_first_package_seconds_count", route="api") == 0
    assert all(value(p, "cosyvoice_queue_wait_seconds_count", route=r) == 0 for r in ROUTES)
    assert value(p, "cosyvoice_instance_ready") == 1


def test_a_synthesis_is_observed_once_under_its_route():
    p = loaded()
    p.synthesize(p.prepare({"text": "hello"}, route="openai"))
    for name in ("first_package", "queue_wait", "audio_duration", "synthesis", "real_time_factor"):
        assert (
            value(
                p,
                f"cosyvoice_{name}_seconds_count" if name != "real_time_factor" else "cosyvoice_real_time_factor_count",
                route="openai",
            )
            == 1
        ), name
        assert (
            value(
                p,
                f"cosyvoice_{name}_seconds_count" if name != "real_time_factor" else "cosyvoice_real_time_factor_count",
                route="api",
            )
            == 0
        ), name
    assert value(p, "cosyvoice_audio_duration_seconds_sum", route="openai") == pytest.approx(0.3)
    # its audio took less than its length to make: below real time, and the sum says so
    assert 0 < value(p, "cosyvoice_real_time_factor_sum", route="openai") < 1


def test_a_stream_observes_its_first_package_at_the_first_chunk():
    p = loaded()
    job = p.prepare({"text": "hello"}, route="ui")
    chunks = p.chunks(job)
    next(chunks)
    assert value(p, "cosyvoice_first_package_seconds_count", route="ui") == 1
    assert value(p, "cosyvoice_audio_duration_seconds_count", route="ui") == 0  # not complete yet
    list(chunks)
    assert value(p, "cosyvoice_first_package_seconds_count", route="ui") == 1
    assert value(p, "cosyvoice_audio_duration_seconds_count", route="ui") == 1


def test_a_failed_synthesis_has_its_first_package_and_wait_but_no_audio():
    p = loaded()
    with pytest.raises(EngineError):
        p.synthesize(p.prepare({"text": "FAIL now"}, route="segment"))
    assert value(p, "cosyvoice_first_package_seconds_count", route="segment") == 1
    assert value(p, "cosyvoice_queue_wait_seconds_count", route="segment") == 1
    assert value(p, "cosyvoice_audio_duration_seconds_count", route="segment") == 0


def test_live_gauges_read_admission_at_the_scrape():
    p = loaded()
    job = p.prepare({"text": "hello"})
    chunks = p.chunks(job)
    next(chunks)
    assert value(p, "cosyvoice_syntheses_in_flight") == 1
    waiting = threading.Thread(target=lambda: p.synthesize(p.prepare({"text": "next"})))
    waiting.start()
    for _ in range(200):
        if value(p, "cosyvoice_queue_depth") == 1:
            break
        threading.Event().wait(0.01)
    assert value(p, "cosyvoice_queue_depth") == 1
    list(chunks)
    waiting.join(5)
    assert value(p, "cosyvoice_syntheses_in_flight") == 0 and value(p, "cosyvoice_queue_depth") == 0


def test_voice_cache_counters_come_from_the_engine():
    engine = Tone()
    engine.voice_cache_hits, engine.voice_cache_misses = 5, 2  # type: ignore[attr-defined]
    p = loaded(engine)
    assert value(p, "cosyvoice_voice_cache_hits_total") == 5
    assert value(p, "cosyvoice_voice_cache_misses_total") == 2


def test_every_request_series_exists_from_the_start():
    p = loaded()
    for route in ROUTES:
        for outcome in OUTCOMES:
            assert ("cosyvoice_requests_total", (("outcome", outcome), ("route", route))) in samples(p)


def test_each_pipeline_has_its_own_registry():
    a, b = loaded(), loaded()
    a.synthesize(a.prepare({"text": "hello"}))
    assert value(a, "cosyvoice_first_package_seconds_count", route="api") == 1
    assert value(b, "cosyvoice_first_package_seconds_count", route="api") == 0


# --- through the instance's HTTP edge --------------------------------------------------------


@pytest.fixture
def served():
    p = loaded()
    with TestClient(build_app(p, "tone", 7860), raise_server_exceptions=False) as client:
        yield p, client


def test_requests_are_counted_by_route_and_outcome(served):
    p, client = served
    assert client.post("/v1/tts", json={"text": "hello"}).status_code == 200
    assert client.post("/v1/tts", json={"text": ""}).status_code == 400
    assert client.post("/v1/tts", json={"text": "FAIL"}).status_code == 500
    assert client.post("/v1/audio/speech", json={"model": "tts-1", "input": "hi", "voice": "alloy"}).status_code == 200
    assert client.post("/v1/tts", json={"text": "part"}, headers={"X-Cvlb-Segment": "1/2"}).status_code == 200
    assert client.get("/ping").status_code == 200  # not a speech request
    counts = {(r, o): value(p, "cosyvoice_requests_total", route=r, outcome=o) for r in ROUTES for o in OUTCOMES}
    assert {k: v for k, v in counts.items() if v} == {
        ("api", "ok"): 1,
        ("api", "invalid"): 1,
        ("api", "failed"): 1,
        ("openai", "ok"): 1,
        ("segment", "ok"): 1,
    }
    # three syntheses ran to their end, one broke after its first chunk; the refused one never ran
    firsts = sum(value(p, "cosyvoice_first_package_seconds_count", route=r) for r in ROUTES)
    completed = sum(value(p, "cosyvoice_audio_duration_seconds_count", route=r) for r in ROUTES)
    assert (firsts, completed) == (4, 3)


def test_a_request_is_logged_with_its_request_id(served, caplog):
    _, client = served
    with caplog.at_level("INFO", logger="cosyvoice_lb.instance"):
        client.post("/v1/tts", json={"text": "hello"}, headers={"X-Request-Id": "abc123def456"})
    assert any("rid=abc123def456" in r.getMessage() and " api " in r.getMessage() for r in caplog.records)


def test_metrics_is_prometheus_text(served):
    _, client = served
    answer = client.get("/metrics")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(answer.text)}
    assert {
        "cosyvoice_first_package_seconds",
        "cosyvoice_requests",
        "cosyvoice_syntheses_in_flight",
        "cosyvoice_instance_info",
        "process_resident_memory_bytes",
    } <= names
    open_metrics = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert open_metrics.headers["content-type"].startswith("application/openmetrics-text")
    assert open_metrics.text.rstrip().endswith("# EOF")


def test_metrics_that_came_through_nginx_are_refused(served):
    _, client = served
    answer = client.get("/metrics", headers={"X-Request-Start": "1700000000.000"})
    assert answer.status_code == 404 and "admin token" in answer.json()["error"]["message"]


def test_without_prometheus_client_the_instance_serves_and_metrics_says_why(served):
    p, client = served
    p.metrics = Metrics.__new__(Metrics)
    p.metrics.enabled = False
    answer = client.get("/metrics")
    assert answer.status_code == 503 and "pip install prometheus_client" in answer.json()["error"]["message"]


def test_names_and_units_pass_promtools_lint(served, promtool):
    """promtool's linter: counters end in _total, units are base units, help on every metric."""
    _, client = served
    client.post("/v1/tts", json={"text": "hello"})
    done = subprocess.run(
        [promtool, "check", "metrics"],
        input=client.get("/metrics").text,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_slow_reader_is_not_engine_time():
    """A client reading a stream at playback speed holds the slot; the engine's time (and the
    real-time factor) counts only the time spent making audio."""
    now = [100.0]
    p = Pipeline(Tone(), Admission(clock=lambda: now[0]))
    p.load()
    chunks = p.chunks(p.prepare({"text": "hello"}, route="api"))
    for _ in chunks:
        now[0] += 10.0  # ten seconds with the reader for each chunk
    assert value(p, "cosyvoice_synthesis_seconds_count", route="api") == 1
    assert value(p, "cosyvoice_synthesis_seconds_sum", route="api") == 0.0  # the engine's own time: none here


def test_the_cosyvoice_engines_first_chunk_parts_reach_the_instance_metrics(tmp_path):
    """build_pipeline hands the engine the metrics' observer: what the layer reports (it calls
    the engine's ``_first_chunk``, see upstream_tts.install) is a histogram per part."""
    from cosyvoice_lb.common.settings import Settings
    from cosyvoice_lb.instance.wiring import build_pipeline

    settings = Settings(engine="cosyvoice3", model_dir=str(tmp_path / "not-loaded"), outputs_dir=str(tmp_path))
    p = build_pipeline(settings, port=1)
    assert value(p, "cosyvoice_first_chunk_compute_seconds_count", part="llm") == 0  # there from the start
    p.engine._first_chunk(0.3, 0.04)
    p.engine._first_chunk(0.5, 0.06)
    assert value(p, "cosyvoice_first_chunk_compute_seconds_count", part="llm") == 2
    assert value(p, "cosyvoice_first_chunk_compute_seconds_sum", part="llm") == pytest.approx(0.8)
    assert value(p, "cosyvoice_first_chunk_compute_seconds_sum", part="audio") == pytest.approx(0.1)
    assert value(p, "cosyvoice_first_chunk_compute_seconds_bucket", part="audio", le="0.05") == 1
