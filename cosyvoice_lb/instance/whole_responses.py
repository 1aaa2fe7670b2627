"""Answers that leave whole: a response with a ``Content-Length`` goes to the socket in one
write, its head together with its body.

uvicorn writes a response's head on ``http.response.start`` and its body on
``http.response.body``: two writes, two system calls. An instance frozen (SIGSTOP) or killed
between them leaves nginx with a head and no body; nginx never passes a request to another
instance once it has an upstream's head, so its client gets a cut body. What the kernel took
in one ``send()`` is sent even while the process is frozen: with head and body in one write,
nginx gets the whole answer or nothing, and nothing (a timeout, a closed connection) it
tries on another instance.

Held back: a head with a ``Content-Length`` of at most ``HOLD_LIMIT`` bytes, until that many
bytes of body followed. Passed at once: everything else -- streamed (chunked) answers, whose
head must not wait for audio that is still being made, answers with no body (HEAD, 1xx,
204, 304), larger bodies, WebSocket frames. A connection closed with a head held back (the
app failed half-way) sends nothing of it: its client sees no answer rather than a cut one.

Standard library and uvicorn only: the instance's environment has no launcher packages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The largest answer held back whole (a minute of 24 kHz WAV is ~2.9 MB): beyond it the
# memory held per connection matters more than the rare freeze between two writes.
HOLD_LIMIT = 16 * 1024 * 1024

_NO_BODY = {204, 304}


def body_to_come(data: bytes, method: str, limit: int = HOLD_LIMIT) -> int:
    """Bytes of body still to come after ``data`` when ``data`` starts with a response head
    that should wait for its body; 0 when it should go at once (not a head, no or too large
    a ``Content-Length``, chunked, or an answer without a body)."""
    if not data.startswith(b"HTTP/1.") or method == "HEAD":
        return 0
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return 0
    lines = bytes(data[:end]).split(b"\r\n")
    status = lines[0].split(b" ", 2)
    if len(status) < 2 or not status[1].isdigit():
        return 0
    code = int(status[1])
    if code < 200 or code in _NO_BODY:
        return 0
    length = -1
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding":
            return 0
        if name == b"content-length" and value.strip().isdigit():
            length = int(value.strip())
    if length < 0 or length > limit:
        return 0
    return max(0, length - (len(data) - end - 4))


class WholeResponses:
    """A transport that holds a response's head back until its body is there, then writes
    both at once (see the module's docstring); all else goes to the real transport."""

    def __init__(self, transport: Any, method: Callable[[], str], limit: int = HOLD_LIMIT) -> None:
        self._transport = transport
        self._method = method
        self._limit = limit
        self._held: list[bytes] = []
        self._to_come = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._held:
            self._held.append(bytes(data))
            self._to_come -= len(data)
            if self._to_come <= 0:
                whole, self._held = b"".join(self._held), []
                self._transport.write(whole)
            return
        # (a body chunk is passed on without a copy; only what starts like a head is read)
        to_come = body_to_come(bytes(data), self._method(), self._limit) if data[:7] == b"HTTP/1." else 0
        if to_come:
            self._held, self._to_come = [bytes(data)], to_come
        else:
            self._transport.write(data)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def held(self) -> int:
        """Bytes held back now (0 between answers)."""
        return sum(map(len, self._held))

    def close(self) -> None:
        self._held = []  # (half an answer: better none, which nginx can try elsewhere)
        self._transport.close()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def whole_response_protocol(base: type) -> type:
    """``base`` (one of uvicorn's HTTP protocols) writing through :class:`WholeResponses`."""

    class WholeResponseProtocol(base):
        def connection_made(self, transport: Any) -> None:
            def method() -> str:
                scope = getattr(self, "scope", None)  # (the request being answered)
                return str(scope.get("method", "")) if scope else ""

            super().connection_made(WholeResponses(transport, method))

    WholeResponseProtocol.__name__ = f"Whole{base.__name__}"
    return WholeResponseProtocol


def http_protocol() -> type:
    """uvicorn's ``http=`` for the instances: what uvicorn's "auto" picks (httptools when
    installed, else h11), sending whole answers."""
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]
    return whole_response_protocol(base)
