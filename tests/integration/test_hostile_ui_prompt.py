"""The UI's prompt audio, hostile: a cloning engine's Gradio UI through nginx, called with
gradio_client, given files that are not usable voice prompts.

The espeak cluster of test_hostile_input.py has no prompt audio input (espeak does not
clone), so this module runs its own one-instance cluster on the CosyVoice3 contract fake
(tests/fake_cosyvoice, as test_cosyvoice_cluster.py does). Each call must end in a clear
error from the UI (gradio_client's AppError with the pipeline's message), and the instance
must stay up: same pid, no restart, no traceback in its log.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import requests
import soundfile
from conftest import FAKE_COSYVOICE3, clean_env, simulated_cluster, status, unexpected_tracebacks

pytest.importorskip("torch", reason="the contract fake yields torch tensors, like upstream")


@pytest.fixture(scope="module")
def cluster():
    chunks = clean_env(FAKE_COSYVOICE_CHUNK_SECONDS="0.05")
    with simulated_cluster("--host", "127.0.0.1", instances=1, engine=FAKE_COSYVOICE3, env=chunks, timeout=300) as up:
        code, body = status(up["state_dir"])
        assert code == 0, body
        yield {**up, "instances": {i["name"]: i["pid"] for i in body["instances"]}}


def session() -> requests.Session:
    web = requests.Session()
    web.trust_env = False  # (loopback: no proxy from the environment)
    return web


def wav(seconds: float, rate: int, silent: bool = False) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    audio = np.zeros_like(t) if silent else 0.3 * np.sin(2 * np.pi * 220 * t)
    buffer = io.BytesIO()
    soundfile.write(buffer, audio.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


@pytest.mark.parametrize(
    "name, content",
    [
        pytest.param("prompt.wav", b"this is not audio at all\n" * 40, id="upload-text-named-wav"),
        pytest.param("notes.txt", b"\x00\x01binary, named .txt" * 40, id="upload-binary-named-txt"),
        pytest.param("notes.md", b"this is not audio at all\n" * 40, id="upload-text-not-named-txt"),
        pytest.param("prompt.wav", b"", id="upload-empty-file"),
        pytest.param("run.sh", b"#!/bin/sh\necho uploaded\n", id="upload-shell-script"),
    ],
)
def test_the_upload_route_takes_audio_only(cluster, name, content):
    """Gradio's upload route takes prompt audio (and the long-form tab's UTF-8 .txt), not any
    file: the rest is a 4xx JSON answer that says what to send, and never reaches the disk."""
    web = session()
    answer = web.post(cluster["url"] + "/gradio_api/upload", files={"files": (name, content)}, timeout=30)
    assert answer.status_code == 415, (answer.status_code, answer.text)
    error = answer.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and "not a file this UI takes" in error["message"]
    assert "WAV" in error["message"] and "UTF-8 .txt" in error["message"], error
    stored = [f.name for f in (cluster["state_dir"] / "run" / "gradio").rglob("*") if f.is_file()]
    assert name not in stored, stored


def test_the_upload_route_refuses_a_prompt_over_the_size_limit(cluster):
    big = wav(4, 16000) + b"\0" * (11 * 2**20)  # audio by its first bytes, past --max-upload (10 MiB)
    answer = session().post(cluster["url"] + "/gradio_api/upload", files={"files": ("big.wav", big)}, timeout=60)
    assert answer.status_code == 413 and "larger than" in answer.json()["error"]["message"], answer.text


def test_the_upload_route_takes_a_long_form_txt_up_to_its_own_limit(cluster):
    chapter = "第一章 一个很长的故事。Chapter one, a long story.\n".encode() * 200
    taken = session().post(cluster["url"] + "/gradio_api/upload", files={"files": ("chapter.txt", chapter)}, timeout=30)
    assert taken.status_code == 200 and len(taken.json()) == 1, taken.text
    big = b"a long line of text\n" * (2 * 2**20 // 20)  # text, past the .txt limit (1 MiB)
    refused = session().post(cluster["url"] + "/gradio_api/upload", files={"files": ("book.txt", big)}, timeout=60)
    assert refused.status_code == 413, refused.text
    assert "split it into several jobs" in refused.json()["error"]["message"], refused.text


def test_an_upload_is_served_back_to_its_session_only_and_no_answer_names_a_server_path(cluster):
    state = str(cluster["state_dir"].resolve())
    owner, other = session(), session()
    for web in (owner, other):  # each gets its own route cookie from nginx
        assert web.get(cluster["url"] + "/", timeout=10).status_code == 200
    assert owner.cookies["cvlb_route"] != other.cookies["cvlb_route"]
    uploaded = owner.post(
        cluster["url"] + "/gradio_api/upload", files={"files": ("voice.wav", wav(4, 16000))}, timeout=30
    )
    assert uploaded.status_code == 200, uploaded.text
    assert state not in uploaded.text and not uploaded.json()[0].startswith("/"), uploaded.text
    url = cluster["url"] + "/gradio_api/file=" + uploaded.json()[0]
    assert owner.get(url, timeout=10).content == wav(4, 16000)  # the prompt player's preview
    for stranger in (other, session()):  # another visitor, and one without any cookie
        refused = stranger.get(url, timeout=10)
        assert refused.status_code == 404 and refused.json()["error"]["message"], refused.text
    # A synthesis from that prompt: its answer names no server path, and its file decodes.
    prompt = {"path": uploaded.json()[0], "meta": {"_type": "gradio.FileData"}}
    done = owner.post(
        cluster["url"] + "/gradio_api/run/generate",
        timeout=60,
        json={"data": ["Hello there.", "cross_lingual", prompt, "", "", None, 1.0, -1, False, None]},
    )
    assert done.status_code == 200 and state not in done.text, done.text
    result = done.json()["data"][0]
    assert not result["path"].startswith("/"), result
    audio, rate = soundfile.read(io.BytesIO(owner.get(result["url"], timeout=10).content))
    assert rate == 24000 and len(audio) > rate // 4


@pytest.mark.parametrize(
    "name, content, words",
    [
        pytest.param("prompt.wav", wav(4, 16000)[:30], "not audio", id="ui-prompt-truncated-wav"),
        pytest.param("prompt.wav", wav(4, 8000), "8000 Hz", id="ui-prompt-8000Hz"),
        pytest.param("prompt.wav", wav(4, 16000, silent=True), "silent", id="ui-prompt-silent"),
    ],
)
def test_ui_refuses_a_bad_prompt_audio_with_a_clear_error(cluster, tmp_path, name, content, words):
    from gradio_client import Client, handle_file
    from gradio_client.exceptions import AppError

    path = tmp_path / name
    path.write_bytes(content)
    client = Client(cluster["url"] + "/", verbose=False)
    with pytest.raises(AppError) as raised:
        # text, mode, prompt_audio, prompt_text, instruct_text, speaker, speed, seed, stream
        client.predict(
            "Hello there.", "cross_lingual", handle_file(str(path)), "", "", None, 1.0, -1, False, api_name="/generate"
        )
    message = str(raised.value)
    assert "prompt" in message.lower() and words in message, message
    assert "Traceback" not in message


def test_the_instance_stayed_up(cluster):
    code, body = status(cluster["state_dir"])
    assert {i["name"]: i["pid"] for i in body["instances"]} == cluster["instances"]
    assert [i["restarts"] for i in body["instances"]] == [0]
    assert code == 0, body
    log = (cluster["state_dir"] / "logs" / "instance-0.log").read_text(errors="replace")
    found = unexpected_tracebacks(log)
    assert found == [], f"{len(found)} traceback(s), the first:\n{found[0] if found else ''}"
