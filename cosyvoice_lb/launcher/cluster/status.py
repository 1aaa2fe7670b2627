"""`cosyvoice-lb status`: what supervisord, the health loop, the instances and nginx say,
gathered; what it means is :mod:`~cosyvoice_lb.launcher.cluster.diagnosis`'s to say.

Read-only; ``lifecycle`` polls it while it waits for instances to serve.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from cosyvoice_lb.common.timeouts import SUPERVISOR_POLL
from cosyvoice_lb.jobs.metrics import read_report as read_jobs_report
from cosyvoice_lb.jobs.metrics import report_path as jobs_report_path
from cosyvoice_lb.launcher.cluster.diagnosis import (
    ESSENTIAL,
    SERVICES,
    ClusterStatus,
    InstanceStatus,
    Observation,
    diagnose,
    jobs_line,
    pool_summary,
    public_url,
)
from cosyvoice_lb.launcher.cluster.listeners import config_behind, nginx_listening, nginx_processes
from cosyvoice_lb.launcher.health.probe import Prober
from cosyvoice_lb.launcher.plan.gpu import GpuReading, gpu_readings, process_gpu_memory
from cosyvoice_lb.launcher.plan.planner import Slot
from cosyvoice_lb.launcher.render.credentials import admin_token_path, open_warning
from cosyvoice_lb.launcher.render.staging import staged_digest
from cosyvoice_lb.launcher.state import processes
from cosyvoice_lb.launcher.state.canary import read as read_canary
from cosyvoice_lb.launcher.state.health_report import read_report
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.markers import drained_by_hand, starts_count
from cosyvoice_lb.launcher.state.record import read as read_record
from cosyvoice_lb.launcher.state.supervision import ALIVE, ProgramState, SupervisionError, Supervisor, read_tail


@dataclass(frozen=True)
class Telemetry:
    """Where :func:`status` reads the GPUs from: NVML by default, a fake inventory in tests.

    ``readings()`` gives the visible cards; ``process_memory(pids)`` the GPU bytes per pid.
    """

    readings: Callable[[], tuple[GpuReading, ...]] = gpu_readings
    process_memory: Callable[[set[int]], dict[int, int]] = process_gpu_memory


NVML = Telemetry()
NO_TELEMETRY = Telemetry(readings=lambda: (), process_memory=lambda pids: {})  # for callers that only need states


def ask_all(prober: Prober, slots: list[Slot], timeout: float, url: str) -> tuple[dict[str, dict], int]:
    """Every instance's /ping body and nginx's /ping status, all asked at once: instances
    that do not answer cost one timeout together, not one each."""
    with ThreadPoolExecutor(max_workers=len(slots) + 1) as pool:
        nginx = pool.submit(prober.get_status, url + "/ping", timeout + 1)
        bodies = dict(zip([s.name for s in slots], pool.map(lambda s: prober.ping(s.port, timeout), slots)))
        return bodies, nginx.result()


def status(layout: Layout, prober: Prober | None = None, telemetry: Telemetry = NVML) -> ClusterStatus:
    """The cluster as supervisord, the health loop, the instances' /ping and nginx see it
    (gathered here, judged by :func:`~cosyvoice_lb.launcher.cluster.diagnosis.diagnose`).

    The instances are asked in parallel (with nginx): an instance that does not answer
    costs one probe timeout, not one per instance. A supervisord that does not answer
    makes a status with ``running`` False and that said in ``problems``. A running
    cluster's status has its GPUs and each instance's GPU memory, from ``telemetry``."""
    supervisor = Supervisor(layout, timeout=SUPERVISOR_POLL)
    found = read_record(layout)  # (once: status is polled while the cluster changes)
    if found is not None and layout.socket.exists():
        try:
            programs = supervisor.processes()
        except SupervisionError as exc:
            if exc.timed_out:
                return ClusterStatus(running=False, problems=[f"supervisord does not answer: {exc}"], unanswered=True)
            programs = {}  # a socket nobody listens on: not running
    else:
        programs = {}
    if not programs or found is None:
        return not_running(layout, found.settings.port if found else None)
    settings, slots = found.settings, found.slots
    url = public_url(settings)
    running = [s for s in slots if s.name in programs and programs[s.name].state == ProgramState.RUNNING]
    pings, answer = ask_all(prober or Prober(len(slots) + 1), running, settings.probe_timeout, url)
    nginx = programs.get("nginx")
    # (a STARTING nginx listens already: what it listens on is read, not "nothing")
    procs = nginx_processes(nginx.pid) if nginx and nginx.state in ALIVE else []
    result = diagnose(
        Observation(
            settings=settings,
            slots=slots,
            roles=found.roles,
            programs=programs,
            health=read_report(layout),
            pings=pings,
            nginx_answer=answer,
            drained=frozenset(s.name for s in slots if drained_by_hand(layout, s.name)),
            starts={s.name: starts_count(layout, s.name) for s in slots},
            listening=frozenset(nginx_listening(nginx.pid)) if nginx and procs else None,
            config_behind=config_behind(procs, (layout.nginx_conf, layout.upstreams_conf)) if procs else 0.0,
            staged=staged_digest(layout.instance_lib),
            admin_token_file=str(admin_token_path(settings, layout)),
            open_warning=open_warning(settings),
            jobs_report=(read_jobs_report(jobs_report_path(layout.run)) or {}) if "jobs" in programs else None,
            now=time.time(),
            canary=read_canary(layout),
        )
    )
    result.report = failure_report(layout, result)
    read_gpus(result, telemetry)
    return result


def not_running(layout: Layout, port: int | None) -> ClusterStatus:
    """No cluster runs there; said with what of one is left behind."""
    problems = [f"no cluster runs in {layout.root}"]
    strays = processes.stray_processes(layout, port)
    if strays:
        problems.append(
            f"{len(strays)} process(es) of it outlived supervisord "
            f"(pids {', '.join(str(p.pid) for p in strays)}): 'cosyvoice-lb down' stops them"
        )
    return ClusterStatus(running=False, problems=problems)


def pool_line(pool: dict) -> str:
    """The pool in words, for `status`."""
    if not pool:
        return ""
    words = f"pool: {pool['in_rotation']} in rotation of {pool['wanted']} wanted"
    if pool.get("elastic"):
        words += f" (elastic {pool['elastic']['min']}..{pool['elastic']['max']})"
    if pool.get("surge"):
        words += f", +{pool['surge']} for a roll-out under way"
    if pool.get("spares_wanted") or pool.get("spares"):
        words += f"; {pool['spares']} of {pool['spares_wanted']} warm spare(s) ready"
    if pool.get("parked"):
        words += f"; {pool['parked']} parked slot(s)"
    for decision in pool.get("decisions", []):
        when = time.strftime("%H:%M:%S", time.localtime(float(decision.get("at", 0))))
        words += f"\n  {when} {decision.get('reason', '')} -> {decision.get('target')}"
    return words


def read_gpus(result: ClusterStatus, telemetry: Telemetry) -> None:
    """Fill in the cards and each instance's GPU memory (in place); nothing without a GPU."""
    result.gpus = list(telemetry.readings())
    pids = {i.pid for i in result.instances if i.pid}
    if not result.gpus or not pids:
        return  # no card, or nothing running: no second NVML session
    used = telemetry.process_memory(pids)
    for item in result.instances:
        item.gpu_memory = used.get(item.pid, 0) if item.pid else 0


def failure_report(
    layout: Layout, current: ClusterStatus, names: list[str] | None = None, supervisor: Tails | None = None
) -> list[str]:
    """For each failed instance: why, and the last lines of its log."""
    supervisor = supervisor or Supervisor(layout)
    lines = []
    for item in current.instances:
        if item.failed and (names is None or item.name in names):
            lines.append(f"{item.name} {item.failed}; last lines of {layout.log(item.name)}:")
            lines += ["    " + line for line in last_lines(supervisor, item.name, 12).splitlines()]
    return lines


class Tails(Protocol):
    """Where the programs' logs are read (:class:`Supervisor`)."""

    layout: Layout

    def tail(self, name: str, length: int = 4000) -> str: ...


def last_lines(supervisor: Tails, name: str, lines: int = 20) -> str:
    text = supervisor.tail(name, 8000)
    if name == "nginx":
        text += read_tail(supervisor.layout.log("nginx-error"), 4000)
    return "\n".join(text.strip().splitlines()[-lines:]) or "(empty log)"


__all__ = [
    "ESSENTIAL",
    "NO_TELEMETRY",
    "NVML",
    "SERVICES",
    "ClusterStatus",
    "InstanceStatus",
    "Telemetry",
    "ask_all",
    "failure_report",
    "last_lines",
    "jobs_line",
    "pool_line",
    "pool_summary",
    "public_url",
    "read_gpus",
    "status",
]
