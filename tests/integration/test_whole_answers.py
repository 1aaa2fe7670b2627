"""No half answers, through a real nginx: every non-streamed answer carries a
``Content-Length`` (a cut body is an error the client library raises), a streamed one is
chunked (cut, it lacks the last chunk), and servers frozen under load with the instances'
HTTP protocol leave no client with a cut body (bench/whole_responses.py's fault run)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import requests
from conftest import simulated_cluster

ROOT = Path(__file__).resolve().parents[2]


def assert_whole(reply: requests.Response) -> None:
    assert "transfer-encoding" not in reply.headers, reply.headers
    assert int(reply.headers["content-length"]) == len(reply.content) > 0


def test_non_streamed_answers_have_a_content_length_and_streamed_ones_are_chunked():
    with simulated_cluster() as cluster, requests.Session() as web:
        url = cluster["url"]
        tts = web.post(url + "/v1/tts", json={"text": "Hello there."}, timeout=60)
        assert tts.status_code == 200 and tts.headers["content-type"].startswith("audio/wav"), tts.text
        assert_whole(tts)
        models = web.get(url + "/v1/models", timeout=10)
        assert models.status_code == 200
        assert_whole(models)
        bad = web.post(url + "/v1/tts", json={"speed": 1.0}, timeout=60)  # (no text: a 400)
        assert bad.status_code == 400
        assert_whole(bad)
        ping = web.get(url + "/ping", timeout=10)
        assert_whole(ping)
        streamed = web.post(url + "/v1/tts", json={"text": "Hello there.", "stream": True}, stream=True, timeout=60)
        assert streamed.status_code == 200
        assert streamed.headers.get("transfer-encoding") == "chunked" and "content-length" not in streamed.headers
        assert streamed.content[:4] == b"RIFF"
        # (the OpenAI route always streams, as OpenAI's does)
        openai = {"model": "tts-1", "input": "Hi.", "voice": "nova"}
        streamed = web.post(url + "/v1/audio/speech", json=openai, stream=True, timeout=60)
        assert streamed.status_code == 200 and streamed.headers.get("transfer-encoding") == "chunked"
        assert len(streamed.content) > 0


def test_frozen_servers_leave_no_cut_body():
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench/whole_responses.py"), "--requests", "30", "--repeats", "1"]
        + ["--fault-seconds", "15"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    row = re.search(r"^\| whole \| +(\d+) \| +(\d+) \| +(\d+) \| +(\d+) \| (.*) \|$", done.stdout, re.M)
    assert row, done.stdout
    freezes, whole, cut = map(int, row.groups()[:3])
    assert freezes >= 20 and whole > 100
    assert cut == 0, done.stdout  # (a 504 now and then is both servers frozen in turn: seen, not cut)
