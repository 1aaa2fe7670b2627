"""`status` (cosyvoice_lb/launcher/cluster/status.py): what it asks of the instances and nginx, and how."""

from __future__ import annotations

import io
import json
import threading
import time

import pytest
from rich.console import Console

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.cluster.status import (
    NO_TELEMETRY,
    ClusterStatus,
    InstanceStatus,
    Telemetry,
    ask_all,
    public_url,
    status,
)
from cosyvoice_lb.launcher.plan.gpu import GpuReading
from cosyvoice_lb.launcher.plan.planner import Roles, Slot
from cosyvoice_lb.launcher.state.health_report import HealthReport, OnPurpose, Track, write_report
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.record import ClusterRecord
from cosyvoice_lb.launcher.state.supervision import ProcessInfo


class Gathering:
    """A prober whose every call waits until all expected calls are under way at once: asked
    one after another, the first call would wait in vain and the barrier would break."""

    def __init__(self, calls: int):
        self.barrier = threading.Barrier(calls, timeout=5)
        self.asked: list[object] = []

    def ping(self, port: int, timeout: float) -> dict:
        self.asked.append(port)
        self.barrier.wait()
        return {"ready": True, "port": port}

    def get_status(self, url: str, timeout: float) -> int:
        self.asked.append(url)
        self.barrier.wait()
        return 200


def test_status_asks_every_instance_and_nginx_at_once():
    """A race: status pinged the instances one by one, so each stopped one cost a whole probe
    timeout (three stopped instances: three timeouts before `status` or `up` could go on)."""
    slots = [Slot(index=i, port=7860 + i, gpu=None, memory=1) for i in range(5)]
    prober = Gathering(len(slots) + 1)
    bodies, nginx = ask_all(prober, slots, timeout=2.0, url="http://127.0.0.1:8080")  # type: ignore[arg-type]
    assert nginx == 200
    assert bodies == {s.name: {"ready": True, "port": s.port} for s in slots}
    assert sorted(map(str, prober.asked)) == sorted([*(str(s.port) for s in slots), "http://127.0.0.1:8080/ping"])


def test_with_no_instance_running_only_nginx_is_asked():
    prober = Gathering(1)
    assert ask_all(prober, [], timeout=1.0, url="http://127.0.0.1:8080") == ({}, 200)  # type: ignore[arg-type]


def test_public_url_for_any_listen_address():
    assert public_url(Settings(host="0.0.0.0", port=8080)) == "http://127.0.0.1:8080"
    assert public_url(Settings(host="::", port=80)) == "http://[::1]:80"
    assert public_url(Settings(host="fe80::1", port=81)) == "http://[fe80::1]:81"
    assert public_url(Settings(host="203.0.113.5", port=82)) == "http://203.0.113.5:82"


def test_exit_codes():
    serving = InstanceStatus("instance-0", 7860, None, 1, "RUNNING", True, True, 0, 1.0)
    assert serving.serving
    assert ClusterStatus(running=True, instances=[serving]).exit_code == 0
    assert ClusterStatus(running=True, problems=["nginx is fatal"]).exit_code == 1
    assert ClusterStatus(running=False).exit_code == 3


# --- GPUs in the status ---------------------------------------------------------------------

H100 = GpuReading(0, "NVIDIA H100 80GB HBM3", "GPU-aaaa", 20 * 2**30, 80 * 2**30, 0.37, 54.0, 312.5)
A10 = GpuReading(1, "NVIDIA A10", "GPU-bbbb", 2**30, 24 * 2**30, None, 41.0, None)  # no utilisation, no power


class FakeSupervisor:
    """supervisord as ``status`` asks it: two instances on gpu0 and gpu1, nginx, health
    (``PIDS``: the programs it names, running)."""

    PIDS = {"instance-0": 4242, "instance-1": 4343, "nginx": 50, "health": 51}

    def __init__(self, layout, timeout: float = 0.0):
        self.layout = layout

    def processes(self) -> dict[str, ProcessInfo]:
        return {name: ProcessInfo(name, "RUNNING", pid, 1000.0, 1060.0, "", 0) for name, pid in self.PIDS.items()}

    def tail(self, name: str, length: int = 4000) -> str:
        return ""


class Answering:
    def ping(self, port: int, timeout: float) -> dict:
        return {"ready": True}

    def get_status(self, url: str, timeout: float) -> int:
        return 200


TWO_GPUS = (Slot(index=0, port=7860, gpu=0, memory=1), Slot(index=1, port=7861, gpu=1, memory=1))


def running_cluster(monkeypatch, tmp_path, slots=TWO_GPUS, supervisor=FakeSupervisor) -> Layout:
    """A state dir whose supervisord is a fake (no process is started)."""
    from cosyvoice_lb.launcher.cluster import status as status_module

    layout = Layout(tmp_path)
    layout.socket.parent.mkdir(parents=True)
    layout.socket.touch()
    monkeypatch.setattr(
        status_module,
        "read_record",
        lambda layout: ClusterRecord(Settings(port=8080), slots, Roles(serving=len(slots))),
    )
    monkeypatch.setattr(status_module, "Supervisor", supervisor)
    return layout


def test_status_reads_the_gpus_and_each_instances_gpu_memory_from_its_telemetry(monkeypatch, tmp_path):
    layout = running_cluster(monkeypatch, tmp_path)
    asked: list[set[int]] = []

    def process_memory(pids: set[int]) -> dict[int, int]:
        asked.append(pids)
        return {4242: 4 * 2**30, 999: 2**30}  # 999: someone else's process

    telemetry = Telemetry(readings=lambda: (H100, A10), process_memory=process_memory)
    current = status(layout, Answering(), telemetry)  # type: ignore[arg-type]
    assert current.running and current.gpus == [H100, A10]
    assert asked == [{4242, 4343}]  # the instances' pids only
    assert [(i.name, i.gpu_memory) for i in current.instances] == [("instance-0", 4 * 2**30), ("instance-1", 0)]
    as_dict = current.as_dict()
    assert as_dict["gpus"][1] == {
        "index": 1,
        "name": "NVIDIA A10",
        "uuid": "GPU-bbbb",
        "memory_used": 2**30,
        "memory_total": 24 * 2**30,
        "utilization": None,
        "temperature": 41.0,
        "power": None,
    }
    assert as_dict["instances"][0]["gpu_memory"] == 4 * 2**30
    json.dumps(as_dict)  # still JSON


def test_without_a_gpu_the_status_is_as_before(monkeypatch, tmp_path):
    layout = running_cluster(monkeypatch, tmp_path)
    asked: list[set[int]] = []
    telemetry = Telemetry(readings=lambda: (), process_memory=lambda pids: asked.append(pids) or {})
    current = status(layout, Answering(), telemetry)  # type: ignore[arg-type]
    assert current.gpus == [] and [i.gpu_memory for i in current.instances] == [0, 0]
    assert asked == []  # no card: no second NVML session
    assert current.as_dict()["gpus"] == []
    # and the default, the real NVML on this box without a GPU, says the same
    assert status(layout, Answering()).gpus == []  # type: ignore[arg-type]


def test_a_dir_without_a_cluster_has_no_gpus(tmp_path):
    def never() -> tuple[GpuReading, ...]:
        raise AssertionError("not running: nothing to read")

    current = status(Layout(tmp_path), telemetry=Telemetry(readings=never))
    assert not current.running and current.gpus == []


def render(current: ClusterStatus) -> str:
    """What the tables look like, as plain text."""
    from cosyvoice_lb.launcher.views import status_tables

    console = Console(file=io.StringIO(), width=200, color_system=None)
    for table in status_tables(current):
        console.print(table)
    return console.file.getvalue()  # type: ignore[attr-defined]


def fake_status(gpus: list[GpuReading]) -> ClusterStatus:
    instances = [
        InstanceStatus("instance-0", 7860, 0, 4242, "RUNNING", True, True, 0, 61.0, gpu_memory=4_617_089_843),
        InstanceStatus("instance-1", 7861, 1, 4343, "RUNNING", True, True, 2, 5.0),
    ]
    return ClusterStatus(
        running=True,
        url="http://127.0.0.1:8080",
        instances=instances,
        nginx={"state": "RUNNING", "pid": 50, "port": 8080},
        health={"state": "RUNNING", "pid": 51},
        admin={"state": "RUNNING", "pid": 52},
        gpus=gpus,
    )


def test_the_status_tables_show_the_gpus():
    text = render(fake_status([H100, A10]))
    assert "GPU memory" in text and "4.3 GiB" in text  # instance-0's
    row = next(line for line in text.splitlines() if "instance-1" in line)
    assert "—" in row  # NVML knows no memory of it
    assert "GPUs" in text
    h100 = next(line for line in text.splitlines() if "H100" in line)
    for value in ("gpu0", "20.0 GiB / 80.0 GiB (25%)", "37%", "54 °C", "312 W"):
        assert value in h100
    a10 = next(line for line in text.splitlines() if "NVIDIA A10" in line)
    assert "1.0 GiB / 24.0 GiB (4%)" in a10 and "41 °C" in a10 and a10.count("—") == 2


def test_without_gpus_the_status_table_has_no_gpu_columns():
    text = render(fake_status([]))
    assert "instance-0" in text and "nginx" in text
    assert "GPU" not in text and "—" not in text
    from cosyvoice_lb.launcher.views import status_tables

    assert len(status_tables(fake_status([]))) == 1 and len(status_tables(fake_status([H100]))) == 2
    assert status_tables(ClusterStatus(running=False)) == []


def test_the_watch_view_is_the_tables_and_the_words(tmp_path):
    from cosyvoice_lb.launcher.views import status_view

    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(status_view(fake_status([H100]), tmp_path, "every 2s"))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "GPU memory" in text and "H100" in text and "problems:" not in text
    assert text.rstrip().splitlines()[-2:] == ["ok", "every 2s"]
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(status_view(ClusterStatus(running=False, problems=["no cluster runs"]), tmp_path))
    assert console.file.getvalue() == f"not running ({tmp_path})\n"  # type: ignore[attr-defined]


class OneParked(FakeSupervisor):
    """instance-1 stopped on purpose (supervisord keeps its last run's start and stop times)."""

    def processes(self) -> dict[str, ProcessInfo]:
        procs = super().processes()
        procs["instance-1"] = ProcessInfo("instance-1", "STOPPED", 0, 1000.0, 1060.0, "", 0)
        return procs


@pytest.mark.parametrize("wanted, short", [(1, False), (2, True)])
def test_a_parked_slot_is_no_problem_unless_fewer_serve_than_wanted(monkeypatch, tmp_path, wanted, short):
    from cosyvoice_lb.launcher.cluster import status as status_module

    layout = running_cluster(monkeypatch, tmp_path)
    monkeypatch.setattr(status_module, "Supervisor", OneParked)
    tracks = {"instance-0": Track(in_rotation=True, pid=4242), "instance-1": Track(on_purpose=OnPurpose.PARKED)}
    write_report(layout, HealthReport(updated=time.time(), tracks=tracks, pool={"wanted": wanted, "surge": 0}))
    current = status(layout, Answering(), NO_TELEMETRY)  # type: ignore[arg-type]
    parked = current.instance("instance-1")
    assert parked is not None and parked.parked and parked.uptime == 0.0 and parked.reason == OnPurpose.PARKED
    assert current.pool["in_rotation"] == 1 and current.pool["parked"] == 1
    assert not any("instance-1" in p for p in current.problems)
    shortfall = [p for p in current.problems if "in rotation of" in p]
    assert bool(shortfall) is short
    if short:
        assert shortfall == [
            "1 instance(s) in rotation of 2 wanted, and none coming: 'cosyvoice-lb up' with the "
            "cluster's settings starts parked slots"
        ]


def test_the_status_table_shows_bad_audio_once_an_instance_made_some():
    current = fake_status([])
    assert "bad audio" not in render(current)
    current.instances[1].bad_audio = {"non_finite": 3, "silent": 1}
    current.instances[1].bad_audio_restarts = 2
    text = render(current)
    assert "bad audio" in text
    row = next(line for line in text.splitlines() if "instance-1" in line)
    assert "3 non_finite, 1 silent; 2 restart(s)" in row
    assert "—" in next(line for line in text.splitlines() if "instance-0" in line)
