"""Routing by work on a real cluster (supervisord, nginx, instances of the simulated engine,
4 ms per character): a busy instance declines what another would start sooner, nginx
tries that one; a request every instance declines is served by the last resort; the
routing switches live, with no instance restarted; and the benchmark takes down what it
started when it is stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests
from conftest import ROOT, cli, free_port_block, status, wait_for

from cosyvoice_lb.instance.routing.board import Board
from cosyvoice_lb.launcher.state.layout import Layout

LONG = "a" * 480  # 1.9 s on one instance (under --max-chars: one synthesis, not segments)
SHORT = "a" * 10  # 40 ms


def up(state_dir: Path, port: int, base: int, *extra: str) -> None:
    cli(
        "up",
        "--engine",
        "simulated",
        "--simulated-ms-per-char",
        "4",
        "--max-queue",
        "16",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        "--probe-interval",
        "0.5",
        *extra,
        timeout=300,
        check=True,
    )


def routing(port: int) -> dict:
    return requests.get(f"http://127.0.0.1:{port}/ping", timeout=5).json()["routing"]


def hold(url: str, ports: list[int]) -> list[threading.Thread]:
    """A long synthesis on each instance of ``ports`` (sent straight to it), running on return."""
    threads = [
        threading.Thread(
            target=requests.post, args=(f"http://127.0.0.1:{p}/v1/tts",), kwargs={"json": {"text": LONG}, "timeout": 30}
        )
        for p in ports
    ]
    for t in threads:
        t.start()
    assert wait_for(
        lambda: all(requests.get(f"http://127.0.0.1:{p}/ping", timeout=5).json()["inflight"] for p in ports), 10, 0.02
    )
    return threads


def shorts(url: str, count: int) -> list[requests.Response]:
    """``count`` short requests at once through nginx."""
    answers: list[requests.Response] = []
    lock = threading.Lock()

    def one() -> None:
        r = requests.post(url + "/v1/tts", json={"text": SHORT}, timeout=30)
        with lock:
            answers.append(r)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return answers


def serving(state_dir: Path, count: int) -> list[int]:
    """The slots the board shows ready and in rotation, once there are ``count`` ([] before)."""
    board = Board.open(Layout(state_dir).routing_board)
    if board is None:
        return []
    found = [slot for slot in range(8) if board.row(slot)[3] and board.row(slot)[4]]
    board.close()
    return found if len(found) == count else []


def test_a_busy_instance_declines_and_a_request_every_instance_declines_is_served(state_dir):
    port, base = free_port_block(1), free_port_block(3)
    url = f"http://127.0.0.1:{port}"
    up(state_dir, port, base, "--instances", "2", "--spares", "1")
    try:
        # (the first two ready serve, the third is the spare: which is which varies)
        a, b = wait_for(lambda: serving(state_dir, 2), 20, 0.2) or pytest.fail("the loop never marked the rotation")
        spare = ({0, 1, 2} - {a, b}).pop()
        busy, free = base + a, base + b
        board = Board.open(Layout(state_dir).routing_board)
        assert board is not None and wait_for(lambda: board.work()[0], 10, 0.1)  # on once nginx has the last resort
        assert routing(busy)["seconds_per_char"] == 0  # (not from the warm-up: it would skew it)
        for p in (busy, free, base + spare):  # each learns its seconds per character
            requests.post(f"http://127.0.0.1:{p}/v1/tts", json={"text": SHORT}, timeout=30).raise_for_status()
        assert routing(busy)["seconds_per_char"] == pytest.approx(0.004, rel=0.25)

        # 1. one instance holds 1.9 s of work: the shorts all go to the other, those nginx sent
        # to the busy one first (least connections) declined by it and tried on the other
        held = hold(url, [busy])
        answers = shorts(url, 6)
        assert [r.status_code for r in answers] == [200] * 6
        assert {r.headers["X-Instance-Port"] for r in answers} == {str(free)}
        for t in held:
            t.join(30)
        # (the long one went straight to the instance: nginx counts no connection there and
        # sends about half of the shorts to it first)
        declined = routing(busy)["declined"]
        log = (state_dir / "logs" / "nginx-access.log").read_text()
        assert declined >= 1
        assert log.count(f"upstream=127.0.0.1:{busy}, 127.0.0.1:{free} us=503, 200") == declined
        api = [line for line in log.splitlines() if "POST /v1/tts" in line]
        assert not [line for line in api if "overflow.sock" in line]  # no last resort was needed

        # 2. the board says the spare (ready, idle, not in nginx's rotation) is in rotation,
        # as a stale board would: both busy instances decline for it, nginx has no one left
        # to try, and its last resort sends each request on marked "last": all served
        board.set_rotation([a, b, spare])
        held = hold(url, [busy, free])
        answers = shorts(url, 4)
        assert [r.status_code for r in answers] == [200] * 4
        for t in held:
            t.join(30)
        assert routing(busy)["last_resort"] + routing(free)["last_resort"] == 4
        assert (state_dir / "logs" / "nginx-access.log").read_text().count("overflow.sock us=503, 503, 200") == 4
        board.set_rotation([a, b])

        # 3. nginx killed outright leaves its last resort's socket behind: supervisord's
        # restart clears it and binds again (nginx cannot bind a unix socket that exists)
        nginx = next(
            p
            for p in psutil.process_iter(["cmdline"])
            if str(state_dir / "nginx" / "nginx.conf") in " ".join(p.info["cmdline"] or [])
            and "master" in " ".join(p.info["cmdline"] or [])
        )
        nginx.kill()
        assert (state_dir / "run" / "overflow.sock").exists()

        def serving_again() -> bool:
            try:
                return requests.post(url + "/v1/tts", json={"text": SHORT}, timeout=5).status_code == 200
            except requests.RequestException:
                return False

        assert wait_for(serving_again, 60, 0.5), "nginx never served again after a SIGKILL"

        # 4. --routing least-conn, live: nginx and the board change, no instance restarts,
        # and a busy instance takes what least connections sends it
        pids = {i["name"]: i["pid"] for i in status(state_dir)[1]["instances"]}
        up(state_dir, port, base, "--instances", "2", "--spares", "1", "--routing", "least-conn")
        assert {i["name"]: i["pid"] for i in status(state_dir)[1]["instances"]} == pids
        assert Board.open(Layout(state_dir).routing_board).work() == (False, 0.05)  # type: ignore[union-attr]
        assert "backup" not in (state_dir / "nginx" / "upstreams.conf").read_text()
        before = routing(busy)["declined"]
        held = hold(url, [busy])
        answers = shorts(url, 6)
        assert [r.status_code for r in answers] == [200] * 6
        assert routing(busy)["declined"] == before
        assert str(busy) in {r.headers["X-Instance-Port"] for r in answers}  # queued behind the long one
        for t in held:
            t.join(30)
    finally:
        cli("down", "--state-dir", str(state_dir), timeout=120)


BENCHES = {  # script, its arguments, what it says with its state dir, what it says once its cluster serves
    "run": ("run.py", ["--quick"], "cluster state dir ", "overhead: direct"),
    "chaos": (
        "chaos.py",
        ["--only", "kill-instance", "--instances", "2", "--clients", "2"],
        "starting the cluster in ",
        "load on",
    ),
}


@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_a_benchmark_takes_its_cluster_down_when_stopped(tmp_path, bench):
    """`timeout 60 python bench/run.py --quick`, or Ctrl-C: whatever it started goes."""
    script, args, says_state, says_serving = BENCHES[bench]
    for sig in (signal.SIGTERM, signal.SIGINT):
        process = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "bench" / script),
                *args,
                *(["--out", str(tmp_path)] if bench == "run" else []),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(ROOT),
            # (a background shell starts its jobs with SIGINT ignored: Ctrl-C must reach it)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        state = None
        deadline = time.monotonic() + 120
        assert process.stderr is not None
        for line in process.stderr:
            if says_state in line:
                state = line.split(says_state, 1)[1].split()[0]
            if says_serving in line or time.monotonic() > deadline:
                break
        assert state, f"bench/{script} never said where its cluster is"
        process.send_signal(sig)
        try:
            process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        assert process.returncode != 0  # interrupted, not a finished run
        left = [p for p in psutil.process_iter(["cmdline"]) if state in " ".join(p.info["cmdline"] or [])]
        assert left == [], [p.info["cmdline"] for p in left]
        assert not os.path.exists(state)
