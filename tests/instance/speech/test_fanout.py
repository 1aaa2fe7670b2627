"""The long-text coordinator against a real HTTP server on 127.0.0.1 standing in for nginx:
order, parallelism, one seed, retries of what a retry can change, and nothing else."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler

import numpy as np
import pytest
import soundfile
from conftest import http_server

from cosyvoice_lb.instance.speech.admission import TimedOut
from cosyvoice_lb.instance.speech.fanout import SEGMENT_HEADER, Balancer, FanOut, SegmentFailed, blocking


def wav(value: float, samples: int) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, np.full(samples, value, dtype=np.float32), 16000, format="WAV", subtype="FLOAT")
    return out.getvalue()


class Balancer503(BaseHTTPRequestHandler):
    """Answers a segment with a WAV whose value is its index; scripted failures per index."""

    seen: list[dict] = []
    failures: dict[int, list[int]] = {}  # index -> statuses to answer first
    delay = 0.0
    lock = threading.Lock()
    inflight = 0
    most = 0

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        index = int(self.headers[SEGMENT_HEADER].split("/")[0]) - 1
        cls = type(self)
        with cls.lock:
            cls.seen.append({"index": index, **body, "auth": self.headers.get("authorization")})
            cls.inflight += 1
            cls.most = max(cls.most, cls.inflight)
            status = cls.failures.get(index, []).pop(0) if cls.failures.get(index) else 200
        time.sleep(cls.delay * (3 if index == 0 else 1))  # the first segment is the slowest
        with cls.lock:
            cls.inflight -= 1
        if status == 200:
            data = wav(index / 10, 160)
            self.send_response(200)
            self.send_header("content-type", "audio/wav")
        else:
            data = json.dumps({"error": {"message": f"scripted {status}"}}).encode()
            self.send_response(status)
            if status == 422:
                self.send_header("x-should-retry", "false")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except BrokenPipeError:  # the coordinator went away (cancelled)
            pass


@pytest.fixture
def balancer():
    Balancer503.seen, Balancer503.failures, Balancer503.delay, Balancer503.most = [], {}, 0.0, 0
    with http_server(Balancer503) as port:
        yield f"http://127.0.0.1:{port}"


def run(url: str, segments: list[str], parallel: int = 2, deadline: float | None = None, **payload):
    fanout = FanOut(Balancer(url, parallel, 100), time.monotonic, backoff=0.01)

    async def go():
        return [a async for a in fanout.audio(segments, payload, None, {"authorization": "Bearer t"}, deadline)]

    return asyncio.run(go())


def test_segments_come_back_in_order_with_one_seed_at_most_parallel_at_once(balancer):
    Balancer503.delay = 0.05
    out = run(balancer, [f"segment {i}." for i in range(6)], parallel=2, voice="narrator")
    assert [round(float(a[0]) * 10) for a in out] == list(range(6))  # in order, though the first was slowest
    assert Balancer503.most == 2
    seeds = {s["seed"] for s in Balancer503.seen}
    assert len(seeds) == 1 and isinstance(seeds.pop(), int)
    assert all(s["voice"] == "narrator" and s["stream"] is False for s in Balancer503.seen)
    assert all(s["auth"] == "Bearer t" for s in Balancer503.seen)  # the client's credentials
    assert sorted(s["index"] for s in Balancer503.seen) == list(range(6))  # each sent once


def test_the_clients_seed_is_kept(balancer):
    run(balancer, ["a.", "b."], seed=7)
    assert {s["seed"] for s in Balancer503.seen} == {7}


def test_a_segment_nobody_could_take_is_retried_and_nothing_else_is(balancer):
    Balancer503.failures = {1: [503, 502]}
    out = run(balancer, ["a.", "b.", "c."])
    assert len(out) == 3
    assert [s["index"] for s in Balancer503.seen].count(1) == 3
    assert [s["index"] for s in Balancer503.seen].count(0) == 1


def test_retries_are_bounded_then_the_answer_is_the_segments(balancer):
    Balancer503.failures = {0: [503, 503, 503, 503]}
    with pytest.raises(SegmentFailed, match="segment 1 of 2.*scripted 503") as failed:
        run(balancer, ["a.", "b."])
    assert failed.value.status == 503


def test_a_permanent_failure_is_not_retried(balancer):
    Balancer503.failures = {1: [422]}
    with pytest.raises(SegmentFailed, match="scripted 422") as failed:
        run(balancer, ["a.", "b.", "c."])
    assert failed.value.status == 422 and failed.value.headers == {"x-should-retry": "false"}
    assert [s["index"] for s in Balancer503.seen].count(1) == 1


def test_the_request_deadline_bounds_the_whole(balancer):
    Balancer503.delay = 0.5
    with pytest.raises(TimedOut, match="request timeout"):
        run(balancer, ["a.", "b.", "c.", "d."], parallel=1, deadline=time.monotonic() + 0.8)


def test_no_balancer_answering_is_a_bad_gateway_after_retries():
    with pytest.raises(SegmentFailed, match="did not answer") as failed:
        run("http://127.0.0.1:9", ["a."])
    assert failed.value.status == 502


def test_a_retry_keeps_its_place_before_later_segments(balancer):
    Balancer503.failures = {0: [503]}
    run(balancer, ["a.", "b.", "c."], parallel=1)
    assert [s["index"] for s in Balancer503.seen] == [0, 0, 1, 2]


@pytest.mark.parametrize("status", [504, 500, 422, 413])
def test_what_a_retry_cannot_change_is_sent_once(balancer, status):
    # (504: the segment's synthesis ran out of time; it may hang any model it is sent to)
    Balancer503.failures = {0: [status]}
    with pytest.raises(SegmentFailed, match=f"scripted {status}"):
        run(balancer, ["a.", "b."], parallel=1)
    assert [s["index"] for s in Balancer503.seen] == [0]


def test_segments_run_only_a_few_ahead_of_the_reader(balancer):
    fanout = FanOut(Balancer(balancer, 1, 100), time.monotonic, backoff=0.01)

    async def go():
        source = fanout.audio([f"s{i}." for i in range(8)], {}, None, {}, None)
        first = await source.__anext__()
        await asyncio.sleep(0.3)  # a slow reader: only 2 x parallel segments may be done meanwhile
        started = len(Balancer503.seen)
        await source.aclose()
        return first, started

    first, started = asyncio.run(go())
    assert first.size and started == 3  # the one taken, and two ahead


def test_a_long_text_driven_from_a_thread_is_closed_from_a_running_loop(balancer):
    # Gradio closes a handler's generator from its own event loop's thread
    Balancer503.delay = 0.05
    fanout = FanOut(Balancer(balancer, 1, 100), time.monotonic, backoff=0.01)
    pieces = blocking(lambda: fanout.audio([f"s{i}." for i in range(6)], {}, None, {}, None))
    assert next(pieces).size

    async def close_from_a_loop():
        pieces.close()

    asyncio.run(close_from_a_loop())
    time.sleep(0.3)
    assert len(Balancer503.seen) <= 4  # the rest were never sent: the source was closed
