"""`status` (cosyvoice_lb/status.py): what it asks of the instances and nginx, and how."""

from __future__ import annotations

import threading

from cosyvoice_lb.planner import Slot
from cosyvoice_lb.settings import Settings
from cosyvoice_lb.status import ClusterStatus, InstanceStatus, ask_all, public_url


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
