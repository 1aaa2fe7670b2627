"""Gradio's upload and file routes, kept to what the UI needs: prompt audio in, results out.

Gradio would take any file at ``/gradio_api/upload``, serve it back to anyone at
``/gradio_api/file=<path>`` and name its absolute temp dir in every answer. This ASGI
middleware, in front of the mounted UI:

* takes uploads only where the UI has a prompt audio input (only audio, by its first bytes,
  up to the prompt size limit) or a long-form .txt input (only a .txt that starts as UTF-8
  text, up to its own limit); anything else is a 4xx JSON answer;
* serves an upload back only to the session that sent it (nginx's route cookie), for the
  prompt player's preview, for an hour; a result once an answer named it; any other file in
  Gradio's folder to nobody. Who may fetch what is kept on disk (``owners.py``), so it holds
  after the instance restarts;
* spells Gradio's temp dir as a short relative marker in what goes out, and back in what
  comes in, so no answer names a path of the server.

Instance side: standard library and starlette.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from urllib.parse import unquote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosyvoice_lb.common.error_body import refusal
from cosyvoice_lb.instance.access.gate import cookie
from cosyvoice_lb.instance.ui.owners import FileOwners

API = "/gradio_api"
ROUTE_COOKIE = "cvlb_route"  # nginx's sticky key: one per browser or gradio_client
MULTIPART_SLACK = 64 * 1024  # a multipart body's boundaries and headers around the file
MARKER = "files/"  # how Gradio's folder is spelled outward: the same across restarts, naming nothing
REFUSED = ("/process_recording", "/proxy=")  # Gradio routes this UI never uses
FORMATS = "WAV, MP3, FLAC, OGG, WebM, M4A or AIFF"
REWRITTEN_TYPES = (b"application/json", b"text/")


def is_audio(head: bytes) -> bool:
    """Whether a file's first bytes are those of an audio container browsers or soundfile read."""
    return (
        (head[:4] == b"RIFF" and head[8:12] == b"WAVE")
        or head[:3] == b"ID3"
        or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0)  # MPEG/AAC frame sync
        or head[:4] in (b"OggS", b"fLaC", b"\x1aE\xdf\xa3")
        or head[4:8] == b"ftyp"
        or (head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"))
    )


def is_text(name: str, head: bytes) -> bool:
    """Whether an upload is a .txt whose first bytes are UTF-8 text (a character cut at the
    end of ``head`` is fine; a NUL byte is not text)."""
    if not name.lower().endswith(".txt") or b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


def file_parts(body: bytes, content_type: str) -> list[tuple[str, bytes]] | None:
    """(file name, first bytes) of each file in a multipart body; None when it is not one."""
    found = re.search(r'boundary="?([^";]+)"?', content_type)
    if "multipart/form-data" not in content_type or not found:
        return None
    parts = []
    for part in body.split(b"--" + found.group(1).encode("latin-1"))[1:]:
        head, _, data = part.partition(b"\r\n\r\n")
        name = re.search(rb'filename="([^"]*)"', head)
        if name is not None:
            parts.append((name.group(1).decode("utf-8", "replace"), data[:16]))
    return parts


def route_of(headers: dict[str, str]) -> str:
    return cookie(headers, ROUTE_COOKIE)


async def refuse(send: Send, status: int, message: str) -> None:
    for message_out in refusal(status, message):
        await send(message_out)


class GradioFiles:
    """ASGI middleware for Gradio's file routes (see the module's docstring). ``folder``:
    Gradio's upload and cache dir; ``max_bytes``: the largest prompt audio; ``uploads``:
    whether the UI takes prompt audio at all; ``texts``: the largest .txt it takes (0: none);
    ``keep``: Gradio's set of files its clean-up leaves (it deletes all the others when the
    process stops): each upload goes in, left to its records' expiry; ``owners``: the records."""

    def __init__(
        self,
        app: ASGIApp,
        folder: str,
        max_bytes: int,
        uploads: bool,
        texts: int = 0,
        keep: set[str] | None = None,
        owners: FileOwners | None = None,
    ):
        self.app, self.max_bytes, self.uploads, self.texts = app, max_bytes, uploads, texts
        # (Gradio's folder and its resolved spelling: answers may name either)
        self.prefixes = sorted({os.path.join(os.path.abspath(folder), ""), os.path.join(os.path.realpath(folder), "")})
        self.marker = MARKER
        self.keep = keep
        self.owners = owners or FileOwners(folder)
        self.swept = self.owners.clock()
        self.owners.sweep()  # (what expired while the instance was down)
        named = b"|".join(re.escape(p.encode()) for p in self.prefixes)
        self.named = re.compile(rb"(?:" + named + rb')[^"\\\s?#]+')

    def outward(self, data: bytes) -> bytes:
        for prefix in self.prefixes:
            data = data.replace(prefix.encode(), self.marker.encode())
        return data

    def inward_path(self, path: str) -> str:
        return self.prefixes[0] + path[len(self.marker) :] if path.startswith(self.marker) else path

    def inward(self, data: bytes) -> bytes:
        # only in file references ("path": "...", .../file=...), never inside a user's text
        prefix = self.prefixes[0].encode()
        marker = re.escape(self.marker.encode())
        data = re.sub(rb'("path"\s*:\s*")' + marker, lambda m: m.group(1) + prefix, data)
        return re.sub(rb"(/file=)" + marker, lambda m: m.group(1) + prefix, data)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(API):
            return await self.app(scope, receive, send)
        route = path[len(API) :]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if route.startswith(REFUSED):
            return await refuse(send, 404, f"no {path} here: this UI takes text and prompt audio only")
        if route.startswith(("/file=", "/file/")):
            return await self.serve_file(scope, receive, send, route, headers)
        if route == "/upload" and scope.get("method") == "POST":
            return await self.upload(scope, receive, send, headers)
        if scope.get("method") == "POST":
            body = self.inward(await read_all(receive) or b"")
            scope = with_length(scope, len(body))
            receive = replay(body, receive)
        await self.app(scope, receive, self.rewriting(send))

    async def serve_file(self, scope: Scope, receive: Receive, send: Send, route: str, headers: dict[str, str]):
        asked = unquote(route[len("/file=") :] if route.startswith("/file=") else route[len("/file/") :])
        full = os.path.realpath(self.inward_path(asked))  # (".." and links resolved before the checks)
        if self.owners.relative(full) is None:
            return await refuse(send, 404, "no such file: this UI serves its own results only")
        if not self.owners.serves(full, route_of(headers)):
            minutes = self.owners.kept / 60
            return await refuse(
                send,
                404,
                f"no such file: an upload is served back only to the browser that sent it, for {minutes:g} "
                "minutes (upload it again), and a result only once it was made here",
            )
        new_path = f"{API}/file={full}"
        scope = dict(scope, path=new_path, raw_path=new_path.encode())
        await self.app(scope, receive, send)

    async def upload(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str]) -> None:
        if not self.uploads and not self.texts:
            return await refuse(send, 403, "this UI takes no files: its engine does not clone voices")
        largest = max(self.max_bytes if self.uploads else 0, self.texts)
        limit = largest + MULTIPART_SLACK
        declared = headers.get("content-length", "")
        too_large = self.too_large_message()
        if declared.isdigit() and int(declared) > limit:
            return await refuse(send, 413, too_large)
        body = await read_all(receive, limit)
        if body is None:
            return await refuse(send, 413, too_large)
        parts = file_parts(body, headers.get("content-type", ""))
        if not parts:
            return await refuse(send, 400, "send the file as a multipart/form-data file named 'files'")
        for name, head in parts:
            refused = self.refusal_of(name, head, len(body))
            if refused:
                return await refuse(send, *refused)
        owner = route_of(headers)
        answer: list[Message] = []

        async def keep(message: Message) -> None:
            answer.append(message)

        await self.app(with_length(scope, len(body)), replay(body, receive), keep)
        start = next(m for m in answer if m["type"] == "http.response.start")
        data = b"".join(m.get("body", b"") for m in answer if m["type"] == "http.response.body")
        if start["status"] == 200:
            self.record(data, owner)
        data = self.outward(data)
        await send(dict(start, headers=set_length(start.get("headers", []), len(data))))
        await send({"type": "http.response.body", "body": data})

    def record(self, answer: bytes, owner: str) -> None:
        """The upload route's answer (the paths Gradio wrote): each kept for ``owner`` only."""
        try:
            paths = [str(path) for path in json.loads(answer)]
        except (ValueError, TypeError):
            return
        for path in paths:
            self.owners.grant(path, owner)
            if self.keep is not None:  # (as Gradio may spell it: through a link or not)
                self.keep.update({path, os.path.abspath(path), os.path.realpath(path)})
        now = self.owners.clock()
        if now - self.swept >= self.owners.kept / 4:  # (a running instance's expired uploads go too)
            self.swept = now
            self.owners.sweep()
            if self.keep is not None:
                self.keep.difference_update([p for p in self.keep if not os.path.exists(p)])

    def publish(self, data: bytes) -> None:
        """The files an answer names are results (an upload keeps its owners)."""
        for found in set(self.named.findall(data)):
            self.owners.publish(found.decode("utf-8", "replace"))

    def too_large_message(self) -> str:
        said = []
        if self.uploads:
            said.append(f"a prompt audio is at most {self.max_bytes / 2**20:g} MiB: send a shorter one")
        if self.texts:
            said.append(f"a .txt is at most {self.texts // 1024} KiB: split it into several jobs")
        return "the upload is larger than this UI takes: " + "; ".join(said)

    def refusal_of(self, name: str, head: bytes, size: int) -> tuple[int, str] | None:
        """(status, message) when this UI does not take this file; None when it does."""
        if self.uploads and is_audio(head):
            return (413, self.too_large_message()) if size > self.max_bytes + MULTIPART_SLACK else None
        if self.texts and is_text(name, head):
            return (413, self.too_large_message()) if size > self.texts + MULTIPART_SLACK else None
        what = name or "the file"
        wanted = [f"prompt audio as {FORMATS} (3-15 s of speech)"] if self.uploads else []
        wanted += ["a long text as a UTF-8 .txt"] if self.texts else []
        return 415, f"{what} is not a file this UI takes: upload " + ", or ".join(wanted)

    def rewriting(self, send: Send) -> Send:
        """``send``, with Gradio's temp dir spelled as the marker in text and JSON answers."""
        state: dict[str, object] = {"start": None, "buffer": []}

        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                types = [v for k, v in message.get("headers", []) if k.lower() == b"content-type"]
                if not any(t.startswith(REWRITTEN_TYPES) for t in types):
                    state["start"] = False
                    return await send(message)
                state["start"] = message
                return None
            start = state["start"]
            if message["type"] != "http.response.body" or start is False:
                return await send(message)
            assert isinstance(start, dict)
            buffer = state["buffer"]
            assert isinstance(buffer, list)
            sized = any(k.lower() == b"content-length" for k, _ in start.get("headers", []))
            if sized:  # a whole answer: rewritten at its end, with its new length
                buffer.append(message.get("body", b""))
                if message.get("more_body"):
                    return None
                whole = b"".join(buffer)
                self.publish(whole)
                data = self.outward(whole)
                await send(dict(start, headers=set_length(start["headers"], len(data))))
                return await send({"type": "http.response.body", "body": data})
            if start:  # a stream (Gradio's event stream sends whole events): piece by piece
                await send(start)
                state["start"] = {}
            self.publish(message.get("body", b""))
            await send(dict(message, body=self.outward(message.get("body", b""))))
            return None

        return wrapped


async def read_all(receive: Receive, limit: int | None = None) -> bytes | None:
    """A request's body; None once it passes ``limit``."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def replay(body: bytes, then: Receive) -> Receive:
    """A ``receive`` that gives ``body`` (already read), then what the client sends next (its
    disconnect, which a streamed answer waits for)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return await then()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


def set_length(headers: list[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k.lower() != b"content-length"] + [(b"content-length", str(length).encode())]


def with_length(scope: Scope, length: int) -> Scope:
    return dict(scope, headers=set_length(list(scope.get("headers", [])), length))
