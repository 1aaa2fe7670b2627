"""Poison requests through the real cluster: a request that kills or hangs whichever instance
runs it costs at most one retry (two instance restarts), then the client gets a clear 422,
and a client that sends it again is refused before it reaches a model."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import requests
from conftest import Load, cli, free_port_block, status, wait_for

INSTANCES = 3


@pytest.fixture(scope="module")
def cluster():
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(INSTANCES)
    done = cli(
        "up",
        "--engine",
        "simulated",
        "--simulated-faults",
        "--simulated-ms-per-char",
        "1",
        "--instances",
        str(INSTANCES),
        "--retries",
        str(INSTANCES),
        "--hang-timeout",
        "2",
        "--probe-interval",
        "0.5",
        "--request-timeout",
        "60",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    yield {"state_dir": state_dir, "url": f"http://127.0.0.1:{port}"}
    cli("down", "--state-dir", str(state_dir), timeout=120)
    shutil.rmtree(state_dir, ignore_errors=True)


def restarts(state_dir: Path) -> int:
    return sum(i["restarts"] for i in status(state_dir)[1]["instances"])


def all_serving(state_dir: Path) -> bool:
    code, body = status(state_dir)
    return code == 0 and all(i["ready"] and i["in_rotation"] for i in body["instances"])


def post(url: str, text: str) -> requests.Response:
    with requests.Session() as session:
        session.trust_env = False
        return session.post(url + "/v1/tts", json={"text": text}, timeout=90)


@pytest.mark.parametrize("text", ["Say CRASH-NOW please.", "Say HANG-NOW please."])
def test_a_poison_request_costs_one_retry_then_a_clear_422(cluster, text):
    state_dir, url = cluster["state_dir"], cluster["url"]
    assert wait_for(lambda: all_serving(state_dir), timeout=60)
    before = restarts(state_dir)
    r = post(url, text)
    assert r.status_code == 422, r.text
    assert "2 instances crashed or hung" in r.json()["error"]["message"]
    assert r.headers["x-should-retry"] == "false"
    assert wait_for(lambda: all_serving(state_dir), timeout=90), "the instances did not all come back"
    assert restarts(state_dir) == before + 2  # the first run and the one retry, no more
    # Sent again (as clients retry): refused before any model runs it.
    again = post(url, text)
    assert again.status_code == 422
    time.sleep(3)  # a death would show as a restart within a probe or two
    assert restarts(state_dir) == before + 2
    assert post(url, "Something harmless.").status_code == 200


def synthesizing(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/ping", timeout=2).json().get("inflight", 0) > 0
    except (requests.RequestException, ValueError):
        return False


def test_unrelated_deaths_with_the_common_text_in_flight_refuse_nothing(cluster):
    """Clients all send one sentence, and instance after instance is SIGKILLed while it
    synthesizes it: each death has that text in flight, none is its fault, and no request of
    it is refused (nginx retries the cut ones; the copies spoken elsewhere clear the deaths)."""
    state_dir, url = cluster["state_dir"], cluster["url"]
    assert wait_for(lambda: all_serving(state_dir), timeout=60)
    before = restarts(state_dir)
    kills = 4
    with Load(url, threads=3, limit=20000, seconds=150, text="Thank you for calling, how can I help you?") as load:
        for n in range(kills):
            assert wait_for(lambda: all_serving(state_dir), timeout=60), "the cluster did not come back"
            target = status(state_dir)[1]["instances"][n % INSTANCES]
            assert wait_for(lambda: synthesizing(target["port"]), timeout=10, interval=0.005)
            os.kill(target["pid"], signal.SIGKILL)
            assert wait_for(lambda: restarts(state_dir) >= before + n + 1, timeout=30)
        assert wait_for(lambda: all_serving(state_dir), timeout=60)
        time.sleep(1)  # requests of the text after the last death
    assert load.failures == [], load.failures[:5]
    assert load.ok > 0
    assert restarts(state_dir) == before + kills  # only the kills: nothing was refused as poison either
