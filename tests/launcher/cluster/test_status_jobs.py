"""`status` with long-form jobs: the jobs process's report (run/jobs.json, written by its real
Reporter over a real SqliteStore) read into the status, its words, its JSON and the cluster's
/metrics; a stale or failing report is a "jobs: ..." problem, never a failed status."""

from __future__ import annotations

import json
import os
import time

import test_status
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_status import Answering, FakeSupervisor

from cosyvoice_lb.instance.access.auth import SHARED_OWNER
from cosyvoice_lb.jobs import model
from cosyvoice_lb.jobs.metrics import Instrumented, JobMetrics, Reporter, report_path
from cosyvoice_lb.jobs.store import SqliteStore
from cosyvoice_lb.launcher.cluster.status import NO_TELEMETRY, status
from cosyvoice_lb.launcher.panel.metrics import ClusterView, ViewCollector
from cosyvoice_lb.launcher.plan.planner import Slot
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.views import status_lines

TEXT = "One. Two. Three. Four. Five."


class WithJobs(FakeSupervisor):
    """supervisord with one instance and every service, the jobs process too."""

    PIDS = {"instance-0": 4242, "nginx": 50, "health": 51, "admin": 52, "jobs": 53}


class WithoutJobs(FakeSupervisor):
    PIDS = {"instance-0": 4242, "nginx": 50, "health": 51, "admin": 52}


ONE_SLOT = (Slot(index=0, port=7860, gpu=None, memory=1),)


def running_cluster(monkeypatch, tmp_path, supervisor=WithJobs) -> Layout:
    return test_status.running_cluster(monkeypatch, tmp_path, ONE_SLOT, supervisor)


def jobs_under_way(layout: Layout) -> tuple[str, JobMetrics]:
    """Two jobs queued, one claimed with 2 of its 5 segments made; reported as the process does."""
    metrics = JobMetrics()
    store = Instrumented(SqliteStore(layout.root / "jobs" / "jobs.sqlite3"), metrics)
    try:
        now = time.time()
        for offset in range(3):
            store.create(model.new_job(SHARED_OWNER, TEXT, 5, now + offset), TEXT)
        job = store.claim_next("runner", 30.0, now + 5)
        assert job is not None
        store.segment_done(job.id, 0, now + 6)
        store.segment_done(job.id, 1, now + 7)
        Reporter(report_path(layout.run), metrics, store).report()
    finally:
        store.close()
    return job.id, metrics


def test_status_shows_the_queued_and_running_jobs(monkeypatch, tmp_path):
    layout = running_cluster(monkeypatch, tmp_path)
    running_id, _ = jobs_under_way(layout)
    current = status(layout, Answering(), NO_TELEMETRY)  # type: ignore[arg-type]
    assert not [p for p in current.problems if p.startswith("jobs")], current.problems  # (the fake has others)
    assert current.jobs["state"] == "RUNNING" and current.jobs["queued"] == 2 and current.jobs["running"] == 1
    assert current.jobs["running_jobs"] == [{"id": running_id, "done": 2, "total": 5}]
    words = status_lines(current, layout.root)
    assert f"jobs: 2 queued, 1 running ({running_id} 2/5)" in words
    shown = json.loads(json.dumps(current.as_dict()))
    assert shown["jobs"]["queued"] == 2 and shown["jobs"]["running_jobs"][0]["done"] == 2

    registry = CollectorRegistry(auto_describe=False)
    registry.register(ViewCollector(lambda: ClusterView(status=current, now=time.time())))
    found = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert found[("cosyvoice_jobs", (("status", "queued"),))] == 2
    assert found[("cosyvoice_jobs", (("status", "running"),))] == 1
    assert found[("cosyvoice_job_segments_done_total", ())] == 2
    assert ("cosyvoice_lb_instance_up", (("name", "instance-0"),)) in found  # (beside the cluster's own)


def test_a_stale_or_failing_report_is_a_jobs_problem_and_status_goes_on(monkeypatch, tmp_path):
    layout = running_cluster(monkeypatch, tmp_path)
    current = status(layout, Answering(), NO_TELEMETRY)  # type: ignore[arg-type]
    assert [p for p in current.problems if p.startswith("jobs:")] == [
        "jobs: the jobs process has not reported (run/jobs.json); see 'cosyvoice-lb logs jobs'"
    ]
    jobs_under_way(layout)
    path = report_path(layout.run)
    old = time.time() - 120
    report = json.loads(path.read_text())
    report.update(updated=old, counts=None, error="the job store /x/jobs.sqlite3 is damaged: move it aside")
    path.write_text(json.dumps(report))
    os.utime(path, (old, old))
    started = time.perf_counter()
    current = status(layout, Answering(), NO_TELEMETRY)  # type: ignore[arg-type]
    assert time.perf_counter() - started < 2.0
    problems = [p for p in current.problems if p.startswith("jobs:")]
    assert len(problems) == 2 and "has not reported for 12" in problems[0] and "damaged" in problems[1]
    assert current.exit_code == 1 and "queued" not in current.jobs  # (no counts from a store that failed)
    path.write_text("[1, 2")
    current = status(layout, Answering(), NO_TELEMETRY)  # type: ignore[arg-type]
    assert any(p.startswith("jobs: the jobs process has not reported (") for p in current.problems)


def test_without_a_jobs_process_no_jobs_line(monkeypatch, tmp_path):
    layout = running_cluster(monkeypatch, tmp_path, WithoutJobs)
    jobs_under_way(layout)
    current = status(layout, Answering(), NO_TELEMETRY)  # type: ignore[arg-type]
    assert "jobs is missing" in current.problems and not any(p.startswith("jobs:") for p in current.problems)
    assert not any(line.startswith("jobs: ") for line in status_lines(current, layout.root))


def test_a_jobs_process_just_started_is_given_time_to_report():
    from cosyvoice_lb.launcher.cluster.diagnosis import ClusterStatus, jobs_findings

    for report, uptime, said in (
        ({}, 5.0, 0),
        ({}, 60.0, 1),
        (None, 60.0, 0),
        ({"updated": 0.0, "running": []}, 5.0, 0),
    ):
        current = ClusterStatus(running=True, jobs={"state": "RUNNING", "pid": 53})
        jobs_findings(current, report, now=1000.0, uptime=uptime)
        assert len(current.problems) == said, (report, uptime, current.problems)
    current = ClusterStatus(running=True, jobs={"state": "RUNNING", "pid": 53})
    jobs_findings(current, {"updated": 999.0, "running": [{"id": "job_x"}]}, now=1000.0, uptime=60.0)
    assert current.problems == ["jobs: its report (run/jobs.json) is not readable; see 'cosyvoice-lb logs jobs'"]
