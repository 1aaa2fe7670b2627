"""The prober (cosyvoice_lb/launcher/health/probe.py) against real HTTP servers on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler

import pytest
from conftest import http_server

from cosyvoice_lb.launcher.health.probe import Probe, Prober, ProbeStatus, probe, read_ping

# --- probe() against a real HTTP server on 127.0.0.1 --------------------------------------


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    """requests honours *_PROXY variables: keep the probes on 127.0.0.1 whatever the env says."""
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


class Reply:
    def __init__(self):
        self.status, self.body, self.delay = 200, b"{}", 0.0
        self.paths: list[str] = []


@pytest.fixture
def server():
    """(port, reply): an HTTP server on 127.0.0.1 answering every GET with ``reply``."""
    reply = Reply()
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            reply.paths.append(self.path)
            if reply.delay:
                release.wait(reply.delay)
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)

        def log_message(self, *args):
            pass

    with http_server(Handler) as port:
        yield port, reply
        release.set()


@pytest.mark.parametrize(
    "status, body, expected",
    [
        (200, {"ready": True, "busy_seconds": 3}, Probe("ready", busy_seconds=3.0)),
        (200, {"ready": True, "busy_seconds": 0.25}, Probe("ready", busy_seconds=0.25)),
        (200, {"ready": True}, Probe("ready", busy_seconds=0.0)),
        (
            200,
            {"ready": True, "busy_seconds": 9, "stalled_seconds": [7.5, 0.2], "inflight": 2, "waiting": 1},
            Probe("ready", busy_seconds=9.0, stalled=(7.5, 0.2), inflight=2, waiting=1),
        ),
        (
            200,
            {"ready": True, "stalled_seconds": [0.0], "inflight": 1, "sessions": 1},
            Probe("ready", stalled=(0.0,), inflight=1, sessions=1),
        ),
        (
            200,
            {"ready": True, "stalled_seconds": "long"},
            Probe("failed", detail="/ping answered stalled_seconds='long', not a list of numbers"),
        ),
        (
            200,
            {"ready": True, "stalled_seconds": [1, True]},
            Probe("failed", detail="/ping answered stalled_seconds=[1, True], not a list of numbers"),
        ),
        (503, {"state": "loading"}, Probe("loading")),
        (
            503,
            {"state": "bad-audio", "error": "a canary synthesis made bad audio: silent"},
            Probe("bad_audio", detail="a canary synthesis made bad audio: silent"),
        ),
        (503, {"state": "bad-audio"}, Probe("bad_audio", detail="bad audio")),
        (200, {"ready": False, "state": "bad-audio"}, Probe("failed", detail="/ping answered 200")),
        (200, {"ready": False}, Probe("failed", detail="/ping answered 200")),
        (503, {"state": "draining"}, Probe("failed", detail="/ping answered 503")),
        (503, {"ready": True}, Probe("failed", detail="/ping answered 503")),
        (500, {"error": "boom"}, Probe("failed", detail="/ping answered 500")),
        (404, {}, Probe("failed", detail="/ping answered 404")),
        (200, b"OK, ready", Probe("failed", detail="/ping answered 200")),  # not JSON
        (503, b"loading...", Probe("failed", detail="/ping answered 503")),
        (500, b"", Probe("failed", detail="/ping answered 500")),
    ],
)
def test_probe_reads_the_answer(server, status, body, expected):
    port, reply = server
    reply.status, reply.body = status, body if isinstance(body, bytes) else json.dumps(body).encode()
    assert probe(port, timeout=2.0) == expected
    assert reply.paths == ["/ping"]


def test_probe_of_a_server_that_never_answers_fails_after_the_timeout(server):
    port, reply = server
    reply.delay = 5.0  # accepts the connection, then sits on the request
    started = time.monotonic()
    result = probe(port, timeout=0.3)
    assert time.monotonic() - started < 2.0
    assert result == Probe("failed", detail="/ping did not answer within 0.3s")


def test_probe_of_a_closed_port_fails():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # nothing listens there now
    assert probe(port, timeout=1.0) == Probe("failed", detail="/ping: ConnectionError")


@pytest.mark.parametrize(
    "body",
    [b"null", b"[]", b'"ready"', b'{"ready": true, "busy_seconds": null}', b'{"ready": true, "busy_seconds": "soon"}'],
)
def test_probe_of_an_odd_json_body_fails_cleanly(server, body):
    port, reply = server
    reply.body = body
    assert probe(port, timeout=2.0).status == "failed"


def test_probe_ignores_proxy_settings(server, monkeypatch):
    port, reply = server
    reply.body = json.dumps({"ready": True}).encode()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead_proxy = sock.getsockname()[1]
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{dead_proxy}")
    assert probe(port, timeout=2.0) == Probe("ready")


# --- recycling ------------------------------------------------------------------------------


def test_more_than_ten_instances_keep_their_connections_between_rounds():
    """A race: requests keeps ten connection pools; probed round-robin, twelve instances
    evicted each other's pools every round (a new connection per probe, and a window where
    a probe's pool is closed under it). Each instance must see one connection, reused."""
    connections: dict[int, int] = {}
    lock = threading.Lock()

    class KeepAlive(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self):
            super().setup()
            with lock:
                port = self.server.server_address[1]
                connections[port] = connections.get(port, 0) + 1

        def do_GET(self):
            body = json.dumps({"ready": True, "busy_seconds": 0.0, "stalled_seconds": []}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with ExitStack() as stack:
        ports = [stack.enter_context(http_server(KeepAlive)) for _ in range(12)]
        prober = Prober(len(ports))
        with ThreadPoolExecutor(max_workers=len(ports)) as pool:  # as the health loop probes
            for _ in range(5):
                results = list(pool.map(lambda port: prober.probe(port, 2.0), ports))
                assert [r.status for r in results] == ["ready"] * len(ports)
    assert connections == {port: 1 for port in ports}


def test_a_probe_status_is_a_member_even_when_given_as_text():
    assert read_ping(503, {"state": "loading"}).status is ProbeStatus.LOADING
    assert Probe("ready").status is ProbeStatus.READY and f"{Probe('bad_audio').status}" == "bad_audio"
    with pytest.raises(ValueError):
        Probe("asleep")
