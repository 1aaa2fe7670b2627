"""bench/load.py against a small HTTP server on 127.0.0.1: what it counts and measures."""

from __future__ import annotations

import sys
import time
from http.server import BaseHTTPRequestHandler

import pytest
from conftest import ROOT, http_server

sys.path.insert(0, str(ROOT / "bench"))
import load  # noqa: E402


@pytest.fixture
def server():
    """POST answers 200 after 20 ms, or 503 when the body says so; (url, bodies seen)."""
    seen: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(body)
            time.sleep(0.02)
            status = 503 if b"refuse" in body else 200
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    with http_server(Handler) as port:
        yield f"http://127.0.0.1:{port}/v1/tts", seen


def test_open_loop_sends_poisson_arrivals_at_the_rate_and_times_every_request(server):
    url, seen = server
    results = load.run(load.open_loop(url, rate=200, seconds=0.5, make=lambda rng: ("short", {"text": "hi"}), seed=3))
    assert 70 <= len(results) <= 130 and len(seen) == len(results)  # ~100 arrivals expected
    assert all(r.status == 200 and r.kind == "short" and r.latency >= 0.02 for r in results)
    starts = sorted(r.start for r in results)
    assert starts[-1] <= 0.5 and max(b - a for a, b in zip(starts, starts[1:])) > 0  # spread, not a burst
    again = load.run(load.open_loop(url, rate=200, seconds=0.5, make=lambda rng: ("short", {"text": "hi"}), seed=3))
    assert sorted(r.start for r in again) == pytest.approx(starts)  # same seed, same arrival times


def test_summary_counts_failures_and_takes_percentiles_of_the_successes(server):
    url, _ = server
    results = load.run(
        load.open_loop(
            url,
            rate=40,
            seconds=1.0,
            seed=5,
            make=lambda rng: ("x", {"text": "refuse" if rng.random() < 0.5 else "hi"}),
        )
    )
    summary = load.Summary.of(results, 1.0)
    refused = sum(r.status == 503 for r in results)
    assert refused and summary.failed == refused and summary.ok == len(results) - refused
    assert summary.p50_ms >= 20 and summary.p50_ms <= summary.p95_ms <= summary.p99_ms


def test_closed_loop_is_bounded_by_its_request_count(server):
    url, seen = server
    results, took = load.run(load.closed_loop(url, concurrency=2, seconds=30, body={"text": "hi"}, max_requests=10))
    assert len(results) == 10 == len(seen) and took < 5


def test_only_loopback():
    with pytest.raises(ValueError, match="127.0.0.1 only"):
        load.loopback_only("http://example.com/v1/tts")
