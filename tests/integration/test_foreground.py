"""`up --foreground`, as Kubernetes runs it (the pod's main process), on a real cluster of
two simulated instances: SIGTERM drains the requests in flight and stops everything, exit 0;
a cluster that cannot start, or a supervisord that dies, is a non-zero exit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests
from conftest import ROOT, clean_env, cli, free_port_block, port_free

from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.processes import stray_processes

pytestmark = pytest.mark.integration

TEXT = "Forty characters of text, 1.6 s of work."  # 40 characters at 40 ms each
assert len(TEXT) == 40
REQUESTS = 4  # two instances, two syntheses each at once (--instance-concurrency 2): all in flight


class Launcher:
    """``cosyvoice-lb up --foreground ...`` as a subprocess, its output in files."""

    def __init__(self, state_dir: Path, *extra: str, port: int = 0):
        self.state_dir = state_dir
        self.port, self.base = port or free_port_block(1), free_port_block(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.out, self.err = state_dir.parent / f"{state_dir.name}.out", state_dir.parent / f"{state_dir.name}.err"
        args = [
            "up",
            "--foreground",
            "--instances",
            "2",
            "--engine",
            "simulated",
            "--simulated-ms-per-char",
            "40",
            "--instance-concurrency",
            "2",
            "--drain-timeout",
            "20",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--base-port",
            str(self.base),
            "--state-dir",
            str(state_dir),
            *extra,
        ]
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cosyvoice_lb.launcher.cli", *args],
                stdout=out,
                stderr=err,
                env=clean_env(),
                cwd=str(ROOT),
            )

    def output(self) -> tuple[str, str]:
        return self.out.read_text(), self.err.read_text()

    def wait_serving(self, session: requests.Session, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the launcher exited {self.proc.returncode}: {self.output()}"
            # (nginx answers once one instance is ready; `up` waits for all of them)
            if "running in the foreground" in self.output()[0]:
                try:
                    if session.get(self.url + "/ping", timeout=2).status_code == 200:
                        return
                except requests.RequestException:
                    pass
            time.sleep(0.2)
        raise AssertionError(f"not serving within {timeout}s: {self.output()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        cli("down", "--state-dir", str(self.state_dir), timeout=120)
        for path in (self.out, self.err):
            path.unlink(missing_ok=True)


def cluster_processes(state_dir: Path) -> list[psutil.Process]:
    """Any process naming the state dir in its command line (as test_up_errors checks)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(state_dir) in part for part in (proc.info["cmdline"] or [])) and proc.pid != os.getpid():
                found.append(proc)
        except psutil.Error:
            pass
    return found


def nothing_left(launcher: Launcher) -> None:
    layout = Layout(launcher.state_dir)
    assert stray_processes(layout, launcher.port) == []
    assert [p for p in cluster_processes(launcher.state_dir) if p.pid != launcher.proc.pid] == []
    assert port_free(launcher.port) and port_free(launcher.base) and port_free(launcher.base + 1)
    assert not layout.socket.exists()


def inflight(session: requests.Session, base: int) -> int:
    total = 0
    for port in (base, base + 1):
        try:
            total += int(session.get(f"http://127.0.0.1:{port}/ping", timeout=2).json().get("inflight", 0))
        except (requests.RequestException, ValueError):
            pass
    return total


def test_sigterm_drains_the_requests_in_flight_and_stops_everything(state_dir):
    launcher = Launcher(state_dir)
    session = requests.Session()
    session.trust_env = False
    try:
        launcher.wait_serving(session)
        results: list[tuple[int, str, int, float]] = []
        lock = threading.Lock()

        def one() -> None:
            client = requests.Session()
            client.trust_env = False
            started = time.monotonic()
            try:
                r = client.post(launcher.url + "/v1/tts", json={"text": TEXT}, timeout=60)
                outcome = (r.status_code, r.headers.get("content-type", ""), len(r.content))
            except requests.RequestException as exc:
                outcome = (0, repr(exc), 0)
            with lock:
                results.append((*outcome, time.monotonic() - started))

        threads = [threading.Thread(target=one, daemon=True) for _ in range(REQUESTS)]
        for t in threads:
            t.start()
        deadline, seen = time.monotonic() + 5, 0
        while time.monotonic() < deadline and seen < REQUESTS:
            seen = inflight(session, launcher.base)
            time.sleep(0.02)
        assert seen > 0, "no request in flight to drain"
        terminated = time.monotonic()
        launcher.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        launcher.proc.send_signal(signal.SIGTERM)  # a second one while it drains: must not cut the drain
        code = launcher.proc.wait(timeout=120)
        stopped_in = time.monotonic() - terminated
        for t in threads:
            t.join(timeout=60)
        out, err = launcher.output()
        print(
            f"\nforeground drain: {seen} request(s) in flight at SIGTERM, launcher exited {code} "
            f"{stopped_in:.1f}s after it; requests: "
            + ", ".join(f"{status} in {took:.1f}s" for status, _, _, took in sorted(results, key=lambda r: r[3]))
        )
        print("launcher stdout (last lines):\n  " + "\n  ".join(out.strip().splitlines()[-3:]))
        print("launcher stderr (last lines):\n  " + "\n  ".join(err.strip().splitlines()[-3:]))
        assert code == 0, (out, err)
        assert len(results) == REQUESTS
        assert all(status == 200 and kind == "audio/wav" and size > 44 for status, kind, size, _ in results), results
        assert "running in the foreground: SIGTERM drains and stops it" in out
        assert "drained and stopped" in out and "cosyvoice-lb is up: 2 instance(s) ready" in out
        assert "SIGTERM again: still draining" in err
        for name in ("instance-0", "instance-1"):
            assert "stopping: draining" in (state_dir / "logs" / f"{name}.log").read_text()
        nothing_left(launcher)
    finally:
        launcher.close()


def test_a_cluster_that_cannot_start_exits_non_zero_at_once(state_dir):
    port = free_port_block(1)
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", port))
        holder.listen()
        launcher = Launcher(state_dir, port=port)
        try:
            started = time.monotonic()
            code = launcher.proc.wait(timeout=60)
            out, err = launcher.output()
            print(f"\nforeground with its port taken: exit {code} after {time.monotonic() - started:.1f}s")
            assert code != 0, (out, err)
            assert f"public port {port} on 127.0.0.1 is not free" in err
            assert "running in the foreground" not in out
            assert cluster_processes(state_dir) == [] and not Layout(state_dir).socket.exists()
        finally:
            launcher.close()


def test_a_supervisord_that_dies_ends_the_foreground_with_an_error_and_nothing_left(state_dir):
    launcher = Launcher(state_dir)
    session = requests.Session()
    session.trust_env = False
    try:
        launcher.wait_serving(session)
        supervisord = int((state_dir / "run/supervisord.pid").read_text())
        killed = time.monotonic()
        os.kill(supervisord, signal.SIGKILL)
        code = launcher.proc.wait(timeout=60)
        out, err = launcher.output()
        print(
            f"\nsupervisord killed: the launcher exited {code} {time.monotonic() - killed:.1f}s later: "
            f"{err.strip().splitlines()[-1]}"
        )
        assert code == 1, (out, err)
        assert "supervisord went away" in err and "stopped what was left of the cluster" in err
        assert "drained and stopped" not in out
        nothing_left(launcher)
    finally:
        launcher.close()
