"""What an instance started with ``--no-ui`` answers where the UI would be.

No Gradio is imported or mounted. Every path that no route of the instance takes (``/``,
and whatever else a browser or an old client asks for) gets a 404 in the one error shape
that says the UI is off and what to call instead. It is the router's answer for a path it
has no route for, so the API's own routes, its catch-all under ``/v1/`` and a wrong method
on a known path (405) answer as ever.

Instance side: standard library and starlette.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Receive, Scope, Send

from cosyvoice_lb.common.error_body import refusal

NO_UI = "this cluster runs without the UI (--no-ui): use the API, e.g. POST /v1/audio/speech or POST /v1/tts"


def no_ui_message(path: str) -> str:
    """The 404's words for ``path`` ("/" is the UI's own page)."""
    return NO_UI if path in ("", "/") else f"no such path {path}: {NO_UI}"


async def no_ui(scope: Scope, receive: Receive, send: Send) -> None:
    """The router's answer for a path it has no route for."""
    if scope["type"] == "websocket":  # (Gradio's old queue was one)
        await send({"type": "websocket.close", "code": 1008, "reason": NO_UI[:120]})
        return
    for message in refusal(404, no_ui_message(scope.get("path", ""))):
        await send(message)


def answer_without_ui(app: Any) -> None:
    """Make ``app`` (FastAPI) answer every path it has no route for with the 404 above."""
    app.router.default = no_ui
