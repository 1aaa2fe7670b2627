"""The instance's gate: with a policy, every route but ``/ping`` and the login needs
credentials — an API token (``Authorization: Bearer``) or a session cookie from ``/login``.

It wraps the whole ASGI app, so Gradio's own routes (``/gradio_api/...``, the queue,
uploads, files, what ``gradio_client`` calls) are behind it like the API: there is no
route around it. A browser asking for a page is sent to the login form; anything else
gets a 401 JSON answer with ``WWW-Authenticate``.

Instance side: standard library and starlette.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import time
from collections.abc import Callable
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qs, quote

from starlette.types import ASGIApp, Receive, Scope, Send

from cosyvoice_lb.common.error_body import error_body, error_headers
from cosyvoice_lb.instance.access.auth import SESSION_COOKIE, SESSION_SECONDS, PolicyFile

# (/metrics: the instance's own, on loopback; it refuses what came through nginx)
OPEN = frozenset({"/ping", "/ping/brief", "/metrics", "/cohort", "/login", "/logout"})
# WebSockets whose first message may carry the token instead (a browser cannot set headers on
# one): let through without credentials, marked, and the route checks that message
# (``api.speech_socket``). Never a token in the URL: URLs land in logs.
TOKEN_IN_FIRST_MESSAGE = frozenset({"/v1/audio/speech/stream"})
MAX_LOGIN_BODY = 8192
REALM = 'Bearer realm="cosyvoice-lb"'


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def cookie(headers: dict[str, str], name: str) -> str:
    """The value of the request's cookie ``name`` ("" when absent or unreadable)."""
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(headers.get("cookie", ""))
    except CookieError:
        return ""
    morsel = jar.get(name)
    return morsel.value if morsel else ""


def session_cookie(headers: dict[str, str]) -> str:
    return cookie(headers, SESSION_COOKIE)


def safe_next(target: str) -> str:
    """Where to go after the login: a path on this site only (never //host, a URL, or a
    path with blanks or controls, which browsers strip: "/\t/evil" would become //evil)."""
    return target if re.fullmatch(r"/(?![/\\])[\x21-\x7e]*", target) else "/"


async def _send(send: Send, status: int, body: bytes, headers: list[tuple[str, str]]) -> None:
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    raw.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def form_page(title: str, heading: str, action: str, fields: str, message: str = "") -> str:
    """A small page with one form (the UI's login, the control panel's): ``fields`` is its
    inputs' HTML, ``message`` an error said above it."""
    note = f'<p class="err" role="alert">{html.escape(message)}</p>' if message else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font-family:system-ui,sans-serif;max-width:24rem;margin:4rem auto;padding:0 1rem}}
label,input,button{{display:block;width:100%;box-sizing:border-box;margin:.4rem 0}}
input{{padding:.5rem}}button{{padding:.6rem;margin-top:1rem}}.err{{color:#b00}}</style></head>
<body><h1>{html.escape(heading)}</h1>{note}
<form method="post" action="{html.escape(action)}">
{fields}<button type="submit">Log in</button>
</form></body></html>
"""


def login_page(next_path: str, message: str = "") -> bytes:
    fields = f"""<input type="hidden" name="next" value="{html.escape(next_path)}">
<label for="user">User (leave empty to log in with an API token)</label>
<input id="user" name="user" autocomplete="username">
<label for="password">Password or API token</label>
<input id="password" name="password" type="password" autocomplete="current-password" required>
"""
    return form_page("cosyvoice-lb: log in", "Log in", "/login", fields, message).encode()


def same_origin(headers: dict[str, str]) -> bool:
    """A browser's WebSocket comes from this site (its Origin names the Host it asks), or is no
    browser's (no Origin): a session cookie must not open sockets for another site's page."""
    origin = headers.get("origin", "")
    if not origin:
        return True
    host = headers.get("x-forwarded-host") or headers.get("host", "")
    return origin.split("://", 1)[-1].rstrip("/").lower() == host.lower()


async def refuse_socket(scope: Scope, send: Send, status: int, message: str) -> None:
    """Refuse a WebSocket's handshake with an HTTP answer in the one shape (or, on a server
    without the denial extension, a plain 403)."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    body = json.dumps(error_body(status, message)).encode()
    fields = [("content-type", "application/json"), ("content-length", str(len(body))), *error_headers(status).items()]
    if status == 401:
        fields.append(("www-authenticate", REALM))
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in fields]
    await send({"type": "websocket.http.response.start", "status": status, "headers": raw})
    await send({"type": "websocket.http.response.body", "body": body})


class Gate:
    """ASGI middleware: lets a request through when no policy is set, when it asks for an
    open path, or when it carries credentials the policy accepts."""

    def __init__(self, app: ASGIApp, policy: PolicyFile | None, clock: Callable[[], float] = time.time):
        self.app, self.policy, self.clock = app, policy, clock
        self.checks = asyncio.Semaphore(2)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.policy is None:
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if path in ("/login", "/logout") and scope["type"] == "http":
            return await self.login(scope, receive, send)
        headers = _headers(scope)
        policy = self.policy.current()
        if path in OPEN or policy.bearer_ok(headers.get("authorization", "")):
            return await self.app(scope, receive, send)
        if policy.session_ok(session_cookie(headers), self.clock()):
            if scope["type"] == "websocket" and not same_origin(headers):
                return await refuse_socket(scope, send, 403, "a WebSocket from another site: open it from this one")
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket" and path in TOKEN_IN_FIRST_MESSAGE and "authorization" not in headers:
            scope.setdefault("state", {})["cvlb_token_needed"] = True
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            offered = "authorization" in headers
            message = "the API token is not valid" if offered else "this service needs credentials"
            return await refuse_socket(
                scope, send, 401, f"{message}: send the header 'Authorization: Bearer <API token>'"
            )
        if scope.get("method") == "GET" and "text/html" in headers.get("accept", ""):
            target = path + ("?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else "")
            location = "/login?next=" + quote(target, safe="")
            return await _send(send, 303, b"", [("location", location), ("cache-control", "no-store")])
        offered = "authorization" in headers
        message = (
            "the API token is not valid: check it against the token file (tokens are re-read on `up`)"
            if offered
            else "this service needs credentials: send the header 'Authorization: Bearer <API token>', "
            "or log in at /login in a browser"
        )
        challenge = REALM + (', error="invalid_token"' if offered else "")
        body = json.dumps(error_body(401, message, code="invalid_api_key" if offered else None)).encode()
        answer = [("content-type", "application/json"), ("www-authenticate", challenge), *error_headers(401).items()]
        await _send(send, 401, body, answer)
        return None

    async def login(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        html_type = ("content-type", "text/html; charset=utf-8")
        no_store = ("cache-control", "no-store")
        if scope["path"] == "/logout":
            expired = f"{SESSION_COOKIE}=; Path=/; Max-Age=0; HttpOnly; SameSite=Lax"
            return await _send(send, 303, b"", [("location", "/login"), ("set-cookie", expired), no_store])
        if scope.get("method") != "POST":
            page = login_page(safe_next(query.get("next", ["/"])[0]))
            return await _send(send, 200, page, [html_type, no_store])
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if len(body) > MAX_LOGIN_BODY:
                return await _send(send, 413, login_page("/", "That was too long."), [html_type, no_store])
            if not message.get("more_body"):
                break
        form = parse_qs(body.decode("utf-8", "replace"))
        user, password = form.get("user", [""])[0], form.get("password", [""])[0]
        target = safe_next(form.get("next", ["/"])[0])
        policy = self.policy.current() if self.policy else None
        # (bcrypt is slow on purpose: off the event loop, and a few at a time, so a flood of
        # logins cannot take the threads the syntheses' preparation uses)
        async with self.checks:
            key = await asyncio.to_thread(policy.login, user, password) if policy else None
        if policy is None or key is None:
            page = login_page(target, "Wrong user, password or token.")
            return await _send(send, 401, page, [html_type, no_store])
        secure = "; Secure" if _headers(scope).get("x-forwarded-proto", scope.get("scheme", "")) == "https" else ""
        cookie = (
            f"{SESSION_COOKIE}={policy.session(key, self.clock())}; Path=/; Max-Age={SESSION_SECONDS}; "
            f"HttpOnly; SameSite=Lax{secure}"
        )
        return await _send(send, 303, b"", [("location", target), ("set-cookie", cookie), no_store])
