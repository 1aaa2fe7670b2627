"""The cluster's Prometheus metrics: what supervisord, the health loop, NVML and nginx say,
turned into metric families at each scrape.

Pure: :func:`families` takes a :class:`ClusterView` (gathered by the control panel's
process, ``admin.py``) and returns the families; :class:`ViewCollector` hands them to a
prometheus_client registry. Without a GPU the GPU families are absent, not zero.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cosyvoice_lb.jobs.metrics import families as job_families
from cosyvoice_lb.launcher.cluster.status import ClusterStatus
from cosyvoice_lb.launcher.health.rules import restarts_by_reason
from cosyvoice_lb.launcher.state.health_report import HealthReport
from cosyvoice_lb.launcher.state.supervision import ProgramState

Family = GaugeMetricFamily | CounterMetricFamily


@dataclass(frozen=True)
class NginxCounters:
    """nginx's stub_status page."""

    active: int
    accepted: int
    handled: int
    requests: int
    reading: int
    writing: int
    waiting: int


def parse_stub_status(text: str) -> NginxCounters | None:
    """stub_status's text (None: not that page)."""
    found = re.search(
        r"Active connections:\s*(\d+)\s+server accepts handled requests\s+(\d+)\s+(\d+)\s+(\d+)\s+"
        r"Reading:\s*(\d+)\s+Writing:\s*(\d+)\s+Waiting:\s*(\d+)",
        text,
    )
    if found is None:
        return None
    active, accepted, handled, requests, reading, writing, waiting = (int(g) for g in found.groups())
    return NginxCounters(active, accepted, handled, requests, reading, writing, waiting)


@dataclass
class ClusterView:
    """Everything one scrape reports, read at one moment."""

    status: ClusterStatus
    planned: int = 0  # instances in the plan
    report: HealthReport = field(default_factory=HealthReport)  # health.json
    memory: dict[str, int] = field(default_factory=dict)  # per instance, RSS bytes
    nginx: NginxCounters | None = None
    now: float = 0.0


def _gauge(name: str, what: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, what, labels=labels)


def families(view: ClusterView) -> list[Family]:
    """The cluster's metric families for one view."""
    current, report = view.status, view.report
    out: list[Family] = []

    planned = _gauge("cosyvoice_lb_instances", "Instances in the plan.")
    planned.add_metric([], view.planned or len(current.instances))
    out.append(planned)

    pool = current.pool or {}
    if pool:
        wanted = _gauge(
            "cosyvoice_lb_instances_wanted",
            "Instances wanted in rotation now: the plan's (elastic: the scaler's), plus a roll-out's surge.",
        )
        wanted.add_metric([], float(pool.get("wanted", 0)) + float(pool.get("surge", 0)))
        roles = _gauge(
            "cosyvoice_lb_instances_by_role",
            "Instances in rotation, warm spares (ready, out of rotation), and parked slots (not started).",
            ["role"],
        )
        for role, key in (("in_rotation", "in_rotation"), ("spare", "spares"), ("parked", "parked")):
            roles.add_metric([role], float(pool.get(key, 0)))
        out += [wanted, roles]

    up = _gauge("cosyvoice_lb_instance_up", "1 when supervisord runs the instance.", ["name"])
    ready = _gauge("cosyvoice_lb_instance_ready", "1 when the instance says it is ready.", ["name"])
    rotation = _gauge("cosyvoice_lb_instance_in_rotation", "1 when nginx sends it requests.", ["name"])
    drained = _gauge("cosyvoice_lb_instance_drained", "1 when drained by hand (out of rotation on purpose).", ["name"])
    uptime = _gauge("cosyvoice_lb_instance_uptime_seconds", "Seconds since the instance's process started.", ["name"])
    memory = _gauge("cosyvoice_lb_instance_memory_bytes", "Resident memory of the instance's process.", ["name"])
    restarts = CounterMetricFamily(
        "cosyvoice_lb_instance_restarts",
        "Restarts of the instance by reason: crash (exited on its own), hang, probe_failures, not_ready, "
        "recycle (--max-requests, --max-memory), requested (restart), replaced (new settings, surge roll-outs), "
        "scaled_in (stopped by elastic scaling), bad_audio (its warm-up or a canary made bad audio).",
        labels=["name", "reason"],
    )
    inflight = _gauge("cosyvoice_lb_instance_in_flight", "Syntheses the instance runs now.", ["name"])
    queue = _gauge("cosyvoice_lb_instance_queue_depth", "Requests waiting for the instance's engine.", ["name"])
    probe = _gauge("cosyvoice_lb_probe_duration_seconds", "Seconds the health loop's last probe took.", ["name"])
    gpu_memory = _gauge(
        "cosyvoice_lb_instance_gpu_memory_bytes", "GPU memory the instance's process holds.", ["name", "gpu"]
    )
    for item in current.instances:
        name = [item.name]
        up.add_metric(name, float(item.state == ProgramState.RUNNING))
        ready.add_metric(name, float(item.ready))
        rotation.add_metric(name, float(item.in_rotation))
        drained.add_metric(name, float(item.drained))
        uptime.add_metric(name, item.uptime)
        inflight.add_metric(name, item.inflight)
        queue.add_metric(name, item.waiting)
        memory.add_metric(name, float(view.memory.get(item.name, 0)))
        for reason, count in restarts_by_reason(report.track(item.name)).items():
            restarts.add_metric([item.name, reason], count)
        if item.name in report.probe_seconds:
            probe.add_metric(name, report.probe_seconds[item.name])
        if item.gpu is not None and current.gpus:
            gpu_memory.add_metric([item.name, str(item.gpu)], float(item.gpu_memory))
    out += [up, ready, rotation, drained, uptime, inflight, queue, memory, restarts, probe]
    if current.gpus:
        out.append(gpu_memory)
        out += gpu_families(current)

    age = _gauge("cosyvoice_lb_health_report_age_seconds", "Seconds since the health loop last reported.")
    if report.updated:
        age.add_metric([], max(0.0, view.now - report.updated))
        out.append(age)

    out += nginx_families(view.nginx)
    out += jobs_families(current.jobs)
    return out


def jobs_families(jobs: dict) -> list[Family]:
    """The long-form jobs' families, from the jobs process's report as ``status`` read it
    (none before it reported, or without a jobs process)."""
    report = jobs.get("metrics") if isinstance(jobs, dict) else None
    if not isinstance(report, dict):
        return []
    try:
        return job_families(report)
    except (TypeError, ValueError, KeyError, AttributeError):  # (a report not of this version)
        return []


def gpu_families(current: ClusterStatus) -> list[Family]:
    info = _gauge("cosyvoice_lb_gpu_info", "The GPU's model and UUID.", ["gpu", "model", "uuid"])
    used = _gauge("cosyvoice_lb_gpu_memory_used_bytes", "GPU memory in use (every process).", ["gpu"])
    total = _gauge("cosyvoice_lb_gpu_memory_total_bytes", "GPU memory of the card.", ["gpu"])
    utilization = _gauge("cosyvoice_lb_gpu_utilization_ratio", "Share of time the GPU was busy (0-1).", ["gpu"])
    temperature = _gauge("cosyvoice_lb_gpu_temperature_celsius", "The GPU's temperature.", ["gpu"])
    power = _gauge("cosyvoice_lb_gpu_power_watts", "The GPU's power draw.", ["gpu"])
    for gpu in current.gpus:
        index = [str(gpu.index)]
        info.add_metric([str(gpu.index), gpu.name, gpu.uuid], 1)
        used.add_metric(index, float(gpu.memory_used))
        total.add_metric(index, float(gpu.memory_total))
        # (a reading the card does not support is left out, not reported as 0)
        for family, value in ((utilization, gpu.utilization), (temperature, gpu.temperature), (power, gpu.power)):
            if value is not None:
                family.add_metric(index, float(value))
    return [info, used, total, utilization, temperature, power]


def nginx_families(counters: NginxCounters | None) -> list[Family]:
    up = _gauge("cosyvoice_lb_nginx_up", "1 when nginx's stub_status answered.")
    up.add_metric([], float(counters is not None))
    if counters is None:
        return [up]
    connections = _gauge("cosyvoice_lb_nginx_connections", "nginx's client connections by state.", ["state"])
    for state in ("active", "reading", "writing", "waiting"):
        connections.add_metric([state], getattr(counters, state))
    out: list[Family] = [up, connections]
    for name, value, what in (
        ("cosyvoice_lb_nginx_connections_accepted", counters.accepted, "Client connections nginx accepted."),
        ("cosyvoice_lb_nginx_connections_handled", counters.handled, "Client connections nginx handled."),
        ("cosyvoice_lb_nginx_requests", counters.requests, "Client requests nginx took."),
    ):
        out.append(CounterMetricFamily(name, what, value=value))
    return out


class ViewCollector(Collector):
    """A prometheus_client collector that gathers a view at each scrape."""

    def __init__(self, gather: Callable[[], ClusterView]):
        self.gather = gather

    def collect(self) -> Iterator[Family]:
        yield from families(self.gather())
