"""The cluster's metrics (cosyvoice_lb/launcher/panel/metrics.py): families from a view of the
cluster, GPUs present only with a GPU, nginx's stub_status read, names passing promtool."""

from __future__ import annotations

import subprocess

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cosyvoice_lb.launcher.cluster.status import ClusterStatus, InstanceStatus
from cosyvoice_lb.launcher.health.rules import RESTART_REASONS
from cosyvoice_lb.launcher.panel.metrics import ClusterView, NginxCounters, ViewCollector, parse_stub_status
from cosyvoice_lb.launcher.plan.gpu import GpuReading
from cosyvoice_lb.launcher.state.health_report import HealthReport, Track

STUB = "Active connections: 3 \nserver accepts handled requests\n 120 119 4567 \nReading: 0 Writing: 2 Waiting: 1 \n"
H100 = GpuReading(0, "NVIDIA H100 80GB HBM3", "GPU-8932f937", 20 * 2**30, 80 * 2**30, 0.37, 54.0, 312.0)
MIG = GpuReading(1, "NVIDIA A100 MIG", "GPU-1111", 2**30, 40 * 2**30, None, 41.0, None)


def view(gpus=(), nginx: NginxCounters | None = None, drained: bool = False) -> ClusterView:
    instances = [
        InstanceStatus(
            "instance-0",
            7860,
            0 if gpus else None,
            4242,
            "RUNNING",
            True,
            True,
            2,
            61.0,
            inflight=1,
            waiting=2,
            gpu_memory=4 * 2**30 if gpus else 0,
        ),
        InstanceStatus("instance-1", 7861, 1 if gpus else None, 0, "BACKOFF", False, False, 0, 0.0, drained=drained),
    ]
    report = HealthReport(
        updated=990.0,
        tracks={"instance-0": Track(ordered={"hang": 1}, crashes=1), "instance-1": Track()},
        probe_seconds={"instance-0": 0.004},
    )
    return ClusterView(
        status=ClusterStatus(running=True, instances=instances, gpus=list(gpus)),
        planned=2,
        report=report,
        memory={"instance-0": 300 * 2**20},
        nginx=nginx,
        now=1000.0,
    )


def scrape(v: ClusterView) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ViewCollector(lambda: v))
    return generate_latest(registry).decode()


def samples(v: ClusterView) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(scrape(v))
        for s in family.samples
    }


def test_stub_status_is_read():
    assert parse_stub_status(STUB) == NginxCounters(3, 120, 119, 4567, 0, 2, 1)
    assert parse_stub_status("<html>not it</html>") is None


def test_instances_restarts_and_the_health_loop():
    found = samples(view())
    assert found[("cosyvoice_lb_instances", ())] == 2
    assert found[("cosyvoice_lb_instance_up", (("name", "instance-0"),))] == 1
    assert found[("cosyvoice_lb_instance_up", (("name", "instance-1"),))] == 0
    assert found[("cosyvoice_lb_instance_ready", (("name", "instance-1"),))] == 0
    assert found[("cosyvoice_lb_instance_memory_bytes", (("name", "instance-0"),))] == 300 * 2**20
    assert found[("cosyvoice_lb_instance_in_flight", (("name", "instance-0"),))] == 1
    assert found[("cosyvoice_lb_instance_queue_depth", (("name", "instance-0"),))] == 2  # (the HPA's, per pod)
    # the hang the loop ordered, and the crash it counted
    restarts = {
        dict(labels)["reason"]: value
        for (name, labels), value in found.items()
        if name == "cosyvoice_lb_instance_restarts_total" and dict(labels)["name"] == "instance-0"
    }
    assert restarts == {**{r: 0 for r in RESTART_REASONS}, "hang": 1, "crash": 1}
    assert found[("cosyvoice_lb_probe_duration_seconds", (("name", "instance-0"),))] == 0.004
    assert ("cosyvoice_lb_probe_duration_seconds", (("name", "instance-1"),)) not in found  # never probed
    assert found[("cosyvoice_lb_health_report_age_seconds", ())] == 10.0


def test_a_drained_instance_says_so():
    assert samples(view(drained=True))[("cosyvoice_lb_instance_drained", (("name", "instance-1"),))] == 1


def test_the_pool_says_how_many_are_wanted_and_each_role():
    v = view()
    v.status.pool = {"wanted": 3, "surge": 1, "in_rotation": 4, "spares": 1, "parked": 2}
    found = samples(v)
    assert found[("cosyvoice_lb_instances_wanted", ())] == 4  # a roll-out's surge included
    roles = {
        dict(labels)["role"]: value
        for (name, labels), value in found.items()
        if name == "cosyvoice_lb_instances_by_role"
    }
    assert roles == {"in_rotation": 4, "spare": 1, "parked": 2}
    assert "cosyvoice_lb_instances_wanted" not in scrape(view())  # (no pool read: nothing said)


def test_without_a_gpu_the_gpu_families_are_absent_not_zero():
    text = scrape(view())
    assert "cosyvoice_lb_gpu" not in text and "gpu_memory" not in text


def test_gpus_and_their_readings_when_the_card_has_them():
    found = samples(view(gpus=(H100, MIG)))
    assert found[("cosyvoice_lb_gpu_memory_used_bytes", (("gpu", "0"),))] == 20 * 2**30
    assert found[("cosyvoice_lb_gpu_memory_total_bytes", (("gpu", "1"),))] == 40 * 2**30
    assert found[("cosyvoice_lb_gpu_utilization_ratio", (("gpu", "0"),))] == 0.37
    assert found[("cosyvoice_lb_gpu_power_watts", (("gpu", "0"),))] == 312
    assert ("cosyvoice_lb_gpu_power_watts", (("gpu", "1"),)) not in found  # not supported: left out
    assert found[("cosyvoice_lb_gpu_temperature_celsius", (("gpu", "1"),))] == 41
    assert found[("cosyvoice_lb_gpu_info", (("gpu", "0"), ("model", H100.name), ("uuid", H100.uuid)))] == 1
    assert found[("cosyvoice_lb_instance_gpu_memory_bytes", (("gpu", "0"), ("name", "instance-0")))] == 4 * 2**30


def test_nginx_counters_and_nginx_down():
    found = samples(view(nginx=parse_stub_status(STUB)))
    assert found[("cosyvoice_lb_nginx_up", ())] == 1
    assert found[("cosyvoice_lb_nginx_connections", (("state", "writing"),))] == 2
    assert found[("cosyvoice_lb_nginx_requests_total", ())] == 4567
    down = samples(view(nginx=None))
    assert down[("cosyvoice_lb_nginx_up", ())] == 0 and ("cosyvoice_lb_nginx_requests_total", ()) not in down


def test_names_and_units_pass_promtools_lint(promtool):
    text = scrape(view(gpus=(H100, MIG), nginx=parse_stub_status(STUB)))
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
