"""CosyVoice3 under the launcher, end to end, on the contract fake of upstream.

The fake checkout (tests/fake_cosyvoice) is loaded through --cosyvoice-root exactly as a
real one, so the real adapter, API and UI run under supervisord and nginx.
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
from conftest import ROOT, clean_env, cli, free_port_block

pytest.importorskip("torch", reason="the contract fake yields torch tensors, like upstream")

FAKE = ROOT / "tests" / "fake_cosyvoice"
V3 = ROOT / "tests" / "fake_models" / "Fun-CosyVoice3-0.5B"
PROMPT = FAKE / "asset" / "zero_shot_prompt.wav"
TRANSCRIPT = "希望你以后能够做的比我还好呦。"


def cosyvoice_args(state_dir: Path, port: int, base: int, *extra: str) -> list[str]:
    return [
        "up",
        "--engine",
        "cosyvoice3",
        "--model-dir",
        str(V3),
        "--cosyvoice-root",
        str(FAKE),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        *extra,
    ]


@pytest.fixture(scope="module")
def cluster():
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(2)
    env = clean_env(FAKE_COSYVOICE_CHUNK_SECONDS="0.3")  # the fake spends 0.3 s per streamed chunk
    done = cli(*cosyvoice_args(state_dir, port, base, "--instances", "2", "--stagger"), env=env, timeout=300)
    yield {"up": done, "url": f"http://127.0.0.1:{port}", "state_dir": state_dir}
    cli("down", "--state-dir", str(state_dir), timeout=120)
    shutil.rmtree(state_dir, ignore_errors=True)


def post(cluster, fields: dict, prompt: bytes | None = None, **kw) -> requests.Response:
    files = {"prompt_audio": ("prompt.wav", prompt, "audio/wav")} if prompt is not None else None
    return requests.post(cluster["url"] + "/v1/tts", data=fields, files=files, timeout=60, **kw)


def decoded(response) -> tuple[np.ndarray, int]:
    assert response.status_code == 200, response.text
    return soundfile.read(io.BytesIO(response.content), dtype="float32")


def test_up_starts_cosyvoice3_instances_one_after_another(cluster):
    done = cluster["up"]
    assert done.returncode == 0, done.stderr
    ping = requests.get(cluster["url"] + "/ping", timeout=5).json()
    assert ping["engine"] == "cosyvoice3" and ping["ready"]
    # --stagger: instance-1 started only once instance-0 had loaded (the fake loads in 1 s)
    starts = [float((cluster["state_dir"] / f"run/instance-{i}.starts").read_text().split()[0]) for i in (0, 1)]
    assert starts[1] - starts[0] >= 1.0


@pytest.mark.parametrize(
    "fields",
    [
        {"text": "八百标兵奔北坡。", "mode": "zero_shot", "prompt_text": TRANSCRIPT},
        {"text": "Hello from another language.", "mode": "cross_lingual"},
        {"text": "Hello there.", "mode": "instruct", "instruct_text": "请用广东话表达。"},
    ],
)
def test_every_mode_through_nginx_at_the_models_rate(cluster, fields):
    # The v3 prompt format is added for the user: the fake asserts <|endofprompt|> like upstream.
    audio, rate = decoded(post(cluster, fields, PROMPT.read_bytes()))
    assert rate == 24000 and audio.size > 0.3 * rate and np.abs(audio).max() > 0.05


def test_json_without_a_prompt_uses_the_checkouts_bundled_one(cluster):
    audio, rate = decoded(requests.post(cluster["url"] + "/v1/tts", json={"text": "Hello."}, timeout=60))
    assert rate == 24000 and audio.size > 0


def test_seed_reproduces_the_same_audio(cluster):
    fields = {"text": "Same seed, same voice.", "mode": "cross_lingual", "seed": "42"}
    first = post(cluster, fields, PROMPT.read_bytes()).content
    second = post(cluster, fields, PROMPT.read_bytes()).content
    other = post(cluster, {**fields, "seed": "43"}, PROMPT.read_bytes()).content
    assert first == second and first != other


@pytest.mark.parametrize(
    "fields, prompt, status, words",
    [
        ({"text": "hi", "mode": "zero_shot", "prompt_text": "x"}, None, 400, "needs prompt_audio"),
        ({"text": "hi", "mode": "zero_shot"}, "prompt", 400, "needs prompt_text"),
        ({"text": "hi", "mode": "karaoke"}, "prompt", 400, "unknown mode"),
        ({"text": "hi", "mode": "sft"}, None, 400, "not available with this model"),
        ({"text": "hi", "mode": "cross_lingual"}, b"not audio", 400, "not audio this server can read"),
        ({"text": "hi", "mode": "cross_lingual"}, b"", 400, "empty"),
        ({"text": "hi", "mode": "cross_lingual"}, "8k", 400, "8000 Hz"),
        ({"text": "hi", "mode": "cross_lingual"}, "0.5s", 400, "is 0.5 s long: cloning a voice needs 3-15 s"),
        ({"text": "hi", "mode": "cross_lingual"}, "2.9s", 400, "is 2.9 s long: cloning a voice needs 3-15 s"),
        (
            {"text": "hi", "mode": "cross_lingual", "stream": "true", "speed": "1.5"},
            "prompt",
            400,
            "only without streaming",
        ),
        ({"text": "hi", "mode": "cross_lingual"}, "huge", 413, "larger than 10 MiB"),
    ],
)
def test_bad_prompts_and_modes_are_4xx(cluster, fields, prompt, status, words):
    if prompt == "prompt":
        prompt = PROMPT.read_bytes()
    elif prompt == "8k":
        buffer = io.BytesIO()
        soundfile.write(buffer, 0.3 * np.sin(np.arange(24000) / 3.0).astype(np.float32), 8000, format="WAV")
        prompt = buffer.getvalue()
    elif prompt == "huge":
        prompt = b"RIFF" + b"\0" * (11 * 2**20)
    elif prompt in ("0.5s", "2.9s"):  # the start of the bundled prompt: real speech, too little of it
        buffer = io.BytesIO()
        speech, rate = soundfile.read(PROMPT, dtype="float32")
        soundfile.write(buffer, speech[: int(float(prompt[:-1]) * rate)], rate, format="WAV")
        prompt = buffer.getvalue()
    r = post(cluster, fields, prompt)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    assert requests.get(cluster["url"] + "/ping", timeout=5).status_code == 200


def test_long_stereo_prompt_is_trimmed_and_said_so(cluster):
    rate = 24000
    t = np.arange(20 * rate) / rate
    stereo = np.stack([0.3 * np.sin(2 * np.pi * 200 * t)] * 2, axis=1).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, stereo, rate, format="FLAC")
    r = post(cluster, {"text": "hi", "mode": "cross_lingual"}, buffer.getvalue())
    assert r.status_code == 200
    assert "trimmed from 20.0 s" in r.headers["X-Prompt-Notice"] and "mono" in r.headers["X-Prompt-Notice"]


def test_streaming_answers_the_first_chunk_long_before_the_last(cluster):
    started = time.monotonic()
    with requests.post(
        cluster["url"] + "/v1/tts",
        timeout=60,
        stream=True,
        data={
            "text": "A longer sentence so that the fake model streams it in several chunks.",
            "mode": "cross_lingual",
            "stream": "true",
        },
        files={"prompt_audio": ("p.wav", PROMPT.read_bytes(), "audio/wav")},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
        arrivals, body = [], b""
        for piece in r.iter_content(chunk_size=None):
            body += piece
            if len(body) > 44 and not arrivals:
                arrivals.append(time.monotonic() - started)
        finished = time.monotonic() - started
    assert body[:4] == b"RIFF"
    pcm = np.frombuffer(body[44:], dtype="<i2")
    assert pcm.size > 24000 * 0.5
    print(f"stream: first audio after {arrivals[0]:.2f}s, last after {finished:.2f}s")
    assert finished - arrivals[0] > 0.6  # three more chunks of 0.3 s each came after the first


def test_outputs_dir_keeps_every_result_under_unique_names(cluster):
    r = requests.post(cluster["url"] + "/v1/tts", json={"text": "Keep me."}, timeout=60)
    name = r.headers["X-Output-File"]
    saved = cluster["state_dir"] / "outputs" / name
    assert saved.is_file() and soundfile.info(str(saved)).samplerate == 24000
    names = [p.name for p in (cluster["state_dir"] / "outputs").glob("*.wav")]
    assert len(names) == len(set(names)) >= 5
    assert {n.split("-")[2] for n in names} >= {str(r.headers["X-Instance-Port"])}


def test_when_every_instance_is_full_clients_get_503_with_retry_after_at_once(cluster):
    # 2 instances x (1 synthesizing + --max-queue 2 waiting) = 6 places; each synthesis takes
    # the fake 1.2 s. 12 clients at once: the overflow is refused by both instances
    # (nginx tried the other one first) and told when to come back.
    from concurrent.futures import ThreadPoolExecutor

    def one(_):
        started = time.monotonic()
        r = requests.post(cluster["url"] + "/v1/tts", json={"text": "Please wait your turn."}, timeout=60)
        return r.status_code, time.monotonic() - started, r.headers.get("Retry-After"), r.content[:4]

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    codes = [code for code, *_ in results]
    assert set(codes) <= {200, 503} and codes.count(200) >= 6 and codes.count(503) >= 1, codes
    assert all(body == b"RIFF" for code, _, _, body in results if code == 200)
    refused = [seconds for code, seconds, retry, _ in results if code == 503 and retry == "1"]
    assert len(refused) == codes.count(503)
    print(
        f"backpressure: {codes.count(200)} served, {codes.count(503)} refused in "
        f"{max(refused):.2f}s at most (a synthesis takes 1.2 s)"
    )
    assert max(refused) < 1.2  # refused before even one synthesis could have finished


def test_gradio_client_clones_a_voice_through_nginx(cluster):
    from gradio_client import Client, handle_file

    client = Client(cluster["url"] + "/", verbose=False)
    result = client.predict(
        "你好，世界。", "zero_shot", handle_file(str(PROMPT)), TRANSCRIPT, "", None, 1.0, 7, False, api_name="/generate"
    )
    audio, rate = soundfile.read(result, dtype="float32")
    assert rate == 24000 and audio.size > 0


def test_status_names_the_engine_and_every_instance_ready(cluster):
    done = cli("status", "--json", "--state-dir", str(cluster["state_dir"]))
    body = json.loads(done.stdout)
    assert done.returncode == 0 and all(i["ready"] for i in body["instances"])


# --- refusals before anything starts --------------------------------------------------------


@pytest.mark.parametrize(
    "model, words",
    [
        ("FunAudioLLM/Fun-CosyVoice3-0.5B-2512", "not a local directory"),
        (str(ROOT / "tests"), "has none of cosyvoice.yaml"),
    ],
)
def test_up_refuses_a_model_dir_that_is_not_a_local_model(state_dir, model, words):
    done = cli(
        "up",
        "--engine",
        "cosyvoice3",
        "--model-dir",
        model,
        "--cosyvoice-root",
        str(FAKE),
        "--state-dir",
        str(state_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port_block(1)),
        timeout=60,
    )
    assert done.returncode != 0 and words in done.stderr
    assert not (state_dir / "run" / "supervisor.sock").exists()


def test_up_refuses_a_checkout_without_matcha(state_dir, tmp_path):
    (tmp_path / "cosyvoice").mkdir()
    done = cli(
        "up",
        "--model-dir",
        str(V3),
        "--cosyvoice-root",
        str(tmp_path),
        "--state-dir",
        str(state_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port_block(1)),
        timeout=60,
    )
    assert done.returncode != 0 and "lacks third_party/Matcha-TTS" in done.stderr


def test_up_says_what_the_instances_python_lacks(state_dir, tmp_path):
    import subprocess
    import sys

    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    done = cli(
        "up",
        "--model-dir",
        str(V3),
        "--cosyvoice-root",
        str(FAKE),
        "--python",
        str(bare / "bin/python"),
        "--state-dir",
        str(state_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port_block(1)),
        timeout=60,
    )
    assert done.returncode != 0
    assert "lacks numpy, soundfile, fastapi, uvicorn, gradio, multipart, prometheus_client, torch" in done.stderr
    assert f"{bare / 'bin/python'} -m pip install" in done.stderr and "torch" in done.stderr
    assert not (state_dir / "run" / "supervisor.sock").exists()
