"""Gradio's routes answer refusals in the one error shape (see ``problems``).

Gradio is mounted at "/", so every path the instance does not route itself reaches it, and
it answers in its own ways: ``{"detail": "Not Found"}`` for an unknown path or method, and a
``text/plain`` 500 for a call it cannot take (``queue/join`` with an ``fn_index`` it does not
have raises ``KeyError`` inside Gradio). This middleware turns those into a 4xx in the one
shape. A call that goes well passes through untouched: only an answer's first message is
looked at, and only a refusal's body is read.

Instance side: standard library and starlette.
"""

from __future__ import annotations

import json
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosyvoice_lb.common.error_body import refusal

log = logging.getLogger("cosyvoice_lb.instance")

# The instance's own routes answer in the one shape already.
OWN = ("/v1/", "/ping", "/metrics")
METHODS = frozenset({"GET", "HEAD", "OPTIONS", "POST", "PUT", "DELETE", "PATCH"})
# Starlette's own words for a routing miss: what Gradio answers an unknown path or method with.
MISSES = {404: "Not Found", 405: "Method Not Allowed"}
API = "the API is POST /v1/tts, POST /v1/audio/speech, GET /v1/models and /v1/audio/voices; the UI is at /"


def miss_message(status: int, method: str, path: str, allow: str) -> str:
    if status == 405:
        use = f"use {' or '.join(m.strip() for m in allow.split(','))}" if allow else "use GET or POST"
        return f"{method} is not allowed on {path}: {use} ({API})"
    return f"no such path {path}: {API}"


class UIErrors:
    """ASGI middleware around the Gradio mount (see the module's docstring)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        method = scope.get("method", "GET")
        if path.startswith(OWN):
            if method in METHODS:
                return await self.app(scope, receive, send)
            # (the API's catch-all takes the usual methods only: any other would reach Gradio)
            for out in refusal(405, miss_message(405, method, path, "GET, POST"), {"allow": "GET, POST"}):
                await send(out)
            return
        held: list[Message] = []  # a refusal's messages, kept until it is known what it is
        state = {"started": False, "holding": False}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and not state["started"]:
                state["started"] = True
                status = message["status"]
                kind = dict(message.get("headers", [])).get(b"content-type", b"")
                if status == 500 and kind.startswith(b"text/plain") or status in MISSES:
                    state["holding"] = True
            if not state["holding"]:
                return await send(message)
            held.append(message)
            ended = message["type"] == "http.response.body" and not message.get("more_body", False)
            # (a 500 stays held until Gradio's exception behind it comes, raised after it)
            if ended and held[0]["status"] in MISSES:
                state["holding"] = False
                for out in self.rewrite(held, method, path):
                    await send(out)
                held.clear()

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if state["started"] and not held:  # an answer went out already: nothing to put right
                raise
            # (Gradio raised on this call; its own 500 was held back, and the instance lives on)
            log.warning("gradio refused %s %s: %s: %s", method, path, type(exc).__name__, exc)
            for out in refusal(
                400,
                f"the UI's route {path} cannot take this call ({type(exc).__name__}: {str(exc)[:200]}): "
                "check fn_index, session_hash and data against GET /config, or call it with gradio_client",
            ):
                await send(out)
            return
        for out in held:  # a 500 with no exception behind it: Gradio's own answer stands
            await send(out)

    @staticmethod
    def rewrite(held: list[Message], method: str, path: str) -> list[Message]:
        """A held answer: a routing miss in the one shape, anything else as it was."""
        start, status = held[0], held[0]["status"]  # (a 404 or 405)
        body = b"".join(m.get("body", b"") for m in held[1:])
        try:
            detail = json.loads(body).get("detail")
        except (ValueError, AttributeError):
            return held
        if detail != MISSES[status]:  # Gradio's own refusal with its own words: its client reads them
            return held
        allow = dict(start.get("headers", [])).get(b"allow", b"").decode("latin-1")
        return refusal(status, miss_message(status, method, path, allow), {"allow": allow} if allow else None)
