"""Saved voices, one registry for the cluster, end to end on the contract fake of CosyVoice3:
registered on one instance, spoken by every instance, kept across down/up, deleted everywhere.
"""

from __future__ import annotations

import io
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import soundfile
from conftest import ROOT, clean_env, cli, free_port_block, unexpected_tracebacks

pytest.importorskip("torch", reason="the contract fake yields torch tensors, like upstream")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.integration
FAKE = ROOT / "tests" / "fake_cosyvoice"
V3 = ROOT / "tests" / "fake_models" / "Fun-CosyVoice3-0.5B"
PROMPT = FAKE / "asset" / "zero_shot_prompt.wav"
TRANSCRIPT = "希望你以后能够做的比我还好呦。"


def up(state_dir: Path, port: int, base: int) -> None:
    done = cli(
        "up",
        "--engine",
        "cosyvoice3",
        "--model-dir",
        str(V3),
        "--cosyvoice-root",
        str(FAKE),
        "--instances",
        "2",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        "--max-chars",
        "60",
        "--segment-chars",
        "40",
        "--openai-voices",
        "alloy=narrator",
        env=clean_env(FAKE_COSYVOICE_LOAD_SECONDS="0.2", FAKE_COSYVOICE_CHUNK_SECONDS="0.1"),
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def cluster():
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(2)
    up(state_dir, port, base)
    http = requests.Session()
    http.trust_env = False
    yield {"url": f"http://127.0.0.1:{port}", "port": port, "base": base, "state_dir": state_dir, "http": http}
    cli("down", "--state-dir", str(state_dir), timeout=120)
    shutil.rmtree(state_dir, ignore_errors=True)


def register(cluster, name: str, url: str | None = None, **fields) -> requests.Response:
    with open(PROMPT, "rb") as prompt:
        return cluster["http"].post(
            (url or cluster["url"]) + "/v1/audio/voices",
            timeout=60,
            data={"name": name, "prompt_text": TRANSCRIPT, "consent": "yes", **fields},
            files={"audio_sample": ("me.wav", prompt, "audio/wav")},
        )


def speech(cluster, url: str, voice, **extra) -> requests.Response:
    return cluster["http"].post(
        url + "/v1/audio/speech",
        timeout=60,
        json={"model": "tts-1", "input": "你好，世界。", "voice": voice, "response_format": "wav", **extra},
    )


def test_a_voice_registered_on_one_instance_is_spoken_by_every_instance(cluster):
    first = f"http://127.0.0.1:{cluster['base']}"  # straight to each instance: the registry is what is shared
    second = f"http://127.0.0.1:{cluster['base'] + 1}"
    r = register(cluster, "narrator", url=first)
    assert r.status_code == 200, r.text
    voice = r.json()
    assert voice["object"] == "audio.voice" and voice["id"].startswith("voice_") and voice["name"] == "narrator"
    cluster["voice"] = voice["id"]
    for url in (first, second):
        listed = cluster["http"].get(url + "/v1/audio/voices", timeout=10).json()
        assert [v["id"] for v in listed["data"]] == [voice["id"]]
        assert cluster["http"].get(f"{url}/v1/audio/voices/{voice['id']}", timeout=10).json()["name"] == "narrator"
        for key in (voice["id"], {"id": voice["id"]}, "narrator", "alloy"):  # alloy is mapped to it
            r = speech(cluster, url, key)
            assert r.status_code == 200, r.text
        r = cluster["http"].post(url + "/v1/tts", json={"text": "你好。", "voice": voice["id"]}, timeout=60)
        assert r.status_code == 200, r.text
    # each instance put the voice in upstream's speaker cache once and spoke it from there after
    for url in (first, second):
        metrics = cluster["http"].get(url + "/metrics", timeout=10).text
        assert "cosyvoice_voice_cache_misses_total 1.0" in metrics and "cosyvoice_voice_cache_hits_total 4.0" in metrics
    logs = "".join((cluster["state_dir"] / "logs" / f"instance-{i}.log").read_text() for i in (0, 1))
    assert not unexpected_tracebacks(logs)


def test_the_official_client_speaks_a_saved_voice_with_instructions(cluster):
    client = openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="none-configured")
    response = client.audio.speech.create(
        model="tts-1",
        voice={"id": cluster["voice"]},
        input="慢慢说。",
        instructions="Speak slowly.",
        response_format="flac",
    )
    audio, rate = soundfile.read(io.BytesIO(response.content), dtype="float32")
    assert rate == 24000 and audio.size > 0


def test_a_long_text_in_a_saved_voice_fans_out(cluster):
    text = "这是一个很长的句子，用来测试长文本的切分。" * 8  # 168 characters: past --max-chars 60
    r = cluster["http"].post(cluster["url"] + "/v1/tts", json={"text": text, "voice": "narrator"}, timeout=120)
    assert r.status_code == 200, r.text
    audio, rate = soundfile.read(io.BytesIO(r.content), dtype="float32")
    assert audio.size / rate > 0.06 * 150  # the fake speaks 0.06 s a character


def test_the_ui_offers_saved_voices_and_speaks_them(cluster):
    from gradio_client import Client

    client = Client(cluster["url"] + "/", verbose=False)
    path = client.predict(
        "你好，世界。", "zero_shot", None, "", "", None, 1.0, 7, False, cluster["voice"], api_name="/generate"
    )
    audio, rate = soundfile.read(path, dtype="float32")
    assert rate == 24000 and audio.size > 0
    config = cluster["http"].get(cluster["url"] + "/config", timeout=10).json()
    (dropdown,) = [c for c in config["components"] if str(c["props"].get("label", "")).startswith("Saved voice")]
    assert dropdown["props"]["visible"] is True


def test_a_streamed_long_text_sends_its_first_segment_long_before_the_last(cluster):
    text = "这是一个很长的句子，用来测试长文本的切分。" * 12  # 252 characters, 7 segments, 2 instances
    t0 = time.monotonic()
    arrivals = []
    with cluster["http"].post(
        cluster["url"] + "/v1/tts", json={"text": text, "voice": "narrator", "stream": True}, stream=True, timeout=120
    ) as r:
        assert r.status_code == 200, r.text
        for chunk in r.iter_content(None):
            arrivals.append((time.monotonic() - t0, len(chunk)))
    total = arrivals[-1][0]
    first_audio = arrivals[0][0]  # (the WAV header goes out with the first segment's audio)
    # each segment takes the fake 0.4 s; 7 of them on 2 instances, in order
    assert first_audio < total / 2, arrivals
    assert sum(n for _, n in arrivals) > 44 + 2 * 24000 * 0.06 * 200


def test_with_streaming_response_the_first_bytes_come_long_before_the_last(cluster):
    client = openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="none-configured")
    text = "这是一个很长的句子，用来测试长文本的切分。" * 12  # 7 segments of 0.4 s on 2 instances
    t0 = time.monotonic()
    arrivals, data = [], b""
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="narrator", input=text, response_format="mp3"
    ) as response:
        for chunk in response.iter_bytes():
            arrivals.append(time.monotonic() - t0)
            data += chunk
    assert arrivals[0] < arrivals[-1] / 2, arrivals
    audio, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    assert rate == 24000 and audio.size / rate > 0.06 * len(text) * 0.9


def test_a_drained_restart_of_the_coordinating_instance_loses_no_long_text(cluster):
    text = "这是一个很长的句子，用来测试长文本的切分。" * 30  # 16 segments of 0.4 s: seconds of work left
    with cluster["http"].post(
        cluster["url"] + "/v1/audio/speech",
        timeout=120,
        stream=True,
        json={"model": "tts-1", "input": text, "voice": "narrator", "response_format": "pcm"},
    ) as r:
        assert r.status_code == 200, r.text
        coordinator = f"instance-{int(r.headers['x-instance-port']) - cluster['base']}"
        # the instance coordinating this text is restarted (drained) while the text is on its way
        restart = threading.Thread(
            target=lambda: cli("restart", coordinator, "--state-dir", str(cluster["state_dir"]), timeout=180)
        )
        restart.start()
        size = sum(len(chunk) for chunk in r.iter_content(None))
    restart.join(180)
    log = (cluster["state_dir"] / "logs" / f"{coordinator}.log").read_text()
    assert "long text(s) still running" not in log and "stopping: draining" in log
    assert size / 2 / 24000 > 0.06 * len(text) * 0.9  # the whole text, at 24 kHz 16-bit


def test_registration_applies_the_prompt_rules(cluster):
    silent = io.BytesIO()
    soundfile.write(silent, np.zeros(48000, dtype=np.float32), 16000, format="WAV")
    r = cluster["http"].post(
        cluster["url"] + "/v1/audio/voices",
        timeout=30,
        data={"name": "quiet", "prompt_text": "x", "consent": "yes"},
        files={"audio_sample": ("q.wav", silent.getvalue(), "audio/wav")},
    )
    assert r.status_code == 400 and "silent" in r.json()["error"]["message"]
    assert r.headers["x-should-retry"] == "false"
    for seconds in (0.5, 2.9):  # what docs/api.md and the UI say: 3-15 s
        short = io.BytesIO()
        soundfile.write(short, soundfile.read(PROMPT, dtype="float32")[0][: int(seconds * 16000)], 16000, format="WAV")
        r = cluster["http"].post(
            cluster["url"] + "/v1/audio/voices",
            timeout=30,
            data={"name": "short", "prompt_text": TRANSCRIPT, "consent": "yes"},
            files={"audio_sample": ("s.wav", short.getvalue(), "audio/wav")},
        )
        assert r.status_code == 400, r.text
        assert f"is {seconds:.1f} s long: cloning a voice needs 3-15 s" in r.json()["error"]["message"]
    for consent in ({}, {"consent": "no"}, {"consent": "ok"}):  # only an explicit yes saves someone's voice
        with open(PROMPT, "rb") as prompt:
            r = cluster["http"].post(
                cluster["url"] + "/v1/audio/voices",
                timeout=30,
                data={"name": "unasked", "prompt_text": TRANSCRIPT, **consent},
                files={"audio_sample": ("me.wav", prompt, "audio/wav")},
            )
        assert r.status_code == 400 and "send consent=yes" in r.json()["error"]["message"], r.text
    names = [v["name"] for v in cluster["http"].get(cluster["url"] + "/v1/audio/voices", timeout=10).json()["data"]]
    assert "short" not in names and "unasked" not in names
    r = register(cluster, "no-transcript", prompt_text="")
    assert r.status_code == 400 and "prompt_text" in r.json()["error"]["message"]
    r = register(cluster, "narrator")
    assert r.status_code == 409 and "exists" in r.json()["error"]["message"]
    r = cluster["http"].post(cluster["url"] + "/v1/audio/voices", json={"name": "x"}, timeout=30)
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]


def test_voices_survive_down_and_up_then_a_deleted_voice_stops_everywhere(cluster):
    assert cli("down", "--state-dir", str(cluster["state_dir"]), timeout=120).returncode == 0
    up(cluster["state_dir"], cluster["port"], cluster["base"])
    assert speech(cluster, cluster["url"], cluster["voice"]).status_code == 200
    r = cluster["http"].delete(f"{cluster['url']}/v1/audio/voices/{cluster['voice']}", timeout=10)
    assert r.status_code == 200 and r.json() == {
        "id": cluster["voice"],
        "object": "audio.voice.deleted",
        "deleted": True,
    }
    for i in (0, 1):
        url = f"http://127.0.0.1:{cluster['base'] + i}"
        r = speech(cluster, url, cluster["voice"])
        assert r.status_code == 404 and "GET /v1/audio/voices" in r.json()["error"]["message"], r.text
        assert r.headers["x-should-retry"] == "false"
    assert cluster["http"].get(cluster["url"] + "/v1/audio/voices", timeout=10).json()["data"] == []
