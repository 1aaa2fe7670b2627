"""Recycling under load: drained restarts after --max-requests, one at a time, no failed request."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import requests
from conftest import cli, free_port_block


def test_instances_are_recycled_one_at_a_time_without_losing_a_request():
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(2)
    url = f"http://127.0.0.1:{port}"
    done = cli(
        "up",
        "--engine",
        "espeak",
        "--instances",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        "--max-requests",
        "25",
        "--max-requests-jitter",
        "10",
        timeout=300,
    )
    try:
        assert done.returncode == 0, done.stderr
        ok, failures, pings = 0, [], []
        stop = threading.Event()
        deadline = time.monotonic() + 90

        def load():
            nonlocal ok
            while not stop.is_set() and time.monotonic() < deadline and ok + len(failures) < 3000:
                try:
                    r = requests.post(url + "/v1/tts", json={"text": "recycle me"}, timeout=60)
                    if r.status_code == 200:
                        ok += 1
                    else:
                        failures.append(f"{r.status_code} {r.text[:100]}")
                except requests.RequestException as exc:
                    failures.append(repr(exc))

        def watch():  # one instance always serves: /ping through nginx never says none is ready
            while not stop.is_set() and time.monotonic() < deadline:
                pings.append(requests.get(url + "/ping", timeout=5).status_code)
                time.sleep(0.2)

        threads = [threading.Thread(target=load) for _ in range(3)] + [threading.Thread(target=watch)]
        for t in threads:
            t.start()

        def restarts() -> int:
            return sum(
                max(0, len((state_dir / f"run/instance-{i}.starts").read_text().split("\n")) - 2) for i in (0, 1)
            )

        while restarts() < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(90)
        log = (state_dir / "logs" / "health.log").read_text()
        print(f"recycling: {restarts()} drained restarts, {ok} requests ok, {len(failures)} failed")
        assert restarts() >= 3 and log.count("recycling (drained restart): served") >= 3
        assert failures == [] and ok >= 75
        assert pings and set(pings) == {200}
    finally:
        cli("down", "--state-dir", str(state_dir), timeout=120)
        shutil.rmtree(state_dir, ignore_errors=True)
