"""The MPS daemon wrapper, run for real against a contract fake of nvidia-cuda-mps-control.

The fake does what the real binary does at the boundary the wrapper uses: ``-f`` runs the
daemon in the foreground until a ``quit`` reaches it through the pipe dir; no arguments is
the client, which reads commands on stdin and talks to the daemon through that same dir.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from conftest import ROOT

from cosyvoice_lb.launcher.cluster import mps
from cosyvoice_lb.launcher.plan import mps_env

FAKE = """
import json, os, sys, time

MODE = {mode!r}
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
quit_file = os.path.join(pipe, "quit")


def wait_for_quit(limit):
    deadline = time.monotonic() + limit  # bounded: a broken test never leaves it behind for long
    while time.monotonic() < deadline:
        if os.path.exists(quit_file) and MODE != "ignore-quit":
            return True
        time.sleep(0.02)
    return False


if sys.argv[1:] == ["-f"]:
    seen = {{k: os.environ.get(k) for k in (
        "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY",
        "MPS_TEST_INHERITED")}}
    with open(os.path.join(pipe, "daemon.tmp"), "w") as f:
        json.dump({{"pid": os.getpid(), "env": seen}}, f)
    os.replace(os.path.join(pipe, "daemon.tmp"), os.path.join(pipe, "daemon.json"))
    if MODE == "crash":
        time.sleep(0.2)
        sys.exit(3)
    sys.exit(0 if wait_for_quit(60) else 9)
elif not sys.argv[1:]:
    with open(os.path.join(pipe, "client.pid"), "w") as f:
        f.write(str(os.getpid()))
    if MODE == "hang-client":
        time.sleep(60)
        sys.exit(9)
    if sys.stdin.read().strip() == "quit":
        open(quit_file, "w").close()
    sys.exit(0)
sys.exit(2)
"""


def fake_control(tmp_path: Path, mode: str = "normal") -> Path:
    path = tmp_path / f"fake-mps-control-{mode}"
    path.write_text(f"#!{sys.executable}\n" + FAKE.format(mode=mode))
    path.chmod(0o755)
    return path


def wait_until(what: str, predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.02)


class Wrapper:
    """``python -m cosyvoice_lb.launcher.cluster.mps`` with a fake control binary, in tmp_path."""

    def __init__(self, tmp_path: Path, mode: str = "normal", stop_timeout: float = 10.0) -> None:
        self.pipe = tmp_path / "state" / "run" / "mps-gpu1"
        self.logs = tmp_path / "state" / "logs" / "mps-gpu1"
        env = {**os.environ, "MPS_TEST_INHERITED": "yes", "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "cosyvoice_lb.launcher.cluster.mps", "--gpu", "1", "--pipe-dir", str(self.pipe),
                   "--log-dir", str(self.logs), "--control", str(fake_control(tmp_path, mode)),
                   "--stop-timeout", str(stop_timeout)]  # fmt: skip
        self.process = subprocess.Popen(command, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)  # fmt: skip

    def daemon(self) -> dict:
        """What the fake daemon recorded, once it is up."""
        state = self.pipe / "daemon.json"
        wait_until("the fake daemon is up", state.exists)
        return json.loads(state.read_text())

    def finish(self, timeout: float = 20.0) -> tuple[int, str]:
        """The wrapper's exit status and everything it printed, within ``timeout``."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the wrapper did not exit within {timeout}s:\n{self.kill()}") from None
        try:
            out, _ = self.process.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # its stdout is still open: a child outlived it
            raise AssertionError(f"a child of the wrapper outlived it:\n{self.kill()}") from None
        return self.process.returncode, out

    def fake_pids(self) -> list[int]:
        pids = []
        if (self.pipe / "daemon.json").exists():
            pids.append(json.loads((self.pipe / "daemon.json").read_text())["pid"])
        if (self.pipe / "client.pid").exists():
            pids.append(int((self.pipe / "client.pid").read_text()))
        return pids

    def kill(self) -> str:
        """Kill whatever is left (the fakes first: they hold the wrapper's stdout); what it printed."""
        for pid in self.fake_pids():
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        self.process.kill()
        try:
            return self.process.communicate(timeout=10)[0] or ""
        except (subprocess.TimeoutExpired, ValueError):  # ValueError: its output was read already
            return ""


@pytest.fixture
def wrappers(tmp_path: Path):
    started: list[Wrapper] = []

    def start(mode: str = "normal", stop_timeout: float = 10.0) -> Wrapper:
        started.append(Wrapper(tmp_path, mode, stop_timeout))
        return started[-1]

    yield start
    for wrapper in started:
        wrapper.kill()


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stop_sends_quit_and_exits_0_with_nothing_left(wrappers, signum: signal.Signals) -> None:
    wrapper = wrappers()
    daemon = wrapper.daemon()
    assert daemon["env"] == {
        "CUDA_VISIBLE_DEVICES": "1",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_MPS_PIPE_DIRECTORY": str(wrapper.pipe),
        "CUDA_MPS_LOG_DIRECTORY": str(wrapper.logs),
        "MPS_TEST_INHERITED": "yes",
    }
    for path in (wrapper.pipe, wrapper.logs, wrapper.pipe.parent, wrapper.logs.parent, wrapper.pipe.parent.parent):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert psutil.Process(daemon["pid"]).ppid() == wrapper.process.pid

    wrapper.process.send_signal(signum)
    code, out = wrapper.finish()

    assert code == 0, out
    assert (wrapper.pipe / "quit").exists(), "quit never reached the daemon"
    assert gone(daemon["pid"]), "the daemon outlived the wrapper"
    assert gone(int((wrapper.pipe / "client.pid").read_text()))
    assert f"started: daemon pid {daemon['pid']}, gpu 1, pipe dir {wrapper.pipe}" in out
    assert f"stop asked ({signum.name})" in out
    assert "stopped: the daemon" in out
    assert "MPS_TEST_INHERITED" not in out  # no environment dumps


def test_a_daemon_that_ignores_quit_is_killed_after_the_stop_timeout(wrappers) -> None:
    wrapper = wrappers("ignore-quit", stop_timeout=0.5)
    daemon = wrapper.daemon()
    asked = time.monotonic()
    wrapper.process.send_signal(signal.SIGTERM)
    code, out = wrapper.finish()

    assert code == 1, out
    assert 0.5 <= time.monotonic() - asked < 10, out
    assert (wrapper.pipe / "quit").exists(), "quit was not even sent"
    assert "killed: the daemon" in out
    assert gone(daemon["pid"])


def test_a_quit_client_that_hangs_is_bounded_and_the_daemon_killed(wrappers) -> None:
    wrapper = wrappers("hang-client", stop_timeout=0.5)
    daemon = wrapper.daemon()
    wrapper.process.send_signal(signal.SIGTERM)
    code, out = wrapper.finish(timeout=15)

    assert code == 1, out
    assert "did not take quit within 0.5s" in out
    assert "killed: the daemon" in out
    assert gone(daemon["pid"])
    wait_until("the client file", (wrapper.pipe / "client.pid").exists)
    assert gone(int((wrapper.pipe / "client.pid").read_text())), "the hung quit client was left running"


def test_a_daemon_that_dies_by_itself_ends_the_wrapper_with_its_status(wrappers) -> None:
    wrapper = wrappers("crash")
    daemon = wrapper.daemon()
    code, out = wrapper.finish()

    assert code == 3, out
    assert f"daemon (pid {daemon['pid']}) exited on its own with status 3" in out
    assert not (wrapper.pipe / "quit").exists()
    assert gone(daemon["pid"])


def test_a_missing_control_binary_fails_with_what_is_missing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cosyvoice_lb.launcher.cluster.mps", "--gpu", "0", "--pipe-dir", str(tmp_path / "p"),
         "--log-dir", str(tmp_path / "l"), "--control", str(tmp_path / "no-such-control")],
        capture_output=True, text=True, timeout=30, cwd=str(ROOT),
    )  # fmt: skip
    assert done.returncode == 127, done
    assert f"cannot start {tmp_path / 'no-such-control'} -f" in done.stdout
    assert "--mps needs" in done.stdout  # no driver here, or no such binary: either says what to do


def test_importing_it_installs_no_signal_handler() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import signal, cosyvoice_lb.launcher.cluster.mps; print(signal.getsignal(signal.SIGTERM))"],
        capture_output=True, text=True, timeout=30, cwd=str(ROOT),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(signal.SIG_DFL)


def test_client_env() -> None:
    assert mps_env.client_env("/s/run/mps-gpu0", "/s/logs/mps-gpu0") == {
        "CUDA_MPS_PIPE_DIRECTORY": "/s/run/mps-gpu0",
        "CUDA_MPS_LOG_DIRECTORY": "/s/logs/mps-gpu0",
    }
    assert mps_env.client_env("/p", "/l", 40) == {
        "CUDA_MPS_PIPE_DIRECTORY": "/p",
        "CUDA_MPS_LOG_DIRECTORY": "/l",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
    }
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in mps_env.client_env("/p", "/l", 0)


def test_daemon_env() -> None:
    assert mps_env.daemon_env(3, "/p", "/l") == {
        "CUDA_VISIBLE_DEVICES": "3",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_MPS_PIPE_DIRECTORY": "/p",
        "CUDA_MPS_LOG_DIRECTORY": "/l",
    }


DRIVER = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023"


def test_mps_problem_without_a_driver_says_so_first() -> None:
    problem = mps_env.mps_problem(which=lambda name: f"/usr/bin/{name}", driver=lambda: "")
    assert problem.startswith("--mps needs the NVIDIA driver: /proc/driver/nvidia/version is missing")
    assert problem.endswith("drop --mps")
    assert mps_env.mps_problem(which=lambda name: None, driver=lambda: "") == problem


def test_mps_problem_without_the_control_binary_names_the_package() -> None:
    asked: list[str] = []

    def which(name: str) -> str | None:
        asked.append(name)
        return None

    problem = mps_env.mps_problem(which=which, driver=lambda: DRIVER)
    assert asked == ["nvidia-cuda-mps-control"]
    assert problem == (
        "--mps needs nvidia-cuda-mps-control (part of the NVIDIA driver utilities, e.g. Debian/Ubuntu package "
        "nvidia-compute-utils-535) on PATH; install it or drop --mps"
    )
    other = mps_env.mps_problem("/opt/nv/mps-control", which=lambda name: None, driver=lambda: "NVRM version: odd")
    assert other.startswith("--mps needs /opt/nv/mps-control (")
    assert "nvidia-compute-utils-<version>" in other


def test_mps_problem_is_empty_when_everything_is_there() -> None:
    assert mps_env.mps_problem(which=lambda name: f"/usr/bin/{name}", driver=lambda: DRIVER) == ""


def test_nvidia_driver_reads_the_first_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    version = tmp_path / "version"
    version.write_text(DRIVER + "\nGCC version:  gcc version 12.2.0\n")
    monkeypatch.setattr(mps_env, "DRIVER_VERSION", version)
    assert mps_env.nvidia_driver() == DRIVER
    monkeypatch.setattr(mps_env, "DRIVER_VERSION", tmp_path / "absent")
    assert mps_env.nvidia_driver() == ""


def test_private_dir_tightens_a_dir_that_was_already_there(tmp_path: Path) -> None:
    existing = tmp_path / "run" / "mps-gpu0"
    existing.mkdir(parents=True)
    for path in (tmp_path / "run", existing):
        path.chmod(0o755)
    mps.private_dir(existing)
    mps.private_dir(tmp_path / "new" / "deeper" / "mps-gpu0")
    assert stat.S_IMODE(existing.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o755  # an existing parent is not ours to change
    for path in (tmp_path / "new", tmp_path / "new" / "deeper", tmp_path / "new" / "deeper" / "mps-gpu0"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
