"""The speech check on real clusters (supervisord, nginx, the health loop):

* the flite engine, real speech heard by the real pocketsphinx: every answer sampled, each
  instance's warm-up passed, ``/ping``, ``status`` and ``/metrics`` say so;
* a model that only clones (the contract fake of CosyVoice3 in a checkout without upstream's
  bundled prompt, as a pip-installed upstream is) goes bad on one instance (NaN for every
  request) while many clients send the same common text with the same prompt: its canary
  speaks with the prompt this package ships, finds it out, and the instance leaves the
  rotation within seconds of its first bad answer; no client hears a bad answer.
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import soundfile
from conftest import ROOT, Load, clean_env, cli, free_port_block, status, wait_for

from cosyvoice_lb.instance.audio.check import check_audio

pytestmark = pytest.mark.integration
TEXT = "Hello, this is a short check of the voice. The weather is nice today."


@pytest.mark.skipif(not shutil.which("flite"), reason="flite is not installed")
def test_a_flite_cluster_is_heard_saying_its_text(tmp_path):
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(2)
    common = ["--state-dir", str(state_dir)]
    try:
        done = cli(
            "up", "--engine", "flite", "--instances", "2", "--no-ui", "--asr-sample", "1", "--host", "127.0.0.1",
            "--port", str(port), "--base-port", str(base), *common, timeout=180,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        for voice in ("slt", "awb", "rms", "kal"):
            r = requests.post(f"http://127.0.0.1:{port}/v1/tts", json={"text": TEXT, "speaker": voice}, timeout=30)
            assert r.status_code == 200, r.text
            audio, rate = soundfile.read(io.BytesIO(r.content), dtype="float32")
            assert rate == 16000 and check_audio(audio, TEXT, 1.0, rate) is None
        heard: list[dict] = []

        def checked() -> bool:
            heard.clear()
            for i in range(2):
                speech = requests.get(f"http://127.0.0.1:{base + i}/ping", timeout=5).json()["speech"]
                heard.extend(c for c in speech["last"] if c["kind"] == "request")
            return len(heard) == 4

        assert wait_for(checked, 30), heard  # every live answer checked, after it was sent
        assert all(c["metric"] == "wer" and c["error"] <= 0.5 for c in heard), heard
        code, body = status(state_dir)
        assert [i["speech"] for i in body["instances"]] == ["passed", "passed"], body["instances"]
        assert not [w for w in body["warnings"] if "unchecked" in w]
        text = cli("status", *common).stdout
        assert "speech" in text and "passed" in text
        metrics = requests.get(f"http://127.0.0.1:{base}/metrics", timeout=5).text
        assert 'cosyvoice_speech_checks_total{kind="warm_up",outcome="passed"} 1.0' in metrics
    finally:
        cli("down", *common, timeout=120)
        shutil.rmtree(state_dir, ignore_errors=True)


def cloning_only_checkout(tmp: Path) -> Path:
    """The contract fake of upstream without its asset/ (no bundled prompt: a pip-installed
    upstream, or an image without the checkout's assets)."""
    root = tmp / "checkout"
    shutil.copytree(ROOT / "tests" / "fake_cosyvoice", root, ignore=shutil.ignore_patterns("asset"))
    return root


def judged(response: requests.Response) -> str:
    """What is wrong with an answer's audio ("" when nothing): the audio check, and no sample
    at full scale (16-bit PCM has no NaN: it is written as full scale)."""
    audio, rate = soundfile.read(io.BytesIO(response.content), dtype="float32")
    fault = check_audio(audio, TEXT, 1.0, rate)
    peak = float(np.abs(audio).max()) if audio.size else 0.0
    return str(fault) if fault is not None else f"peak {peak}" if peak > 0.99 else ""


def test_a_cloning_only_model_gone_bad_leaves_rotation_fast_and_no_client_hears_it(tmp_path):
    pytest.importorskip("torch", reason="the contract fake yields torch tensors, like upstream")
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    broken = tmp_path / "nan"
    broken.mkdir()
    port, base = free_port_block(1), free_port_block(2)
    common = ["--state-dir", str(state_dir)]
    env = clean_env(FAKE_COSYVOICE_NAN_DIR=str(broken))
    try:
        done = cli(
            "up", "--engine", "cosyvoice3", "--model-dir", str(ROOT / "tests" / "fake_models" / "Fun-CosyVoice3-0.5B"),
            "--cosyvoice-root", str(cloning_only_checkout(tmp_path)), "--instances", "2", "--no-ui",
            "--retries", "2", "--probe-interval", "0.5", "--start-retries", "20", "--max-queue", "4",
            "--host", "127.0.0.1",
            "--port", str(port), "--base-port", str(base), *common, env=env, timeout=240,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        log = state_dir / "logs" / "instance-1.log"
        said = log.read_text()
        assert "check_prompt.wav" not in said and "unchecked" in said  # warmed up with a prompt, not heard
        prompt = (ROOT / "tests" / "fake_cosyvoice" / "asset" / "zero_shot_prompt.wav").read_bytes()

        # (three clients: what one instance holds, one in the engine and two waiting, so the
        # other carries them all while this one is out and refuses none as overloaded)
        def send(url: str) -> requests.Response:  # the same text with the same prompt, every client
            fields = {"text": TEXT, "prompt_text": "希望你以后能够做的比我还好呦。"}
            files = {"prompt_audio": ("prompt.wav", prompt, "audio/wav")}
            return requests.post(url + "/v1/tts", data=fields, files=files, timeout=60)

        with Load(f"http://127.0.0.1:{port}", threads=3, send=send, judge=judged) as clients:
            time.sleep(2)  # traffic on both instances first
            (broken / str(base + 1)).write_text("nan")
            went_bad = time.monotonic()

            def out() -> bool:  # the health loop took it out for bad audio (and restarts it)
                report = json.loads((state_dir / "run" / "health.json").read_text())["instances"]
                return report["instance-1"].get("ordered", {}).get("bad_audio", 0) > 0

            seen_out = wait_for(out, 20, interval=0.1)
            took = time.monotonic() - went_bad
            assert seen_out, log.read_text()[-2000:]
            (broken / str(base + 1)).unlink()  # mended: its restart is sound and it comes back
            time.sleep(2)
        assert took < 8, took  # within seconds of its first bad answer (the load sends one at once)
        assert clients.bad == [], clients.bad[:5]  # not one bad answer reached a client
        assert clients.failures == [], clients.failures[:5]
        assert clients.ok > 20
        after = log.read_text()
        assert "a canary synthesis made bad audio" in after and "NaN or infinite" in after
    finally:
        cli("down", *common, timeout=120)
        shutil.rmtree(state_dir, ignore_errors=True)
