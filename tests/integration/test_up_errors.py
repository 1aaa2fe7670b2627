"""`up` refuses clearly and leaves nothing behind when it cannot work."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import psutil
from conftest import ROOT, clean_env, cli, free_port_block, wait_for


def cluster_processes(state_dir) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(state_dir) in part for part in (proc.info["cmdline"] or [])):
            found.append(proc)
    return found


def up(state_dir, port, base, *extra):
    return cli(
        "up",
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
        *extra,
        timeout=240,
    )


def test_public_port_in_use(state_dir):
    port, base = free_port_block(1), free_port_block(2)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        done = up(state_dir, port, base)
    assert done.returncode != 0
    assert f"public port {port} on 127.0.0.1 is not free" in done.stderr and "--port" in done.stderr
    assert not (state_dir / "run/supervisor.sock").exists()


def test_instance_port_in_use(state_dir):
    port, base = free_port_block(1), free_port_block(2)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + 1))
        holder.listen()
        done = up(state_dir, port, base)
    assert done.returncode != 0 and f"instance-1's port {base + 1}" in done.stderr and "--base-port" in done.stderr


def test_nginx_missing(state_dir):
    done = up(state_dir, free_port_block(1), free_port_block(2), "--nginx", "/nonexistent/nginx")
    assert done.returncode != 0
    assert "nginx not found" in done.stderr and "apt-get install -y nginx" in done.stderr


def test_a_python_without_the_instance_packages_is_refused_before_anything_starts(state_dir, tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    done = up(state_dir, free_port_block(1), free_port_block(2), "--python", str(bare / "bin/python"))
    assert done.returncode != 0
    assert "lacks numpy" in done.stderr and "pypinyin" in done.stderr and "-m pip install" in done.stderr
    assert cluster_processes(state_dir) == [] and not (state_dir / "run/supervisor.sock").exists()


def test_instance_that_dies_after_starting_is_reported_quickly(state_dir, tmp_path):
    # The instance imports fine, then its engine cannot find espeak-ng and it exits;
    # supervisord restarts it forever, so `up` must notice the loop itself.
    wrapper = tmp_path / "python-without-espeak"
    wrapper.write_text(f'#!/bin/sh\nPATH=/nonexistent exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    done = up(state_dir, free_port_block(1), free_port_block(2), "--python", str(wrapper), "--start-retries", "1")
    assert done.returncode != 0
    assert "no instance could start" in done.stderr and "espeak-ng not found" in done.stderr
    assert "The cluster was stopped" in done.stderr
    assert cluster_processes(state_dir) == []


def test_state_dir_too_long_for_a_socket(tmp_path):
    deep = tmp_path / ("x" * 60) / ("y" * 60)
    deep.mkdir(parents=True)
    done = up(deep, free_port_block(1), free_port_block(2))
    assert done.returncode != 0 and "too long for a unix socket" in done.stderr


def test_down_cleans_up_after_a_killed_supervisord(state_dir):
    import json
    import os
    import signal

    port, base = free_port_block(1), free_port_block(2)
    done = up(state_dir, port, base)
    assert done.returncode == 0, done.stderr
    supervisord = int((state_dir / "run/supervisord.pid").read_text())
    ours = cluster_processes(state_dir)
    os.kill(supervisord, signal.SIGKILL)
    psutil.wait_procs([psutil.Process(supervisord)], timeout=10)
    status = cli("status", "--state-dir", str(state_dir))
    assert status.returncode == 3 and "outlived supervisord" in status.stdout
    assert json.loads(cli("status", "--json", "--state-dir", str(state_dir)).stdout)["running"] is False
    down = cli("down", "--state-dir", str(state_dir))
    assert down.returncode == 0, down.stderr
    assert [p for p in ours if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert cluster_processes(state_dir) == []
    from conftest import port_free

    assert port_free(port) and port_free(base) and port_free(base + 1)


def test_a_supervisord_that_stops_answering_while_up_waits_is_a_clear_error_and_nothing_is_left(state_dir):
    """A race: a supervisord that hangs (here SIGSTOPped) while `up` waits used to end in a
    traceback, or a wait for the whole startup timeout, with the cluster left half-started."""
    port, base = free_port_block(1), free_port_block(2)
    env = clean_env()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cosyvoice_lb.launcher.cli",
            "up",
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
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(ROOT),
    )
    pid_file = state_dir / "run/supervisord.pid"
    stopped = None
    deadline = time.monotonic() + 60
    while stopped is None and time.monotonic() < deadline and proc.poll() is None:
        try:
            stopped = psutil.Process(int(pid_file.read_text().strip()))
            stopped.suspend()  # busy forever, from `up`'s point of view
        except (OSError, ValueError, psutil.Error):
            time.sleep(0.05)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert stopped is not None, "supervisord never started"
    assert proc.returncode != 0
    assert "supervisord" in err and "The cluster was stopped" in err, err
    assert "Traceback" not in err
    left = wait_for(lambda: [] if not cluster_processes(state_dir) else None, timeout=30) or cluster_processes(
        state_dir
    )
    assert left == [], [p.info["cmdline"] for p in left]
