"""The job runner's HTTP side for real: a segment sent to a local HTTP server that answers as
the balancer does (streamed wav, busy, poison, not audio, hangs, cuts off) and what each
answer becomes (the audio, or a SegmentError that says whether to retry)."""

from __future__ import annotations

import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler

import numpy as np
import pytest
import soundfile
from conftest import free_port_block, http_server

from cosyvoice_lb.instance.audio.formats import Encoder
from cosyvoice_lb.jobs.sender import NO_ANSWER, SegmentError, Sender, body_of

PARAMS = {"voice": "alloy", "response_format": "mp3", "speed": 1.0, "seed": 99, "instructions": "calm", "x": 1}
RELEASE = threading.Event()  # hanging handlers wait on it (set at each test's end)
SEEN: list[dict] = []


def streamed_wav(samples: int = 2400) -> bytes:
    """What /v1/audio/speech streams for response_format wav: a header of unknown sizes."""
    encoder = Encoder("wav", 24000)
    return encoder.feed(np.full(samples, 0.25, dtype=np.float32)) + encoder.finish()


class Balancer(BaseHTTPRequestHandler):
    """Answers by the segment's text (``input``): the case each test asks for."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        SEEN.append({"path": self.path, "body": body, "auth": self.headers.get("authorization")})
        getattr(self, "case_" + body["input"].split()[0])()

    def answer(self, status: int, data: bytes, kind: str = "application/json", **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(data)

    def error(self, status: int, message: str, **headers: str) -> None:
        self.answer(status, json.dumps({"error": {"message": message}}).encode(), **headers)

    def chunked(self, pieces: list[bytes], end: bool = True) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "audio/wav")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for piece in pieces:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.flush()
        if end:
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.close_connection = True

    def case_audio(self) -> None:
        wav = streamed_wav()
        self.chunked([wav[:1000], wav[1000:]])

    def case_busy(self) -> None:
        self.error(503, "every instance is busy", Retry_After="2")

    def case_final(self) -> None:
        self.error(503, "draining", X_Should_Retry="false")

    def case_poison(self) -> None:
        self.error(422, "this request killed instances twice: it is refused")

    def case_junk(self) -> None:
        self.answer(200, b"<html>not audio</html>", "text/html")

    def case_hang(self) -> None:
        RELEASE.wait(5)

    def case_stall(self) -> None:  # headers and a first piece, then nothing
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.write(b"10\r\n" + b"R" * 16 + b"\r\n")
        self.wfile.flush()
        RELEASE.wait(5)

    def case_cut(self) -> None:  # a stream broken off mid-way (the instance died)
        wav = streamed_wav()
        self.chunked([wav[:1000]], end=False)


@pytest.fixture
def balancer():
    SEEN.clear()
    RELEASE.clear()
    with http_server(Balancer) as port:
        try:
            yield port
        finally:
            RELEASE.set()


def failure(sender: Sender, text: str) -> SegmentError:
    with pytest.raises(SegmentError) as caught:
        sender(PARAMS, text, 7)
    return caught.value


def test_body_is_the_jobs_request_with_the_segment_and_the_seed():
    body = body_of(PARAMS, "Hello there.", 123)
    assert body == {
        "voice": "alloy",
        "instructions": "calm",
        "speed": 1.0,
        "input": "Hello there.",
        "response_format": "wav",
        "seed": 123,
    }
    assert "seed" not in body_of({"voice": "alloy"}, "Hi.", None)


def test_200_streamed_wav_comes_back_as_its_bytes(balancer):
    sender = Sender(f"http://127.0.0.1:{balancer}/", headers={"Authorization": "Bearer jobs-token"}, timeout=5)
    try:
        data = sender(PARAMS, "audio please", 7)
    finally:
        sender.close()
    assert data == streamed_wav()
    audio, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    assert rate == 24000 and audio.size == 2400
    [seen] = SEEN
    assert seen["path"] == "/v1/audio/speech" and seen["auth"] == "Bearer jobs-token"
    assert seen["body"]["input"] == "audio please" and seen["body"]["response_format"] == "wav"
    assert seen["body"]["seed"] == 7 and seen["body"]["voice"] == "alloy" and "x" not in seen["body"]


def test_busy_is_retryable_with_its_retry_after(balancer):
    error = failure(Sender(f"http://127.0.0.1:{balancer}", timeout=5), "busy now")
    assert (error.status, error.retryable, error.retry_after) == (503, True, 2.0)
    assert str(error) == "every instance is busy"


def test_an_answer_that_says_do_not_retry_is_final(balancer):
    error = failure(Sender(f"http://127.0.0.1:{balancer}", timeout=5), "final answer")
    assert (error.status, error.retryable) == (503, False)


def test_poison_is_not_retried(balancer):
    error = failure(Sender(f"http://127.0.0.1:{balancer}", timeout=5), "poison words")
    assert (error.status, error.retryable) == (422, False)
    assert "killed instances" in str(error)


def test_a_200_that_is_not_audio_is_bad_audio_retried(balancer):
    error = failure(Sender(f"http://127.0.0.1:{balancer}", timeout=5), "junk body")
    assert (error.status, error.retryable) == (502, True)
    assert "not a sound file" in str(error)


@pytest.mark.parametrize("case", ["hang", "stall"])
def test_no_whole_answer_in_time_is_a_timeout_not_retried(balancer, case):
    started = time.monotonic()
    error = failure(Sender(f"http://127.0.0.1:{balancer}", timeout=0.3), f"{case} forever")
    assert time.monotonic() - started < 2.0
    assert (error.status, error.retryable) == (504, False)
    assert "--segment-chars" in str(error)


def test_a_stream_cut_off_midway_is_retried(balancer):
    error = failure(Sender(f"http://127.0.0.1:{balancer}", timeout=5), "cut short")
    assert (error.status, error.retryable) == (NO_ANSWER, True)


def test_nothing_listening_is_retried():
    port = free_port_block(1)
    error = failure(Sender(f"http://127.0.0.1:{port}", timeout=2), "anyone there")
    assert (error.status, error.retryable) == (NO_ANSWER, True)
    assert "did not answer" in str(error)


def test_a_url_that_is_not_http_is_refused():
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        Sender("127.0.0.1:8080")
