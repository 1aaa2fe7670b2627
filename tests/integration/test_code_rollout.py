"""Rolling out new code: the launcher runs from a copy of the checkout (the real one is never
touched); a file of the instance code changes there, `restart --all` (rolling, then with a
surge) stages it again and replaces the instances one by one under load, with no request
failed; the instances answer with the change, and `status` shows each instance's code digest
moving, a half-finished roll-out included."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import requests
from conftest import ROOT, Load, clean_env, free_port_block

INSTANCES = 2


def run(copy: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``cosyvoice-lb ARGS`` from the copy (its package first on the path)."""
    return subprocess.run(
        [sys.executable, "-m", "cosyvoice_lb.launcher.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(copy),
        env=clean_env(PYTHONPATH=str(copy)),
    )


def state_of(cluster) -> tuple[int, dict]:
    done = run(cluster["copy"], "status", "--json", "--state-dir", str(cluster["state"]))
    return done.returncode, json.loads(done.stdout)


def pings(cluster) -> list[dict]:
    with requests.Session() as http:
        http.trust_env = False
        return [http.get(f"http://127.0.0.1:{cluster['base'] + i}/ping", timeout=10).json() for i in range(INSTANCES)]


def change_instance_code(cluster, marker: str) -> None:
    """A new version of the instance code: /ping says ``marker``."""
    server = cluster["copy"] / "cosyvoice_lb" / "instance" / "server.py"
    text = server.read_text()
    old = cluster.get("marker_line", '        "pid": os.getpid(),\n')
    new = f'        "pid": os.getpid(),\n        "rollout_marker": "{marker}",\n'
    assert old in text
    server.write_text(text.replace(old, new, 1))
    cluster["marker_line"] = new


@pytest.fixture(scope="module")
def cluster():
    root = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    copy = root / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("cosyvoice_lb", "templates"):
        shutil.copytree(ROOT / name, copy / name, ignore=ignore)
    shutil.copy2(ROOT / "app.py", copy / "app.py")
    where = subprocess.run(
        [sys.executable, "-c", "import cosyvoice_lb; print(cosyvoice_lb.__file__)"],
        capture_output=True,
        text=True,
        cwd=str(copy),
        env=clean_env(PYTHONPATH=str(copy)),
    )
    assert where.stdout.strip() == str(copy / "cosyvoice_lb" / "__init__.py")
    port, base = free_port_block(1), free_port_block(INSTANCES + 1)
    state = root / "s"
    done = run(
        copy,
        "up",
        "--engine",
        "espeak",
        "--instances",
        str(INSTANCES),
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state),
        "--probe-interval",
        "0.5",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    yield {"root": root, "copy": copy, "state": state, "base": base, "url": f"http://127.0.0.1:{port}"}
    run(copy, "down", "--state-dir", str(state), timeout=120)
    shutil.rmtree(root, ignore_errors=True)


def test_status_shows_the_code_each_instance_runs(cluster):
    code, body = state_of(cluster)
    assert code == 0, body["problems"]
    staged = body["code"]
    assert len(staged) == 16 and [i["code"] for i in body["instances"]] == [staged] * INSTANCES
    lib = cluster["state"] / "run" / "lib"
    assert lib.is_symlink() and os.readlink(lib) == f"lib-{staged}"
    assert (lib / "CODE").read_text().strip() == staged
    table = run(cluster["copy"], "status", "--state-dir", str(cluster["state"])).stdout
    assert f"instance code staged: {staged}" in table and staged[:8] in table


def test_restart_all_rolls_out_a_change_in_the_checkout(cluster):
    before = state_of(cluster)[1]["code"]
    change_instance_code(cluster, "second")
    assert all("rollout_marker" not in p for p in pings(cluster))  # (nothing staged before the restart)
    with Load(cluster["url"], threads=2, seconds=240) as load:
        done = run(cluster["copy"], "restart", "--all", "--state-dir", str(cluster["state"]))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "staged new instance code" in done.stdout
    assert load.failures == [] and load.ok > 0
    assert [p["rollout_marker"] for p in pings(cluster)] == ["second"] * INSTANCES
    code, body = state_of(cluster)
    assert code == 0, body["problems"]
    assert body["code"] != before and [i["code"] for i in body["instances"]] == [body["code"]] * INSTANCES
    assert not any("roll-out not finished" in w for w in body["warnings"])
    # the old tree went once nothing ran it
    assert not (cluster["state"] / "run" / f"lib-{before}").exists()


def test_a_half_done_roll_out_shows_and_a_surge_roll_out_finishes_it(cluster):
    previous = state_of(cluster)[1]["code"]
    change_instance_code(cluster, "third")
    done = run(cluster["copy"], "restart", "instance-0", "--state-dir", str(cluster["state"]))
    assert done.returncode == 0, done.stdout + done.stderr
    assert [p.get("rollout_marker") for p in pings(cluster)] == ["third", "second"]
    code, body = state_of(cluster)
    staged = body["code"]
    assert staged != previous
    assert [i["code"] for i in body["instances"][:INSTANCES]] == [staged, previous]
    assert any("roll-out not finished: instance-1" in w for w in body["warnings"])
    # instance-1 still runs its own, complete tree
    assert (cluster["state"] / "run" / f"lib-{previous}" / "cosyvoice_lb" / "instance" / "server.py").exists()
    table = run(cluster["copy"], "status", "--state-dir", str(cluster["state"])).stdout
    assert f"{previous[:8]} (old)" in table
    with Load(cluster["url"], threads=2, seconds=240) as load:
        done = run(cluster["copy"], "restart", "--all", "--surge", "1", "--state-dir", str(cluster["state"]))
    assert done.returncode == 0, done.stdout + done.stderr
    assert load.failures == [] and load.ok > 0
    code, body = state_of(cluster)
    running = [i for i in body["instances"] if i["state"] == "RUNNING"]
    assert len(running) == INSTANCES and {i["code"] for i in running} == {staged}
    assert not any("roll-out not finished" in w for w in body["warnings"])
    with requests.Session() as http:
        http.trust_env = False
        answers = [http.get(f"http://127.0.0.1:{i['port']}/ping", timeout=10).json() for i in running]
    assert [a.get("rollout_marker") for a in answers] == ["third"] * INSTANCES
    assert not (cluster["state"] / "run" / f"lib-{previous}").exists()
