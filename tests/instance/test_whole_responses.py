"""Answers leave whole: uvicorn's own HTTP protocol, with the instance's transport wrapper,
answering requests fed to it byte for byte, and a transport that records each write (one
write is one ``send()``: what the kernel took is sent even if the process then freezes)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from cosyvoice_lb.instance.whole_responses import WholeResponses, body_to_come, http_protocol, whole_response_protocol

WAV = b"RIFF" + bytes(range(256)) * 261  # ~66 KB, the size of the answer once cut in CI


class RecordingTransport:
    """Enough of an asyncio transport for uvicorn's protocols; keeps every write apart."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        if data:  # (asyncio makes no system call for an empty write)
            self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8001)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_protocol(self, protocol: Any) -> None:
        pass


async def streamed():
    yield b"first"
    await asyncio.sleep(0.05)  # (the next chunk is still being made)
    yield b"second"


async def failing():
    yield b"half"
    raise RuntimeError("the synthesis failed half-way")


async def wav(request):
    return Response(WAV, media_type="audio/wav")


async def empty(request):
    return Response(status_code=204)


async def stream(request):
    return StreamingResponse(streamed(), media_type="audio/wav")


async def stream_fails(request):
    return StreamingResponse(failing(), media_type="audio/wav")


async def cut_route(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"100")]})
    await send({"type": "http.response.body", "body": b"x" * 40, "more_body": True})
    raise RuntimeError("gone before the rest of the body")


APP = Starlette(
    routes=[
        Route("/wav", wav, methods=["GET", "HEAD"]),
        Route("/empty", empty),
        Route("/stream", stream),
        Route("/stream-fails", stream_fails),
    ]
)


async def app_with_cut(scope, receive, send):
    if scope["type"] == "http" and scope["path"] == "/cut":
        return await cut_route(scope, receive, send)
    return await APP(scope, receive, send)


def protocols() -> list[type]:
    found = [whole_response_protocol(H11Protocol)]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # (httptools is not installed: the instance runs h11 then)
        return found
    return [*found, whole_response_protocol(HttpToolsProtocol)]


async def exchange(protocol_class: type, request: bytes, settle: float = 0.3) -> RecordingTransport:
    """One request through the real protocol; the writes it made once the answer is out."""
    config = uvicorn.Config(app=app_with_cut, http=protocol_class, log_level="critical", lifespan="off")
    config.load()
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = RecordingTransport()
    protocol.connection_made(transport)
    protocol.data_received(request)
    deadline = asyncio.get_running_loop().time() + 5
    while asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
        if protocol.cycle is not None and protocol.cycle.response_complete or transport.closed:
            break
    await asyncio.sleep(settle)
    protocol.connection_lost(None)
    return transport


def get(path: str, method: str = "GET") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()


@pytest.mark.parametrize("protocol_class", protocols(), ids=lambda c: c.__name__)
def test_a_non_streamed_answer_leaves_in_one_write(protocol_class):
    transport = asyncio.run(exchange(protocol_class, get("/wav")))
    assert len(transport.writes) == 1, [len(w) for w in transport.writes]
    head, _, body = transport.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert f"content-length: {len(WAV)}".encode() in head.lower()
    assert body == WAV


@pytest.mark.parametrize("protocol_class", protocols(), ids=lambda c: c.__name__)
def test_plain_uvicorn_writes_head_and_body_apart(protocol_class):
    """The window itself: without the wrapper the head goes alone, first."""
    plain = protocol_class.__mro__[1]
    transport = asyncio.run(exchange(plain, get("/wav")))
    assert len(transport.writes) >= 2
    assert transport.writes[0].endswith(b"\r\n\r\n")


@pytest.mark.parametrize("protocol_class", protocols(), ids=lambda c: c.__name__)
def test_a_streamed_answer_still_streams_and_a_failed_one_has_no_last_chunk(protocol_class):
    transport = asyncio.run(exchange(protocol_class, get("/stream")))
    assert transport.writes[0].endswith(b"\r\n\r\n") and b"transfer-encoding: chunked" in transport.writes[0].lower()
    assert b"first" in transport.writes[1] and all(b"second" not in w for w in transport.writes[:2])
    assert transport.writes[-1] == b"0\r\n\r\n"

    failed = asyncio.run(exchange(protocol_class, get("/stream-fails")))
    assert b"".join(failed.writes).endswith(b"half\r\n"), failed.writes  # no terminating chunk
    assert failed.closed


@pytest.mark.parametrize("protocol_class", protocols(), ids=lambda c: c.__name__)
def test_an_answer_failing_after_its_head_sends_nothing(protocol_class):
    """No half answer: nginx sees a closed connection and tries another instance."""
    transport = asyncio.run(exchange(protocol_class, get("/cut")))
    assert transport.writes == [] and transport.closed


@pytest.mark.parametrize("protocol_class", protocols(), ids=lambda c: c.__name__)
def test_answers_without_a_body_go_at_once(protocol_class):
    head = asyncio.run(exchange(protocol_class, get("/wav", "HEAD")))
    assert len(head.writes) == 1 and head.writes[0].endswith(b"\r\n\r\n")
    assert f"content-length: {len(WAV)}".encode() in head.writes[0].lower()
    empty = asyncio.run(exchange(protocol_class, get("/empty")))
    assert empty.writes[0].startswith(b"HTTP/1.1 204")


def test_body_to_come_reads_the_head():
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n"
    assert body_to_come(head, "GET") == 10
    assert body_to_come(head + b"abc", "POST") == 7
    assert body_to_come(head + b"0123456789", "GET") == 0  # already whole
    assert body_to_come(head, "HEAD") == 0
    assert body_to_come(head, "GET", limit=9) == 0  # too large to hold
    assert body_to_come(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", "GET") == 0
    assert body_to_come(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n", "GET") == 0
    assert body_to_come(b"HTTP/1.1 304 Not Modified\r\ncontent-length: 5\r\n\r\n", "GET") == 0
    assert body_to_come(b"HTTP/1.1 200 OK\r\n", "GET") == 0  # not a whole head
    assert body_to_come(b"5\r\nhello\r\n", "GET") == 0


def test_the_wrapper_passes_the_rest_through_and_keeps_answers_apart():
    transport = RecordingTransport()
    whole = WholeResponses(transport, lambda: "GET")
    whole.write(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\n")
    whole.write(b"abc")
    assert transport.writes == [] and whole.held() > 0
    whole.write(memoryview(b"def"))
    whole.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nz")  # the next answer, whole already
    assert transport.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nabcdef", transport.writes[1]]
    assert whole.held() == 0 and whole.get_extra_info("peername") == ("127.0.0.1", 50000)


def test_the_instance_uses_the_protocol_uvicorn_would_pick():
    chosen = http_protocol()
    try:
        import httptools  # noqa: F401

        expected = "HttpToolsProtocol"
    except ImportError:
        expected = "H11Protocol"
    assert chosen.__mro__[1].__name__ == expected


def test_the_instances_server_is_built_with_it():
    from cosyvoice_lb.instance.lifetime import draining_server
    from cosyvoice_lb.instance.speech.admission import Admission

    server = draining_server(uvicorn.Config(app=APP), Admission(), drain_timeout=1.0)
    assert server.config.http.__name__ == http_protocol().__name__
    server.config.load()
    assert server.config.http_protocol_class is server.config.http
