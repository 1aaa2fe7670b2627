"""Operational events clients must not notice, on a real cluster of two espeak instances:
a synthesis stuck while HTTP answers, new settings rolled out under load, the request
time bound, and a crash loop that takes one instance out while the other serves."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import requests
from conftest import Load, cli, free_port_block, status, wait_for

# Long enough that each espeak-ng run takes a moment: a child to catch and stop.
LONG_TEXT = " ".join(["The quick brown fox jumps over the lazy dog near the quiet river bank."] * 6)


@pytest.fixture(scope="module")
def cluster():
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(2)
    args = [
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
    ]
    done = cli("up", *args, "--hang-timeout", "3", timeout=300)
    assert done.returncode == 0, done.stderr
    yield {"state_dir": state_dir, "url": f"http://127.0.0.1:{port}", "args": args, "base": base}
    cli("down", "--state-dir", str(state_dir), timeout=120)
    shutil.rmtree(state_dir, ignore_errors=True)


def instance(state_dir: Path, name: str) -> dict:
    return next(i for i in status(state_dir)[1]["instances"] if i["name"] == name)


def stop_a_synthesis(pid: int, seconds: float = 20) -> psutil.Process:
    """SIGSTOP the espeak-ng child of instance ``pid`` while it synthesizes: the synthesis
    hangs, the instance's HTTP keeps answering."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for child in psutil.Process(pid).children():
            try:
                if child.name() == "espeak-ng":
                    child.send_signal(signal.SIGSTOP)
                    return child
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.005)
    raise AssertionError(f"no espeak-ng child of {pid} seen in {seconds}s")


def kill_quietly(proc: psutil.Process) -> None:
    try:
        proc.kill()
    except psutil.NoSuchProcess:
        pass


def test_a_stuck_synthesis_is_restarted_and_its_request_retried_elsewhere(cluster):
    state_dir = cluster["state_dir"]
    victim = instance(state_dir, "instance-0")
    with Load(cluster["url"], threads=2, limit=2000, seconds=90, text=LONG_TEXT) as load:
        child = stop_a_synthesis(victim["pid"])
        try:
            back = wait_for(
                lambda: (lambda i: i["pid"] != victim["pid"] and i["ready"] and i["in_rotation"])(
                    instance(state_dir, "instance-0")
                ),
                timeout=60,
            )
            # the hung instance's child went with it (it runs in its own session)
            assert wait_for(lambda: not child.is_running(), timeout=5, interval=0.1)
        finally:
            kill_quietly(child)
        time.sleep(1)
    assert back, status(state_dir)[1]
    health = (state_dir / "logs/health.log").read_text()
    assert "instance-0: out of rotation; restarting once nothing in flight makes progress" in health
    assert "a synthesis has made no progress" in health
    print(f"stuck synthesis: {load.ok} ok, {len(load.failures)} failed")
    assert load.failures == [] and load.ok > 5  # the stuck request too: nginx retried it elsewhere


def test_new_settings_roll_out_one_drained_instance_at_a_time_under_load(cluster):
    state_dir = cluster["state_dir"]
    before = {i["name"]: i["pid"] for i in status(state_dir)[1]["instances"]}
    with Load(cluster["url"], threads=2, limit=3000, seconds=120) as load:
        # a new request bound and hang timeout: the instances' command changes
        done = cli("up", *cluster["args"], "--hang-timeout", "30", "--request-timeout", "3", timeout=240)
    assert done.returncode == 0, done.stderr
    code, after = status(state_dir)
    assert code == 0 and all(i["pid"] != before[i["name"]] for i in after["instances"])
    health = (state_dir / "logs/health.log").read_text()
    for name in before:
        log = (state_dir / "logs" / f"{name}.log").read_text()
        assert "stopping: draining 0 synthesis(es) in flight" in log  # out of rotation and idle first
        assert f"{name}: restart requested: out of rotation, replaced by the launcher once idle" in health
    assert "did not take the request" not in done.stderr
    print(f"settings rolled out under load: {load.ok} ok, {len(load.failures)} failed")
    assert load.failures == [] and load.ok > 10


def test_a_request_past_its_time_bound_gets_a_clear_504(cluster):
    state_dir = cluster["state_dir"]  # now: --request-timeout 3, --hang-timeout 30
    victim = instance(state_dir, "instance-1")
    stuck = "no answer within the request timeout (3s): the synthesis is stuck or too long"
    queued = "no engine slot came free within the request timeout"
    with Load(cluster["url"], threads=2, limit=2000, seconds=60, text=LONG_TEXT) as load:
        child = stop_a_synthesis(victim["pid"])
        try:
            started = time.monotonic()
            # the stuck request's answer comes from its instance at the bound
            found = wait_for(lambda: any(stuck in f for f in load.failures), timeout=15, interval=0.1)
            elapsed = time.monotonic() - started
        finally:
            child.send_signal(signal.SIGCONT)  # the synthesis goes on: the instance recovers by itself
    assert found, load.failures
    # requests queued behind it also got their 504 at the bound, never a hang or a bare error
    assert all(f.startswith("504 ") and (stuck in f or queued in f) for f in load.failures), load.failures
    print(
        f"request bound: stuck request answered 504 after {elapsed:.1f}s; {load.ok} ok, "
        f"{len(load.failures)} answered 504"
    )
    assert wait_for(lambda: status(state_dir)[0] == 0, timeout=30)


def test_a_crash_loop_is_given_up_on_and_reported_while_the_rest_serve(cluster):
    state_dir = cluster["state_dir"]
    victim = instance(state_dir, "instance-1")
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(lambda: not psutil.pid_exists(victim["pid"]), timeout=10, interval=0.05)
        squatter.bind(("127.0.0.1", victim["port"]))  # every new start fails to bind its port
        squatter.listen()

        def given_up():
            code, now = status(state_dir)
            failed = next(i for i in now["instances"] if i["name"] == "instance-1")["failed"]
            return (code, now) if failed else None

        found = wait_for(given_up, timeout=90)
        assert found, status(state_dir)[1]
        code, now = found
        item = next(i for i in now["instances"] if i["name"] == "instance-1")
        assert code == 1 and item["failed"].startswith("failed: it ") and "without getting ready" in item["failed"]
        assert any("'cosyvoice-lb restart instance-1'" in p for p in now["problems"])
        text = cli("status", "--state-dir", str(state_dir))
        assert text.returncode == 1 and "address already in use" in text.stdout  # the log tail says why
        starts = (state_dir / "run/instance-1.starts").read_text()
        time.sleep(3)  # it stays stopped: no more starts
        assert (state_dir / "run/instance-1.starts").read_text() == starts
        assert instance(state_dir, "instance-1")["state"] in ("STOPPED", "FATAL")
        for _ in range(5):  # the other one serves
            r = requests.post(cluster["url"] + "/v1/tts", json={"text": "still serving"}, timeout=30)
            assert r.status_code == 200 and r.headers["X-Instance-Port"] == str(cluster["base"])
    finally:
        squatter.close()
    done = cli("restart", "instance-1", "--state-dir", str(state_dir), timeout=120)
    assert done.returncode == 0, done.stderr
    code, now = status(state_dir)
    assert code == 0 and not any(i["failed"] for i in now["instances"]), now
