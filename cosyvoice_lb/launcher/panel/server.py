"""The control panel and the cluster's ``/metrics``: one process under supervisord, on a
unix socket in the private run dir, reached only through nginx.

Never open: every route needs the admin credentials — a bearer token from the admin token
file, or the session cookie the panel's login form sets — except ``/metrics``, which the
scrape token may read too (it can do nothing else). A cookie alone never changes anything:
the panel's buttons send a header no other site's form can, and the cookie is SameSite=Strict.

Routes: ``/admin`` (the page), ``/admin/login``, ``/admin/logout``, ``/admin/api/status``,
``POST /admin/api/instances/{name}/{restart|drain|undrain}``, ``/admin/api/logs/{name}``,
``/admin/jobs`` (the long-form jobs' page), ``/admin/api/jobs``, ``POST /admin/api/jobs/{id}/cancel``,
``/metrics`` (the cluster's) and ``/metrics/{instance}`` (an instance's, relayed).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from cosyvoice_lb.common.error_body import error_body, error_headers
from cosyvoice_lb.instance.access.auth import PolicyFile, digest
from cosyvoice_lb.instance.access.gate import form_page
from cosyvoice_lb.launcher.cluster import lifecycle
from cosyvoice_lb.launcher.cluster.disk import recorded
from cosyvoice_lb.launcher.health.probe import loopback_session
from cosyvoice_lb.launcher.panel import jobs as panel_jobs
from cosyvoice_lb.launcher.panel.canary import CanaryControl
from cosyvoice_lb.launcher.panel.control import Action, Actions, gather
from cosyvoice_lb.launcher.panel.metrics import ClusterView, ViewCollector
from cosyvoice_lb.launcher.render import templates
from cosyvoice_lb.launcher.render.cluster import jobs_socket
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.supervision import read_tail

log = logging.getLogger("cosyvoice_lb.admin")

COOKIE = "cvlb_admin"
SESSION_SECONDS = 12 * 3600
CSRF_HEADER = "x-cvlb-admin"  # the panel's scripts send it; a form on another site cannot
MAX_LOGIN_BODY = 4096
MAX_LOG_LINES = 2000


def problem(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(status, message), status_code=status, headers={**error_headers(status), **(headers or {})}
    )


def login_page(message: str = "") -> str:
    fields = """<label for="token">Admin token (the admin token file; `cosyvoice-lb status` says where)</label>
<input id="token" name="token" type="password" autocomplete="current-password" required autofocus>
"""
    return form_page("cosyvoice-lb control panel: log in", "Control panel", "/admin/login", fields, message)


class Cached:
    """A value computed at most once per ``seconds``: a burst of scrapes and panel refreshes
    asks supervisord and the instances once. While one caller refreshes it, the others get
    the value before (or, the first time, wait for it): a slow read (a hung NVML, a
    supervisord that does not answer) holds one thread, not every request."""

    def __init__(
        self, make: Callable[[], ClusterView], seconds: float = 1.0, clock: Callable[[], float] = time.monotonic
    ):
        self.make, self.seconds, self.clock = make, seconds, clock
        self.changed = threading.Condition()
        self.value: ClusterView | None = None
        self.at = float("-inf")
        self.refreshing = False

    def get(self) -> ClusterView:
        with self.changed:
            while True:
                if self.value is not None and (self.refreshing or self.clock() - self.at < self.seconds):
                    return self.value
                if not self.refreshing:
                    break
                self.changed.wait()
            self.refreshing = True
        value = None
        try:
            value = self.make()
            return value
        finally:
            with self.changed:
                self.refreshing = False
                if value is not None:
                    self.value, self.at = value, self.clock()
                self.changed.notify_all()


def view_dict(view: ClusterView, actions: dict[str, dict]) -> dict[str, Any]:
    """What the panel's page shows, as JSON."""
    current = view.status
    instances = []
    for item in current.instances:
        entry = dataclasses.asdict(item)
        entry.update(memory=view.memory.get(item.name, 0), action=actions.get(item.name))
        instances.append(entry)
    services = {name: getattr(current, name) for name in ("nginx", "health", "admin") if hasattr(current, name)}
    return {
        "running": current.running,
        "url": current.url,
        "time": view.now,
        "instances": instances,
        "gpus": [dataclasses.asdict(g) for g in current.gpus],
        "services": services,
        "problems": current.problems,
        "warnings": current.warnings,
        "nginx": dataclasses.asdict(view.nginx) if view.nginx else None,
    }


def build_app(
    layout: Layout,
    view: Callable[[], ClusterView] | None = None,
    actions: Actions | None = None,
    clock: Callable[[], float] = time.time,
    canary: CanaryControl | None = None,
) -> Starlette:
    """The panel's app. ``view`` and ``actions`` are passed in by tests; by default the live
    cluster's."""
    admins = PolicyFile(str(layout.admin_policy))
    scrapers = PolicyFile(str(layout.metrics_policy))
    cached = Cached(view or (lambda: gather(layout)))
    actions = actions or Actions(layout)
    canary = canary or CanaryControl(layout)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ViewCollector(cached.get))
    page = templates.read("admin.html")

    def who(request: Request) -> str:
        """ "admin" (a token), "session" (the panel's cookie), "metrics" (the scrape token) or ""."""
        authorization = request.headers.get("authorization", "")
        if authorization:
            if admins.current().bearer_ok(authorization):
                return "admin"
            return "metrics" if scrapers.current().bearer_ok(authorization) else ""
        return "session" if admins.current().session_ok(request.cookies.get(COOKIE, ""), clock()) else ""

    def refused(request: Request) -> Response:
        if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
            return RedirectResponse("/admin/login", status_code=303, headers={"cache-control": "no-store"})
        offered = bool(request.headers.get("authorization"))
        message = (
            "the token is not an admin token: check it against the admin token file"
            if offered
            else "the control panel needs the admin token: send 'Authorization: Bearer <admin token>', "
            "or log in at /admin/login; `cosyvoice-lb status` says where the token file is"
        )
        challenge = 'Bearer realm="cosyvoice-lb admin"' + (', error="invalid_token"' if offered else "")
        return problem(401, message, {"www-authenticate": challenge})

    def admin_only(handler: Callable[[Request], Any], changes: bool = False) -> Callable[[Request], Any]:
        async def guarded(request: Request) -> Response:
            kind = await asyncio.to_thread(who, request)
            if kind not in ("admin", "session"):
                return refused(request)
            if changes and kind == "session" and request.headers.get(CSRF_HEADER) != "1":
                return problem(403, f"send the {CSRF_HEADER}: 1 header with a change made with the panel's cookie")
            return await handler(request)

        return guarded

    async def panel(request: Request) -> Response:
        return HTMLResponse(page, headers={"cache-control": "no-store"})

    async def login(request: Request) -> Response:
        if request.method == "GET":
            return HTMLResponse(login_page(), headers={"cache-control": "no-store"})
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_LOGIN_BODY:
                return HTMLResponse(login_page("That was too long."), status_code=413)
        token = parse_qs(body.decode("utf-8", "replace")).get("token", [""])[0].strip()
        policy = admins.current()
        if not policy.token_ok(token):
            log.warning("admin login refused from %s", request.headers.get("x-real-ip", "?"))
            return HTMLResponse(login_page("That is not an admin token."), status_code=401)
        secure = "; Secure" if request.headers.get("x-forwarded-proto", request.url.scheme) == "https" else ""
        cookie = (
            f"{COOKIE}={policy.session('t:' + digest(token), clock(), SESSION_SECONDS)}; Path=/admin; "
            f"Max-Age={SESSION_SECONDS}; HttpOnly; SameSite=Strict{secure}"
        )
        return RedirectResponse("/admin", status_code=303, headers={"set-cookie": cookie, "cache-control": "no-store"})

    async def logout(request: Request) -> Response:
        expired = f"{COOKIE}=; Path=/admin; Max-Age=0; HttpOnly; SameSite=Strict"
        return RedirectResponse("/admin/login", status_code=303, headers={"set-cookie": expired})

    async def api_status(request: Request) -> Response:
        current = await asyncio.to_thread(cached.get)
        return JSONResponse(view_dict(current, actions.as_dict()), headers={"cache-control": "no-store"})

    async def begin(start: Callable[[], Action], said: str) -> Response:
        """Start an action: 202 while it runs (200 done already), 404 unknown, 409 busy."""
        try:
            started = await asyncio.to_thread(start)
        except ValueError as exc:
            return problem(404, str(exc))
        except RuntimeError as exc:
            return problem(409, str(exc))
        log.info("%s asked from the control panel", said)
        return JSONResponse(dataclasses.asdict(started), status_code=202 if started.state == "running" else 200)

    async def act(request: Request) -> Response:
        name, action = request.path_params["name"], request.path_params["action"]
        return await begin(lambda: actions.start(name, action), f"{name}: {action}")

    async def canary_view(request: Request) -> Response:
        return JSONResponse(await asyncio.to_thread(canary.view), headers={"cache-control": "no-store"})

    async def canary_act(request: Request) -> Response:
        action, force = request.path_params["action"], request.query_params.get("force") == "1"
        return await begin(lambda: canary.start(action, force), f"canary: {action}{' (forced)' if force else ''}")

    async def logs(request: Request) -> Response:
        name = request.path_params["name"]
        known = lifecycle.log_names(layout)
        if name not in known:
            return problem(404, f"no log named {name!r} (known: {', '.join(known) or 'none yet'})")
        try:
            lines = max(1, min(MAX_LOG_LINES, int(request.query_params.get("lines", "200"))))
        except ValueError:
            return problem(400, "lines must be a whole number (1-2000)")
        text = await asyncio.to_thread(read_tail, layout.log(name), 300 * lines)
        return PlainTextResponse("\n".join(text.splitlines()[-lines:]) + "\n", headers={"cache-control": "no-store"})

    async def metrics(request: Request) -> Response:
        if await asyncio.to_thread(who, request) == "":
            return refused(request)
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        body = await asyncio.to_thread(encoder, registry)
        return Response(body, media_type=content_type)

    async def instance_metrics(request: Request) -> Response:
        if await asyncio.to_thread(who, request) == "":
            return refused(request)
        record = recorded(layout)
        slots = {s.name: s for s in record[1]} if record else {}
        slot = slots.get(request.path_params["name"])
        if slot is None:
            return problem(404, f"no instance named {request.path_params['name']!r} (instances: {', '.join(slots)})")

        def fetch() -> Any:
            accept = {"accept": request.headers["accept"]} if "accept" in request.headers else {}
            return loopback_session(1).get(f"http://127.0.0.1:{slot.port}/metrics", headers=accept, timeout=5)

        try:
            answer = await asyncio.to_thread(fetch)
        except Exception as exc:
            return problem(502, f"{slot.name} did not answer its /metrics ({type(exc).__name__}): is it running?")
        return Response(answer.content, status_code=answer.status_code, media_type=answer.headers.get("content-type"))

    async def jobs_page(request: Request) -> Response:
        return HTMLResponse(panel_jobs.PAGE, headers={"cache-control": "no-store"})

    async def jobs_list(request: Request) -> Response:
        try:
            found = await asyncio.to_thread(panel_jobs.list_jobs, jobs_socket(layout))
        except panel_jobs.JobsUnavailable as exc:
            return problem(503, str(exc), {"retry-after": "5"})
        return JSONResponse({"object": "list", "data": found}, headers={"cache-control": "no-store"})

    async def jobs_cancel(request: Request) -> Response:
        job_id = request.path_params["job_id"]
        try:
            status, body = await asyncio.to_thread(panel_jobs.cancel_job, jobs_socket(layout), job_id)
        except panel_jobs.JobsUnavailable as exc:
            return problem(503, str(exc), {"retry-after": "5"})
        if status != 200:
            return problem(status if status in (404, 409) else 502, panel_jobs.message_of(body, status))
        log.info("job %s: cancelled from the control panel", job_id)
        return JSONResponse(body)

    routes = [
        Route("/admin", admin_only(panel)),
        Route("/admin/", admin_only(panel)),
        Route("/admin/login", login, methods=["GET", "POST"]),
        Route("/admin/logout", logout, methods=["GET", "POST"]),
        Route("/admin/api/status", admin_only(api_status)),
        Route("/admin/api/instances/{name}/{action}", admin_only(act, changes=True), methods=["POST"]),
        Route("/admin/api/logs/{name}", admin_only(logs)),
        Route("/admin/api/canary", admin_only(canary_view)),
        Route("/admin/api/canary/{action}", admin_only(canary_act, changes=True), methods=["POST"]),
        Route("/admin/jobs", admin_only(jobs_page)),
        Route("/admin/api/jobs", admin_only(jobs_list)),
        Route("/admin/api/jobs/{job_id}/cancel", admin_only(jobs_cancel, changes=True), methods=["POST"]),
        Route("/metrics", metrics),
        Route("/metrics/{name}", instance_metrics),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        return problem(404, f"no {request.url.path} here: the panel is /admin, the metrics /metrics")

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return problem(405, f"{request.method} is not allowed on {request.url.path}")

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="cosyvoice-lb control panel and cluster metrics (run by supervisord)")
    parser.add_argument("--state-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s admin %(levelname)s %(message)s")
    import uvicorn

    layout = Layout(Path(args.state_dir).resolve())
    log.info("control panel on %s", layout.admin_socket)
    uvicorn.run(build_app(layout), uds=str(layout.admin_socket), log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
