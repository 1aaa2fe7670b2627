"""The jobs process's metrics and its report: what the store holds, what the runner made.

- :class:`JobMetrics` counts, in this process: segments made, segments sent again, and the
  duration of every job that finished here (created → finished, by final status).
- :class:`Instrumented` is the store as the API and the runner use it, counting as they go
  (and keeping the running jobs' progress); :func:`counting_send` counts the retries.
- :meth:`JobMetrics.snapshot` is all of it at one moment, as JSON values, with the store's
  counts; :func:`families` turns a snapshot into Prometheus metric families (pure): the jobs
  process's own ``/metrics`` and the cluster's (which reads the report file) give the same.
- The report: the jobs process keeps a snapshot in ``run/jobs.json`` (written whole, every
  few seconds): ``status`` and the cluster's ``/metrics`` read it without touching the store.

prometheus_client is imported where families are made, not here: ``status`` reads the report
without it.
"""

from __future__ import annotations

import builtins
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.jobs import model
from cosyvoice_lb.jobs.base import Cancelled, JobStore, StoreError

log = logging.getLogger("cosyvoice_lb.jobs")

REPORT = "jobs.json"  # in the run dir
REPORT_EVERY = 2.0  # seconds between two reports
SHOWN_RUNNING = 20  # running jobs the report names (the counts hold them all)
# A job takes minutes to hours: seconds from created to finished
BUCKETS = (10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0)
FINAL = (model.SUCCEEDED, model.FAILED, model.CANCELLED)


def report_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / REPORT


class JobMetrics:
    """This process's counters (thread-safe) and the jobs it runs now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.segments_done = 0
        self.retries = 0
        # per final status: how many finished in each bucket (not cumulative), their sum
        self.durations = {status: [0] * (len(BUCKETS) + 1) for status in FINAL}
        self.duration_sums = dict.fromkeys(FINAL, 0.0)
        self.running: dict[str, tuple[int, int]] = {}  # job id -> (done, total), in the order claimed
        # the runner's (segments it may have out now, has out, times it yielded to interactive requests)
        self.segments: Callable[[], tuple[int, int, int]] | None = None

    def segment_done(self, job: model.Job) -> None:
        with self._lock:
            self.segments_done += 1
            self.running[job.id] = (job.segments_done, job.segments_total)

    def retry(self) -> None:
        with self._lock:
            self.retries += 1

    def started(self, job: model.Job) -> None:
        with self._lock:
            self.running[job.id] = (job.segments_done, job.segments_total)

    def gone(self, job_id: str) -> None:
        with self._lock:
            self.running.pop(job_id, None)

    def finished(self, job: model.Job) -> None:
        """A job that finished (succeeded, failed, cancelled) here."""
        if job.status not in FINAL or job.finished_at is None:
            return
        seconds = max(0.0, job.finished_at - job.created_at)
        bucket = next((i for i, bound in enumerate(BUCKETS) if seconds <= bound), len(BUCKETS))
        with self._lock:
            self.running.pop(job.id, None)
            self.durations[job.status][bucket] += 1
            self.duration_sums[job.status] += seconds

    def snapshot(self, store: JobStore | None, now: float) -> dict[str, Any]:
        """Everything at one moment, as JSON values; a store that fails is said in ``error``
        (and its counts are left out, not zero)."""
        counts: dict[str, int] | None = None
        error = ""
        if store is not None:
            try:
                counts = store.counts()
            except StoreError as exc:
                error = str(exc)
        allowed, out, yields = self.segments() if self.segments is not None else (0, 0, 0)
        with self._lock:
            running = [{"id": job_id, "done": d, "total": t} for job_id, (d, t) in self.running.items()]
            return {
                "segments_allowed": allowed,
                "segments_out": out,
                "yields": yields,
                "updated": now,
                "counts": counts,
                "error": error,
                "running": running[:SHOWN_RUNNING],
                "segments_done": self.segments_done,
                "retries": self.retries,
                "durations": {s: {"buckets": list(b), "sum": self.duration_sums[s]} for s, b in self.durations.items()},
            }


class Instrumented:
    """``store`` as the API and the runner use it, telling ``metrics`` what they do. Every
    call is the store's; only the answers are looked at."""

    def __init__(self, store: JobStore, metrics: JobMetrics) -> None:
        self.store, self.metrics = store, metrics

    # --- passed through as they are ---------------------------------------------------

    def describe(self) -> str:
        return self.store.describe()

    def create(self, job: model.Job, text: str) -> None:
        self.store.create(job, text)

    def get(self, job_id: str, owner: str) -> model.Job | None:
        return self.store.get(job_id, owner)

    def text(self, job_id: str) -> str | None:
        return self.store.text(job_id)

    def list(self, owner: str, limit: int | None = None, after: str | None = None) -> model.Page:
        return self.store.list(owner, limit, after)

    def done_segments(self, job_id: str) -> frozenset[int]:
        return self.store.done_segments(job_id)

    def expired(self, before: float) -> builtins.list[model.Job]:
        return self.store.expired(before)

    def remove(self, job_id: str) -> model.Job | None:
        return self.store.remove(job_id)

    def counts(self) -> dict[str, int]:
        return self.store.counts()

    def close(self) -> None:
        self.store.close()

    # --- counted -----------------------------------------------------------------------

    def claim_next(self, worker: str, lease_seconds: float, now: float) -> model.Job | None:
        job = self.store.claim_next(worker, lease_seconds, now)
        if job is not None:
            self.metrics.started(job)
        return job

    def renew(self, job_id: str, worker: str, lease_seconds: float, now: float) -> model.Job | None:
        job = self.store.renew(job_id, worker, lease_seconds, now)
        if job is None:  # (no longer this runner's)
            self.metrics.gone(job_id)
        return job

    def segment_done(self, job_id: str, index: int, now: float) -> model.Job | None:
        job = self.store.segment_done(job_id, index, now)
        if job is not None and job.status == model.RUNNING:
            self.metrics.segment_done(job)
        else:
            self.metrics.gone(job_id)
        return job

    def finish(
        self,
        job_id: str,
        worker: str,
        status: model.JobStatus,
        now: float,
        error: str | None = None,
        result: model.Result | None = None,
    ) -> model.Job | None:
        job = self.store.finish(job_id, worker, status, now, error, result)
        if job is None:
            self.metrics.gone(job_id)
        else:
            self.metrics.finished(job)
        return job

    def cancel(self, job_id: str, owner: str, now: float) -> Cancelled | None:
        done = self.store.cancel(job_id, owner, now)
        if done is not None and done.action == "cancelled":
            self.metrics.finished(done.job)
        return done


def counting_send(send: Callable[..., bytes], metrics: JobMetrics) -> Callable[..., bytes]:
    """``send``, counting a retry each time a segment is sent again after a try that failed
    retryably (the same text, params and seed: the runner's next try of that segment)."""
    failed: dict[str, int] = {}
    lock = threading.Lock()

    def key(params: Mapping[str, Any], text: str, seed: int | None) -> str:
        return json.dumps([dict(params), text, seed], sort_keys=True, default=str)

    def counted(params: Mapping[str, Any], text: str, seed: int | None) -> bytes:
        mark = key(params, text, seed)
        with lock:
            if failed.get(mark):
                failed[mark] -= 1
                if not failed[mark]:
                    del failed[mark]
                metrics.retry()
        try:
            return send(params, text, seed)
        except Exception as exc:
            if getattr(exc, "retryable", False):
                with lock:
                    if len(failed) > 10_000:  # (segments never tried again: their jobs failed)
                        failed.clear()
                    failed[mark] = failed.get(mark, 0) + 1
            raise

    return counted


def families(snapshot: Mapping[str, Any]) -> list[Any]:
    """The jobs' metric families for one snapshot (pure)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.utils import floatToGoString

    out: list[Any] = []
    counts = snapshot.get("counts")
    if isinstance(counts, dict):
        jobs = GaugeMetricFamily("cosyvoice_jobs", "Long-form jobs in the store, by status.", labels=["status"])
        for status in model.STATUSES:
            jobs.add_metric([status], float(counts.get(status, 0)))
        out.append(jobs)
    for name, key, what in (
        ("cosyvoice_job_segments_done", "segments_done", "Segments of jobs made and recorded done by this process."),
        ("cosyvoice_job_segment_retries", "retries", "Segments of jobs sent again after a try that failed retryably."),
    ):
        out.append(CounterMetricFamily(name, what, value=float(snapshot.get(key, 0))))
    for name, key, what in (
        ("cosyvoice_job_segment_slots", "segments_allowed", "Segments of jobs this process may have out now."),
        ("cosyvoice_job_segments_in_flight", "segments_out", "Segments of jobs this process has out now."),
    ):
        out.append(GaugeMetricFamily(name, what, value=float(snapshot.get(key, 0))))
    out.append(
        CounterMetricFamily(
            "cosyvoice_job_yields",
            "Times the jobs' share fell to its floor because interactive requests came (--job-slots auto).",
            value=float(snapshot.get("yields", 0)),
        )
    )
    duration = HistogramMetricFamily(
        "cosyvoice_job_duration_seconds",
        "Seconds from a job's creation to its end, for the jobs that finished here, by final status.",
        labels=["status"],
    )
    for status, entry in sorted(dict(snapshot.get("durations") or {}).items()):
        running_total, buckets = 0, []
        for bound, count in zip([*BUCKETS, float("inf")], entry["buckets"]):
            running_total += int(count)
            buckets.append((floatToGoString(bound), float(running_total)))
        duration.add_metric([status], buckets, float(entry["sum"]))
    out.append(duration)
    return out


class SnapshotCollector:
    """A prometheus_client collector over ``snapshot()`` (taken at each scrape)."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        yield from families(self.snapshot())


def exposition(snapshot: Mapping[str, Any]) -> bytes:
    """A snapshot in Prometheus' text format (the jobs socket's ``GET /metrics``)."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    return generate_latest(registry)


def write_report(path: Path, snapshot: Mapping[str, Any]) -> None:
    write_atomic(path, json.dumps(snapshot, separators=(",", ":")).encode(), mode=0o600, durable=False)


def read_report(path: Path) -> dict[str, Any] | None:
    """The jobs process's last report, or None (none yet, or not readable as one)."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


class Reporter:
    """Keeps ``run/jobs.json`` fresh from ``metrics`` and ``store``."""

    def __init__(self, path: Path, metrics: JobMetrics, store: JobStore, every: float = REPORT_EVERY) -> None:
        self.path, self.metrics, self.store, self.every = path, metrics, store, every

    def report(self) -> None:
        write_report(self.path, self.metrics.snapshot(self.store, time.time()))

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.report()
            except OSError as exc:
                log.warning("the jobs report %s could not be written: %s", self.path, exc)
            stop.wait(self.every)
