"""The jobs process (``python -m cosyvoice_lb.jobs --state-dir DIR``, run by supervisord):
the jobs API on ``run/jobs.sock`` and, beside it, the runner that makes the jobs' segments
through nginx, and the retention that removes finished jobs past ``--job-max-age`` and
expires the oldest finished jobs' audio past ``--outputs-max-size`` (:mod:`cosyvoice_lb.jobs.budget`).
Its metrics are ``GET /metrics`` on the socket, and ``run/jobs.json`` (kept fresh) is what
``status`` and the cluster's ``/metrics`` read of it (:mod:`cosyvoice_lb.jobs.metrics`).

It reads the cluster's settings from its record (``run/cluster.json``), as the health loop
does. The store is the state dir's SQLite file, or Redis when ``COSYVOICE_LB_JOBS_REDIS``
is in its environment (the URL may hold a password: never on a command line); the jobs'
audio is in ``--job-results`` (:func:`results_root`), by default ``jobs/results`` in the state
dir: pods that share Redis share that directory too, on a volume. SIGTERM stops
it: the API closes, the runner leaves its segments in flight (a later start makes them
again; those done are kept) and the process exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyvoice_lb.common.checks import parse_voice_map
from cosyvoice_lb.common.settings import Settings, envvar
from cosyvoice_lb.common.sizes import parse_size
from cosyvoice_lb.instance.access.auth import PolicyFile
from cosyvoice_lb.instance.audio.sweep import pod_volume
from cosyvoice_lb.instance.speech.fanout import KEY_HEADER
from cosyvoice_lb.jobs.base import JobStore, StoreError
from cosyvoice_lb.jobs.budget import Budget
from cosyvoice_lb.jobs.metrics import Instrumented, JobMetrics, Reporter, counting_send, exposition, report_path
from cosyvoice_lb.jobs.results import results_dir
from cosyvoice_lb.jobs.service import Config, build_app
from cosyvoice_lb.jobs.store import open_store
from cosyvoice_lb.jobs.yielding import BoardDemand, Demand, Yielding, share_for
from cosyvoice_lb.launcher.plan.planner import Roles, Slot
from cosyvoice_lb.launcher.render.addresses import balancer_url
from cosyvoice_lb.launcher.render.cluster import jobs_socket
from cosyvoice_lb.launcher.render.credentials import jobs_token_path, read_segment_key
from cosyvoice_lb.launcher.state import record
from cosyvoice_lb.launcher.state.layout import Layout

log = logging.getLogger("cosyvoice_lb.jobs")

RETENTION_EVERY = 60.0  # seconds between two sweeps of finished jobs past --job-max-age


def serving_slots(slots: tuple[Slot, ...], roles: Roles) -> tuple[int, int]:
    """(the serving instances' syntheses at once, the most one instance makes)."""
    serving = slots[: roles.serving] or slots
    total = sum(max(1, slot.concurrency) for slot in serving)
    return total, max((max(1, slot.concurrency) for slot in serving), default=1)


def job_slots(settings: Settings, slots: tuple[Slot, ...], roles: Roles) -> int:
    """--job-slots: N, or auto: at most every serving instance's syntheses at once (fewer
    while interactive requests come: :func:`job_share`)."""
    if str(settings.job_slots).strip() != "auto":
        return max(1, int(settings.job_slots))
    return serving_slots(slots, roles)[0]


def job_share(
    settings: Settings,
    slots: tuple[Slot, ...],
    roles: Roles,
    board: Path,
    *,
    demand: Callable[[], Demand | None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Yielding | None:
    """--job-slots auto: the jobs' share that yields to interactive requests, as the routing
    board at ``board`` shows them (``demand``: what reads it, :class:`BoardDemand` when
    None; :mod:`cosyvoice_lb.jobs.yielding`) at ``clock``'s time; None for a fixed N."""
    if str(settings.job_slots).strip() != "auto":
        return None
    return Yielding(share_for(*serving_slots(slots, roles)), demand or BoardDemand(board), clock)


def redis_url(settings: Settings, environ: Mapping[str, str] = os.environ) -> str:
    """--jobs-redis as the process's environment gives it (the record's value otherwise)."""
    return environ.get(envvar("jobs_redis"), "") or settings.jobs_redis


def job_segment_chars(settings: Settings) -> int:
    """A job's segments: the long-text path's size, never past what one request may ask
    (an instance would split a longer one again; /v1/audio/speech refuses past 4096)."""
    return min(settings.segment_chars, settings.max_chars)


def service_config(settings: Settings, layout: Layout) -> Config:
    return Config(
        state_dir=layout.root,
        max_chars=settings.max_job_chars,
        segment_chars=job_segment_chars(settings),
        max_age=settings.job_max_age,
        voices_dir=settings.voices_dir,
        voice_map=parse_voice_map(settings.openai_voices),
        job_results=settings.job_results,
    )


def results_root(settings: Settings, layout: Layout) -> Path:
    """--job-results, else jobs/results in the state dir (:func:`cosyvoice_lb.jobs.results.results_dir`)."""
    return results_dir(layout.root, settings.job_results)


def read_token(layout: Layout, settings: Settings) -> str:
    """The runner's own token when the service needs credentials ("" without)."""
    if not settings.auth_required:
        return ""
    path = jobs_token_path(layout)
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            return line.strip()
    raise ValueError(f"{path} holds no token: run cosyvoice-lb up again")


def make_runner(
    settings: Settings,
    layout: Layout,
    store: JobStore,
    slots: int,
    metrics: JobMetrics,
    share: Yielding | None = None,
    *,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], object] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> Any:
    """The runner over the store, sending through nginx with its own credentials, at most
    ``slots`` segments out (``share``: fewer while interactive requests come), on ``clock``
    (epoch seconds), ``sleep`` and ``monotonic``; None in a build without it."""
    try:
        from cosyvoice_lb.jobs import results, runner, sender
    except ImportError as exc:
        log.error("no job runner in this build (%s): jobs are queued, none is made", exc)
        return None
    token = read_token(layout, settings)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # The cluster's segment key: nginx then knows a job's segments from a client's requests.
    # --rate-limit, paid by the job's own POST, does not count them again (a chapter's hundreds
    # of segments would meet 429s), and they are balanced in the segments' pool. Without
    # X-Cvlb-Segment they are ordinary requests to an instance.
    key = read_segment_key(layout)
    if key:
        headers[KEY_HEADER] = key
    # (nginx answers within --request-timeout, retries included: a little more is the bound)
    send = sender.Sender(balancer_url(settings), headers=headers, timeout=settings.request_timeout + 30.0)
    return runner.Runner(
        store,
        counting_send(send, metrics),
        results.Results(results_root(settings, layout)),
        worker=f"{socket.gethostname()}:{os.getpid()}",
        slots=slots,
        segment_chars=job_segment_chars(settings),
        share=share,
        clock=clock,
        sleep=sleep,
        monotonic=monotonic,
    )


@dataclass
class Retention:
    """Finished jobs past --job-max-age go: their audio first, then their record (a record
    left by a crash between the two is removed at the next sweep)."""

    store: JobStore
    results_root: Path
    max_age: float
    budget: Budget | None = None  # --outputs-max-size over the outputs and the results

    def sweep(self, now: float) -> int:
        from cosyvoice_lb.jobs.results import Results

        results = Results(self.results_root)
        removed = 0
        for job in self.store.expired(now - self.max_age):
            results.remove(job.id)
            if self.store.remove(job.id) is not None:
                removed += 1
        if self.budget is not None:
            expired = self.budget.enforce(self.store, now)
            if expired:
                log.info("outputs budget: the audio of %d finished job(s) removed (they read as expired)", len(expired))
        return removed

    def run(self, stop: threading.Event, every: float = RETENTION_EVERY) -> None:
        while not stop.is_set():
            try:
                removed = self.sweep(time.time())
                if removed:
                    log.info("retention: %d finished job(s) past --job-max-age removed", removed)
            except (StoreError, OSError) as exc:
                log.warning("retention skipped this round: %s", exc)
            stop.wait(every)


def outputs_budget(settings: Settings, layout: Layout, environ: Mapping[str, str] = os.environ) -> Budget:
    """--outputs-max-size over the instances' outputs dir (on Kubernetes the shared volume, every
    pod's dir, as the instances sweep it) and the jobs' results."""
    outputs = Path(environ.get(envvar("outputs_dir"), "") or settings.outputs_dir or str(layout.outputs))
    return Budget(
        pod_volume(outputs, environ) or outputs,
        results_root(settings, layout),
        parse_size(settings.outputs_max_size),
        shown=settings.outputs_max_size,
    )


def serve(layout: Layout, found: record.ClusterRecord) -> None:
    import uvicorn

    settings = found.settings
    metrics = JobMetrics()
    store = Instrumented(open_store(layout.root, redis_url(settings)), metrics)
    policy = PolicyFile(str(layout.access_policy)) if settings.auth_required else None

    def scrape() -> bytes:
        return exposition(metrics.snapshot(store, time.time()))

    app = build_app(store, service_config(settings, layout), policy, metrics=scrape)
    stop = threading.Event()
    threads = []
    slots = job_slots(settings, found.slots, found.roles)
    share = job_share(
        settings, found.slots, found.roles, layout.routing_board, demand=BoardDemand(layout.routing_board)
    )
    # (the runner's idle wait is the stop event's: a stop ends it at once)
    runner = make_runner(
        settings, layout, store, slots, metrics, share, clock=time.time, sleep=stop.wait, monotonic=time.monotonic
    )
    if runner is not None:
        metrics.segments = lambda: (runner.allowed, runner.out, share.share.yields if share else 0)
        threads.append(threading.Thread(target=runner.run, args=(stop,), name="job-runner", daemon=True))
    keeper = Retention(store, results_root(settings, layout), settings.job_max_age, outputs_budget(settings, layout))
    threads.append(threading.Thread(target=keeper.run, args=(stop,), name="job-retention", daemon=True))
    reporter = Reporter(report_path(layout.run), metrics, store)
    threads.append(threading.Thread(target=reporter.run, args=(stop,), name="job-report", daemon=True))
    for thread in threads:
        thread.start()
    socket_path = jobs_socket(layout)
    log.info(
        "jobs API on %s, store %s, %d segment(s) in flight at most%s",
        socket_path,
        store.describe(),
        slots,
        f" ({share.share.floor} while interactive requests come)" if share else "",
    )
    server = uvicorn.Server(uvicorn.Config(app, uds=str(socket_path), log_level="warning", access_log=False))
    try:
        server.run()  # (uvicorn's own SIGTERM/SIGINT handling ends it)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=12)  # (the runner drains its segments out for 10 s at most)
        store.close()
        log.info("jobs process stopped")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="cosyvoice-lb jobs API and runner (run by supervisord)")
    parser.add_argument("--state-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s jobs %(levelname)s %(message)s")
    layout = Layout(Path(args.state_dir).resolve())
    serve(layout, record.parse(layout.cluster_json.read_text()))


if __name__ == "__main__":
    main()
