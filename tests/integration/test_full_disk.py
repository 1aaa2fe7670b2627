"""A full outputs disk under a real cluster: the instances keep speaking, and every view of
the cluster says that results are not kept until one is again.

One espeak instance behind nginx, its outputs dir on a small tmpfs (mounting one needs root;
without it the module is skipped). A non-streamed request gets a 507 whose x-should-retry
agrees with its message; a streamed one gets its audio, and the lost copy is counted; the
instance's /ping, nginx's /ping from this box, `status` and the instance's metrics say so,
and all of it clears once a result is kept again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import requests
from conftest import cli, free_port_block, status, wait_for
from prometheus_client.parser import text_string_to_metric_families

TEXT = "A sentence long enough to need more than the disk has left. " * 3


@pytest.fixture(scope="module")
def disk():
    path = Path(tempfile.mkdtemp(prefix="cvlb-disk-", dir="/tmp"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)], capture_output=True)
    if done.returncode:
        path.rmdir()
        pytest.skip(f"mounting a small tmpfs is not permitted here (needs root): {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(disk):
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))  # short: supervisord's socket
    port, base = free_port_block(1), free_port_block(1)
    try:
        done = cli(
            "up",
            "--engine",
            "espeak",
            "--instances",
            "1",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--base-port",
            str(base),
            "--state-dir",
            str(state_dir),
            "--outputs-dir",
            str(disk),
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        yield {"state_dir": state_dir, "url": f"http://127.0.0.1:{port}", "instance": f"http://127.0.0.1:{base}"}
    finally:
        cli("down", "--state-dir", str(state_dir), timeout=120)
        shutil.rmtree(state_dir, ignore_errors=True)


def metric(web: requests.Session, url: str, name: str) -> float:
    text = web.get(url + "/metrics", timeout=10).text
    (value,) = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    return value


def fill(disk: Path) -> Path:
    """Fill the disk up to its last few KiB: a second of audio no longer fits."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:  # (ENOSPC: full)
        pass
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_shows_everywhere_until_a_result_is_kept_again(cluster, disk, web):
    assert web.post(cluster["url"] + "/v1/tts", json={"text": "Kept."}, timeout=60).status_code == 200
    assert not [p for p in status(cluster["state_dir"])[1]["problems"] if "not being kept" in p]
    filler = fill(disk)
    try:
        refused = web.post(cluster["url"] + "/v1/tts", json={"text": TEXT}, timeout=60)
        assert refused.status_code == 507, refused.text
        error = refused.json()["error"]
        assert error["status"] == 507 and "No space left on device" in error["message"]
        assert refused.headers["x-should-retry"] == "false" and "a retry fails the same way" in error["message"]

        streamed = web.post(cluster["url"] + "/v1/tts", json={"text": TEXT, "stream": True}, timeout=60)
        assert streamed.status_code == 200 and streamed.content[:4] == b"RIFF"  # the client has its audio
        assert wait_for(lambda: metric(web, cluster["instance"], "cosyvoice_results_not_kept_total") == 2, 10)
        assert metric(web, cluster["instance"], "cosyvoice_outputs_failing") == 1

        for url in (cluster["instance"], cluster["url"]):  # the instance, and nginx's /ping from this box
            ping = web.get(url + "/ping", timeout=10)
            assert ping.status_code == 200 and ping.json()["ready"] is True  # it still speaks
            (problem,) = ping.json()["problems"]
            assert "results are not being kept" in problem and str(disk) in problem
        code, body = status(cluster["state_dir"])
        assert code != 0 and any(p.startswith("instance-0: results are not being kept") for p in body["problems"]), (
            body["problems"]
        )
    finally:
        filler.unlink()
    time.sleep(0.2)
    assert web.post(cluster["url"] + "/v1/tts", json={"text": "Kept again."}, timeout=60).status_code == 200
    assert "problems" not in web.get(cluster["instance"] + "/ping", timeout=10).json()
    assert metric(web, cluster["instance"], "cosyvoice_outputs_failing") == 0
    code, body = status(cluster["state_dir"])
    assert not [p for p in body["problems"] if "not being kept" in p], body["problems"]
