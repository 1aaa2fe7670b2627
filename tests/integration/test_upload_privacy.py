"""A prompt upload stays its sender's across a restart of the instance: a one-instance cluster
of the cloning CosyVoice3 contract fake behind nginx; a browser session uploads, the instance
restarts (a new process, the same state dir), and the records on disk decide who gets the file:
its sender, for its hour; nobody else; nobody for an unknown path, an upload from before the
records, or an expired one. A result is served to whoever has its link, while it lasts."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import soundfile
from conftest import FAKE_COSYVOICE3, clean_env, cli, simulated_cluster, status, unexpected_tracebacks, wait_for

from cosyvoice_lb.instance.ui.owners import RECORDS, key_of

pytest.importorskip("torch", reason="the contract fake yields torch tensors, like upstream")


@pytest.fixture(scope="module")
def cluster():
    chunks = clean_env(FAKE_COSYVOICE_CHUNK_SECONDS="0.05")
    with simulated_cluster("--host", "127.0.0.1", instances=1, engine=FAKE_COSYVOICE3, env=chunks, timeout=300) as up:
        yield up


def session() -> requests.Session:
    web = requests.Session()
    web.trust_env = False  # (loopback: no proxy from the environment)
    return web


def wav(seconds: float, rate: int) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buffer = io.BytesIO()
    soundfile.write(buffer, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


def the_instance(state_dir: Path) -> dict:
    return status(state_dir)[1]["instances"][0]


def refused(answer: requests.Response) -> bool:
    return answer.status_code == 404 and "no such file" in answer.json()["error"]["message"]


def test_an_upload_is_its_senders_after_a_restart_and_nobody_elses(cluster):
    url, state_dir = cluster["url"], cluster["state_dir"]
    owner, other = session(), session()
    for web in (owner, other):  # each gets its own route cookie from nginx
        assert web.get(url + "/", timeout=10).status_code == 200
    voice = wav(4, 16000)
    uploaded = owner.post(url + "/gradio_api/upload", files={"files": ("voice.wav", voice)}, timeout=30)
    assert uploaded.status_code == 200, uploaded.text
    path = uploaded.json()[0]
    prompt = {"path": path, "meta": {"_type": "gradio.FileData"}}
    done = owner.post(
        url + "/gradio_api/run/generate",
        timeout=60,
        json={"data": ["Hello there.", "cross_lingual", prompt, "", "", None, 1.0, -1, False, None]},
    )
    assert done.status_code == 200, done.text
    result = done.json()["data"][0]["url"]
    made = owner.get(result, timeout=10).content
    assert other.get(result, timeout=10).content == made  # a result: served to whoever has its link
    # An upload from before records were kept: in Gradio's folder, with no record.
    name = the_instance(state_dir)["name"]
    folder = (state_dir / "run" / "gradio" / name).resolve()
    assert (folder / path.split("/", 1)[1]).read_bytes() == voice, "the upload is not where Gradio keeps files"
    legacy = folder / ("0" * 64) / "voice.wav"
    legacy.parent.mkdir()
    legacy.write_bytes(voice)

    before = the_instance(state_dir)
    assert cli("restart", name, "--state-dir", str(state_dir)).returncode == 0
    assert wait_for(
        lambda: (lambda i: i["pid"] != before["pid"] and i["ready"] and i["in_rotation"])(the_instance(state_dir)),
        timeout=60,
    ), "the instance did not come back"

    file_url = url + "/gradio_api/file=" + path
    assert owner.get(file_url, timeout=10).content == voice  # the prompt player's preview, after the restart
    for stranger in (other, session()):  # another visitor, and one without any cookie
        assert refused(stranger.get(file_url, timeout=10))
        assert refused(stranger.get(url + "/gradio_api/file=files/" + "0" * 64 + "/voice.wav", timeout=10))
    assert refused(owner.get(url + "/gradio_api/file=files/" + "0" * 64 + "/voice.wav", timeout=10))  # no record
    assert refused(owner.get(url + "/gradio_api/file=files/" + "f" * 64 + "/voice.wav", timeout=10))  # unknown
    assert refused(owner.get(url + "/gradio_api/file=files/" + RECORDS + "/x", timeout=10))
    assert refused(other.get(result, timeout=10))  # (Gradio deletes its results when an instance stops)

    # Its hour over (the record says when it was granted): a 404 for its sender too.
    record = folder / RECORDS / path.split("/", 1)[1] / key_of(owner.cookies["cvlb_route"])
    assert record.is_file() and oct(record.stat().st_mode & 0o777) == "0o600"
    record.write_text(f"{time.time() - 3601:.3f}\n")
    assert refused(owner.get(file_url, timeout=10))
    assert legacy.exists() and (folder / path.split("/", 1)[1]).exists()

    log = (state_dir / "logs" / f"{name}.log").read_text(errors="replace")
    found = unexpected_tracebacks(log)
    assert found == [], f"{len(found)} traceback(s), the first:\n{found[0] if found else ''}"
    assert not any(os.sep + "tmp" + os.sep in p for p in (path, result.split("file=", 1)[1]))
