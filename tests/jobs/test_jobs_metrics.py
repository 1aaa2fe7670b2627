"""The jobs' metrics (cosyvoice_lb/jobs/metrics.py): counted through a real SqliteStore, served
at GET /metrics on the jobs app, and kept in the report the launcher reads."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from cosyvoice_lb.instance.access.auth import SHARED_OWNER
from cosyvoice_lb.jobs import model
from cosyvoice_lb.jobs.metrics import (
    Instrumented,
    JobMetrics,
    Reporter,
    counting_send,
    exposition,
    read_report,
    report_path,
)
from cosyvoice_lb.jobs.sender import SegmentError
from cosyvoice_lb.jobs.service import Config, build_app
from cosyvoice_lb.jobs.store import SqliteStore

T0 = 1_764_680_000.0


@pytest.fixture
def store(tmp_path):
    metrics = JobMetrics()
    store = Instrumented(SqliteStore(tmp_path / "jobs" / "jobs.sqlite3"), metrics)
    yield store
    store.close()


def queue(store, total: int = 3, at: float = T0) -> model.Job:
    job = model.new_job(SHARED_OWNER, "One. Two. Three. Four.", total, at, params={"voice": "alloy"})
    store.create(job, "One. Two. Three. Four.")
    return job


def samples(text: str) -> dict[tuple[str, tuple], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_the_metrics_count_what_the_store_was_told(store):
    done = queue(store, 3)
    cancelled = queue(store, 2, at=T0 + 1)
    queue(store, 2, at=T0 + 2)  # stays queued
    job = store.claim_next("runner-1", 30.0, T0 + 10)
    assert job is not None and job.id == done.id
    assert store.metrics.snapshot(store, T0 + 10)["running"] == [{"id": done.id, "done": 0, "total": 3}]
    for index in range(3):
        store.segment_done(done.id, index, T0 + 20 + index)
    running = store.metrics.snapshot(store, T0 + 30)
    assert running["running"] == [{"id": done.id, "done": 3, "total": 3}] and running["segments_done"] == 3
    store.finish(done.id, "runner-1", model.SUCCEEDED, T0 + 95.0, result=model.Result("/r/audio.wav", 10))
    assert store.cancel(cancelled.id, SHARED_OWNER, T0 + 4000.0).action == "cancelled"

    found = samples(exposition(store.metrics.snapshot(store, T0 + 4000)).decode())
    assert found[("cosyvoice_jobs", (("status", "queued"),))] == 1
    assert found[("cosyvoice_jobs", (("status", "succeeded"),))] == 1
    assert found[("cosyvoice_jobs", (("status", "cancelled"),))] == 1
    assert found[("cosyvoice_jobs", (("status", "running"),))] == 0
    assert found[("cosyvoice_job_segments_done_total", ())] == 3
    assert found[("cosyvoice_job_segment_retries_total", ())] == 0
    succeeded = (("status", "succeeded"),)
    assert found[("cosyvoice_job_duration_seconds_count", succeeded)] == 1
    assert found[("cosyvoice_job_duration_seconds_sum", succeeded)] == pytest.approx(95.0)
    assert found[("cosyvoice_job_duration_seconds_bucket", (("le", "60.0"), *succeeded))] == 0
    assert found[("cosyvoice_job_duration_seconds_bucket", (("le", "120.0"), *succeeded))] == 1
    late = (("le", "3600.0"), ("status", "cancelled"))
    assert found[("cosyvoice_job_duration_seconds_bucket", late)] == 0  # (4000 s)
    assert found[("cosyvoice_job_duration_seconds_bucket", (("le", "+Inf"), ("status", "cancelled")))] == 1
    assert store.metrics.snapshot(store, T0)["running"] == []


def test_a_retry_is_a_segment_sent_again_after_a_retryable_failure():
    metrics = JobMetrics()
    answers = iter([SegmentError(503, "busy", retryable=True), b"RIFF", SegmentError(400, "bad", retryable=False)])

    def send(params, text, seed):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    counted = counting_send(send, metrics)
    with pytest.raises(SegmentError):
        counted({"voice": "alloy"}, "One.", 7)
    assert metrics.retries == 0
    assert counted({"voice": "alloy"}, "One.", 7) == b"RIFF"
    assert metrics.retries == 1
    with pytest.raises(SegmentError):  # (not retryable: never sent again)
        counted({"voice": "alloy"}, "Two.", 7)
    assert metrics.retries == 1


def test_a_store_that_fails_is_said_and_its_counts_left_out(tmp_path):
    metrics = JobMetrics()
    broken = SqliteStore(tmp_path / "jobs.sqlite3")
    broken.close()  # (a closed store raises StoreError)
    snapshot = metrics.snapshot(broken, T0)
    assert snapshot["counts"] is None and "closed" in snapshot["error"]
    names = {family.name for family in text_string_to_metric_families(exposition(snapshot).decode())}
    assert "cosyvoice_jobs" not in names and "cosyvoice_job_segments_done" in names


def test_get_metrics_on_the_jobs_app_and_the_report_file(tmp_path, store):
    queue(store, 2)
    app = build_app(
        store,
        Config(state_dir=tmp_path),
        metrics=lambda: exposition(store.metrics.snapshot(store, T0)),
    )
    with TestClient(app) as client:
        answer = client.get("/metrics")
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
        assert samples(answer.text)[("cosyvoice_jobs", (("status", "queued"),))] == 1
        assert client.get("/v1/audio/jobs").json()["data"][0]["status"] == "queued"  # (the API is as before)
    path = report_path(tmp_path / "run")
    path.parent.mkdir()
    Reporter(path, store.metrics, store).report()
    report = read_report(path)
    assert report is not None and report["counts"]["queued"] == 1 and report["error"] == ""
    assert path.stat().st_mode & 0o777 == 0o600
    path.write_text("{not json")
    assert read_report(path) is None
