"""`up --no-ui` in a Python where gradio cannot be imported (a GPU box with torch alone):
`up` checks that Python without asking for gradio, the instance turns ready and speaks, and
`/`, through nginx and on the instance, is a 404 that names the API. Without --no-ui the same
Python is refused before anything starts, with the install line."""

from __future__ import annotations

import io
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
import requests
import soundfile
from conftest import clean_env, cli, free_port_block, wait_for

from cosyvoice_lb.instance.ui.absent import NO_UI

pytestmark = pytest.mark.integration


def python_without_gradio(where: Path) -> Path:
    """A Python whose ``import gradio`` fails as a missing package's does."""
    blocked = where / "blocked"
    (blocked / "gradio").mkdir(parents=True)
    (blocked / "gradio" / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'gradio\' (blocked by the test)", name="gradio")\n'
    )
    wrapper = where / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={blocked}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper


@pytest.fixture(scope="module")
def cluster():
    scratch = Path(tempfile.mkdtemp(prefix="cvnu-", dir="/tmp"))  # short: unix sockets live in the state dir
    python = python_without_gradio(scratch)
    state_dir = scratch / "s"
    port, base = free_port_block(1), free_port_block(1)
    common = ["--engine", "espeak", "--instances", "1", "--python", str(python), "--host", "127.0.0.1"]
    common += ["--port", str(port), "--base-port", str(base), "--state-dir", str(state_dir)]
    refused = cli("up", *common, env=clean_env(), timeout=120)
    done = cli("up", "--no-ui", *common, env=clean_env(), timeout=300)
    http = requests.Session()
    http.trust_env = False
    yield {
        "refused": refused,
        "up": done,
        "url": f"http://127.0.0.1:{port}",
        "instance": f"http://127.0.0.1:{base}",
        "state_dir": state_dir,
        "http": http,
    }
    cli("down", "--state-dir", str(state_dir), timeout=120)
    shutil.rmtree(scratch, ignore_errors=True)


def test_without_no_ui_that_python_is_refused_with_the_install_line(cluster):
    refused = cluster["refused"]
    assert refused.returncode != 0
    assert "lacks gradio" in refused.stderr and "-m pip install gradio" in refused.stderr
    assert "nothing was started" in refused.stderr


def test_up_says_the_cluster_serves_the_api_without_the_ui(cluster):
    done = cluster["up"]
    assert done.returncode == 0, done.stderr
    assert "API (no UI: --no-ui)" in done.stdout


def test_the_instance_is_ready_and_speaks(cluster):
    http = cluster["http"]
    assert http.get(cluster["url"] + "/ping", timeout=5).json()["ready"] is True
    r = http.post(cluster["url"] + "/v1/audio/speech", json={"model": "tts-1", "input": "Hello.", "voice": "alloy"})
    assert r.status_code == 200, r.text
    r = http.post(cluster["url"] + "/v1/tts", json={"text": "Hello there, no UI."}, timeout=30)
    audio, rate = soundfile.read(io.BytesIO(r.content), dtype="float32")
    assert r.status_code == 200 and rate == 22050 and len(audio) > rate // 2


@pytest.mark.parametrize("where", ["url", "instance"])
def test_the_root_is_a_404_naming_the_api(cluster, where):
    r = cluster["http"].get(cluster[where] + "/", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["message"] == NO_UI


def test_the_instance_process_never_imported_gradio(cluster):
    status = cli("status", "--json", "--state-dir", str(cluster["state_dir"]))
    assert status.returncode == 0, status.stderr
    pid = cluster["http"].get(cluster["instance"] + "/ping", timeout=5).json()["pid"]
    process = psutil.Process(pid)
    assert "--no-ui" in process.cmdline()
    # (the blocked package is on its path: had anything imported gradio, the instance would have died)
    assert "blocked" in process.environ().get("PYTHONPATH", "")
    logs = cluster["state_dir"] / "logs"
    wait_for(lambda: any(p.name.startswith("instance-0") for p in logs.iterdir()), 10)
    text = "".join(p.read_text(errors="replace") for p in logs.iterdir() if p.name.startswith("instance-0"))
    assert "gradio" not in text.lower(), text[-2000:]
