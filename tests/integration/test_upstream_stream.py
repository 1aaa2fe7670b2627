"""Streaming sessions on upstream CosyVoice's own code: a voice agent's text goes to
upstream's generator input (bistream) as it arrives, through nginx, on an instance running
the small CosyVoice3 model whose LLM ends as bistream wants (build_model.py --bistream).
Upstream's frontend, its bistream LLM, flow and vocoder make the audio, chunk by chunk,
before the text is done."""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from conftest import ROOT, clean_env, cli, free_port_block, unexpected_tracebacks, vanish, wait_for

websockets = pytest.importorskip("websockets")
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.upstream]

PROMPT = ROOT / "tests" / "fake_cosyvoice" / "asset" / "zero_shot_prompt.wav"
# a session's voice: a prompt sent base64 in session.config (the model has no bundled one)
VOICE = {
    "type": "session.config",
    "prompt_audio": base64.b64encode(PROMPT.read_bytes()).decode(),
    "prompt_text": "希望你以后能够做的比我还好呦。",
}
TEXT = "A voice agent writes its reply word by word, and the speech starts before the reply is done."


@pytest.fixture(scope="module")
def cluster(upstream_bistream):
    upstream = upstream_bistream
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(1)
    done = cli(
        "up",
        "--engine",
        "cosyvoice3",
        "--model-dir",
        str(upstream.model_dir),
        "--cosyvoice-root",
        str(upstream.root),
        "--python",
        str(upstream.python),
        "--instances",
        "1",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        "--canary-prompt",
        str(PROMPT),
        "--canary-prompt-text",
        "希望你以后能够做的比我还好呦。",
        env=clean_env(),
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    http = requests.Session()
    http.trust_env = False
    yield {
        "url": f"ws://127.0.0.1:{port}/v1/audio/speech/stream",
        "ping": f"http://127.0.0.1:{base}/ping",
        "http": http,
    }
    cli("down", "--state-dir", str(state_dir), timeout=120)
    log = (state_dir / "logs" / "instance-0.log").read_text(errors="replace")
    shutil.rmtree(state_dir, ignore_errors=True)
    assert unexpected_tracebacks(log) == []


def ping(cluster) -> dict:
    return cluster["http"].get(cluster["ping"], timeout=5).json()


def test_upstreams_bistream_speaks_the_text_as_it_arrives(cluster):
    with connect(cluster["url"], open_timeout=10) as ws:
        ws.send(json.dumps({**VOICE, "mode": "zero_shot"}))
        created = json.loads(ws.recv(timeout=30))
        assert created.get("speaking") == "text stream" and created["engine"] == "cosyvoice3", created
        words = TEXT.split(" ")
        first_half = " ".join(words[: len(words) // 2]) + " "
        for i in range(0, len(first_half), 5):
            ws.send(json.dumps({"type": "input.text.delta", "delta": first_half[i : i + 5]}))
        first = ws.recv(timeout=60)  # upstream's LLM read the first half and spoke it
        assert isinstance(first, bytes) and len(first) > 0
        # while it waits for more text the instance holds its slot, and is not stalled
        state = ping(cluster)
        assert state["inflight"] == 1 and all(s < 5 for s in state["stalled_seconds"])
        ws.send(json.dumps({"type": "input.text.delta", "delta": TEXT[len(first_half) :]}))
        ws.send(json.dumps({"type": "input.text.done"}))
        audio, events = first, []
        while True:
            frame = ws.recv(timeout=60)
            if isinstance(frame, bytes):
                audio += frame
                continue
            events.append(json.loads(frame))
            if events[-1]["type"] in ("done", "error"):
                break
        assert events[-1]["type"] == "done", events[-1]
        assert events[-1]["characters"] == len(TEXT) and events[-1]["bytes"] == len(audio)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd.code == 1000
    pcm = np.frombuffer(audio, dtype="<i2")
    assert pcm.size / 24000 > 1.0 and np.abs(pcm).max() > 0  # upstream's flow and vocoder made it
    wait_for(lambda: ping(cluster)["inflight"] == 0, 10)


def test_a_client_leaving_while_upstream_waits_for_text_frees_the_instance(cluster):
    served = ping(cluster)["served"]
    ws = connect(cluster["url"], open_timeout=10)
    ws.send(json.dumps(VOICE))
    ws.recv(timeout=30)
    ws.send(json.dumps({"type": "input.text.delta", "delta": "Half a reply, and then the agent crashed "}))
    time.sleep(1.0)  # upstream's LLM is reading the text, waiting for more
    vanish(ws)
    wait_for(lambda: ping(cluster)["inflight"] == 0, 10)
    with connect(cluster["url"], open_timeout=10) as again:  # its slot and its LLM are free
        again.send(json.dumps(VOICE))
        again.recv(timeout=30)
        again.send(json.dumps({"type": "input.text.delta", "delta": "The next session speaks."}))
        again.send(json.dumps({"type": "input.text.done"}))
        while True:
            frame = again.recv(timeout=60)
            if isinstance(frame, str) and json.loads(frame)["type"] in ("done", "error"):
                assert json.loads(frame)["type"] == "done", frame
                break
    assert ping(cluster)["served"] == served + 1
