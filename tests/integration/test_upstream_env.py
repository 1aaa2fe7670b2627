"""The instance in an environment like upstream CosyVoice's: gradio 5.4, fastapi 0.115,
uvicorn 0.30, pydantic 2.7, numpy 1.26, soundfile 0.12 and torch, without cosyvoice-lb.

The launcher runs in its own venv (gradio 6); instances run under --python in this one.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests
from conftest import ROOT, cli, free_port_block

# upstream requirements.txt pins (torch: the CPU build this machine has; huggingface_hub:
# what upstream's transformers==4.51.3 pin brings, gradio 5.4 needs its HfFolder)
PINS = [
    "gradio==5.4.0",
    "fastapi==0.115.6",
    "uvicorn==0.30.0",
    "pydantic==2.7.0",
    "numpy==1.26.4",
    "soundfile==0.12.1",
    "huggingface_hub<0.27",
    "torch==2.13.0",
]
# what `up` asks the user to add to that environment: the instances' /metrics
ADDED = ["prometheus_client"]
FAKE = ROOT / "tests" / "fake_cosyvoice"
V3 = ROOT / "tests" / "fake_models" / "Fun-CosyVoice3-0.5B"


@pytest.fixture(scope="module")
def upstream_python():
    where = Path(tempfile.mkdtemp(prefix="cvlb-env-"))
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    done = subprocess.run(
        [str(where / "bin/python"), "-m", "pip", "install", "-q", *PINS], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-2000:]
    yield where / "bin/python"
    shutil.rmtree(where, ignore_errors=True)


def test_instances_run_in_upstreams_environment(upstream_python, state_dir):
    probe = subprocess.run(
        [
            str(upstream_python),
            "-c",
            "import gradio, importlib.util as u; print(gradio.__version__, u.find_spec('cosyvoice_lb') is None)",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),
    )
    assert probe.stdout.split() == ["5.4.0", "True"]  # gradio 5, and no cosyvoice-lb there
    port, base = free_port_block(1), free_port_block(1)
    args = [
        "--model-dir",
        str(V3),
        "--cosyvoice-root",
        str(FAKE),
        "--python",
        str(upstream_python),
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
    ]
    refused = cli("up", *args, timeout=300)  # upstream's pins have no prometheus_client: said, with the fix
    assert refused.returncode != 0 and "lacks prometheus_client" in refused.stderr
    assert f"{upstream_python} -m pip install prometheus_client" in refused.stderr
    subprocess.run(
        [str(upstream_python), "-m", "pip", "install", "-q", *ADDED], check=True, timeout=300, capture_output=True
    )
    done = cli("up", *args, timeout=300)
    try:
        assert done.returncode == 0, done.stderr
        url = f"http://127.0.0.1:{port}"
        prompt = (FAKE / "asset" / "zero_shot_prompt.wav").read_bytes()
        r = requests.post(
            url + "/v1/tts",
            data={"text": "你好", "mode": "zero_shot", "prompt_text": "希望"},
            files={"prompt_audio": ("p.wav", prompt, "audio/wav")},
            timeout=60,
        )
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
        # a stream through this env's starlette/uvicorn: chunked WAV, the engine slot free after
        streamed = requests.post(url + "/v1/tts", json={"text": "Hello there.", "stream": True}, timeout=60)
        assert streamed.status_code == 200 and streamed.headers["content-type"] == "audio/wav"
        assert streamed.content[:4] == b"RIFF" and len(streamed.content) > 1000
        deadline = time.monotonic() + 5
        while requests.get(url + "/ping", timeout=10).json()["inflight"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert requests.get(url + "/ping", timeout=10).json()["inflight"] == 0
        bad = requests.post(url + "/v1/tts", json={"text": ""}, timeout=30)
        assert bad.status_code == 400 and "empty" in bad.json()["error"]["message"]
        assert requests.get(url + "/", timeout=30).status_code == 200
        assert requests.get(url + "/gradio_api/info", timeout=30).status_code == 200
        # the syntheses above, observed by this env's prometheus_client
        metrics = requests.get(f"http://127.0.0.1:{base}/metrics", timeout=10).text
        assert 'cosyvoice_first_package_seconds_count{route="api"} 2.0' in metrics

        from gradio_client import Client, handle_file

        client = Client(url + "/", verbose=False)
        result = client.predict(
            "你好",
            "cross_lingual",
            handle_file(str(FAKE / "asset" / "zero_shot_prompt.wav")),
            "",
            "",
            None,
            1.0,
            3,
            False,
            api_name="/generate",
        )
        assert Path(result).stat().st_size > 1000
    finally:
        down = cli("down", "--state-dir", str(state_dir), timeout=120)
    assert down.returncode == 0 and "stopped" in down.stdout


def test_up_names_a_missing_gradio_and_a_pydantic_its_gradio_cannot_read(upstream_python, state_dir):
    # After the test above: this environment has run gradio, and has prometheus_client.
    args = [
        "--model-dir",
        str(V3),
        "--cosyvoice-root",
        str(FAKE),
        "--python",
        str(upstream_python),
        "--instances",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port_block(1)),
        "--base-port",
        str(free_port_block(1)),
        "--state-dir",
        str(state_dir),
    ]
    # A gradio that is gone, with what a run of it leaves that pip's uninstall does not remove:
    # a namespace package, which find_spec calls found.
    pip = [str(upstream_python), "-m", "pip"]
    subprocess.run([*pip, "uninstall", "-y", "-q", "gradio"], check=True, timeout=300, capture_output=True)
    site = subprocess.run(
        [str(upstream_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "gradio" / "_frontend_code").mkdir(parents=True, exist_ok=True)
    refused = cli("up", *args, timeout=300)
    assert refused.returncode != 0 and "lacks gradio" in refused.stderr
    assert f"{upstream_python} -m pip install gradio" in refused.stderr
    assert not (state_dir / "run" / "supervisor.sock").exists()
    # A pydantic whose API schema gradio 5.4 cannot read (its web UI would answer 500).
    subprocess.run(
        [*pip, "install", "-q", "gradio==5.4.0", "pydantic==2.11.7"], check=True, timeout=600, capture_output=True
    )
    refused = cli("up", *args, timeout=300)
    assert refused.returncode != 0, refused.stdout
    assert "gradio 5.4.0 cannot read the API schema that pydantic 2.11.7 writes" in refused.stderr
    assert f"{upstream_python} -m pip install pydantic==2.7.0" in refused.stderr
    assert not (state_dir / "run" / "supervisor.sock").exists()
