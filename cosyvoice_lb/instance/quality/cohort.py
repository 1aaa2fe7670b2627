"""The requests a model roll-out compares (``cosyvoice-lb canary``): each one's outcome,
latency and speech check, kept for the launcher to read (``GET /cohort``).

Which requests: on a canary instance (``--canary``) every speech request it gets (nginx sends
it only the mirrored copies, made whole though nginx hangs up on them early, or its share); on a serving instance those nginx marked with
``X-Cvlb-Cohort: serving`` (the ones mirrored, or as many as the canary's share), so both
sides are measured over the same traffic. Each is checked by the speech check whatever
``--asr-sample`` says (the checker asks :func:`current`), after it was answered, off the hot
path; when the checker's queue is full it stays unchecked and says so.

A bad answer the instance refused (bad audio: a 502, which nginx retries elsewhere) counts as
bad audio; a stream that went bad after its status left counts as failed. Kept in memory (the
last ``LIMIT`` per instance): a restarted instance starts a fresh count.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosyvoice_lb.instance.metrics import SPEECH_PATHS, outcome_of
from cosyvoice_lb.instance.quality.compared import Sample, comparing

HEADER = b"x-cvlb-cohort"
LIMIT = 5000


class Cohort:
    """The compared requests of one instance; ``role``: "canary" or "serving"."""

    def __init__(self, role: str, limit: int = LIMIT):
        self.role = role
        self.samples: deque[Sample] = deque(maxlen=limit)

    def snapshot(self) -> dict:
        return {"role": self.role, "samples": [s.as_dict() for s in list(self.samples)]}


def deaf(receive: Receive) -> Receive:
    """``receive`` that hands over the request's body and then never says the client left:
    nginx hangs up on a mirrored copy as soon as the client it copied has its answer (its
    copies are cut then, whatever ``proxy_ignore_client_abort`` says), and a copy cut short
    measures nothing, so the canary makes each one whole."""
    body_done = False

    async def receiving() -> Message:
        nonlocal body_done
        if body_done:
            await asyncio.Event().wait()  # (until the app stops listening: cancelled)
        message = await receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            body_done = True
        return message

    return receiving


def mute(send: Send) -> Send:
    """``send`` that drops what the departed listener of a copy can no longer take."""

    async def sending(message: Message) -> None:
        try:
            await send(message)
        except OSError:
            pass

    return sending


class CohortMiddleware:
    """ASGI middleware: measures each compared request (see the module) and makes it
    :func:`current` while it runs (threads the server hands it to copy the context)."""

    def __init__(self, app: ASGIApp, cohort: Cohort, segment_header: str, clock: Callable[[], float] = time.monotonic):
        self.app, self.cohort, self.clock = app, cohort, clock
        self.segment_header = segment_header.lower().encode("latin-1")

    def mark(self, scope: Scope) -> bytes | None:
        """A compared request's ``X-Cvlb-Cohort`` (b"" when unmarked, on a canary); None for
        a request not compared."""
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path", "") not in SPEECH_PATHS:
            return None
        headers = dict(scope.get("headers", []))
        if self.segment_header in headers:  # (a long text's segment: its text was counted)
            return None
        mark = headers.get(HEADER, b"")
        return mark if self.cohort.role == "canary" or mark == b"serving" else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        mark = self.mark(scope)
        if mark is None:
            return await self.app(scope, receive, send)
        started = self.clock()
        sample = Sample(at=time.time())
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                if message.get("body") and sample.first_chunk is None:
                    sample.first_chunk = self.clock() - started
                if not message.get("more_body", False):  # the last byte: what the client waited for
                    sample.total = self.clock() - started
            await send(message)

        token = comparing.set(sample)
        raised = False
        try:
            if mark == b"canary":  # nginx's mirrored copy: made to its end, whoever still listens
                await self.app(scope, deaf(receive), mute(sending))
            else:
                await self.app(scope, receive, sending)
        except BaseException:
            raised = True
            raise
        finally:
            comparing.reset(token)
            state = scope.get("state", {})
            if sample.total is None:  # (no last byte went out)
                sample.total = self.clock() - started
            sample.outcome = (
                "bad_audio"
                if status == 502
                else state.get("cvlb_outcome")
                or ("failed" if raised else outcome_of(status) if status else "cancelled")
            )
            if sample.outcome not in ("ok", "declined"):
                sample.unchecked = "no audio to check"
            if sample.outcome != "declined":  # (routing by work sent it on: the one that answers counts it)
                self.cohort.samples.append(sample)


def mount_cohort(app, cohort: Cohort, segment_header: str) -> None:  # noqa: ANN001  (a FastAPI app)
    """``GET /cohort`` (on this box's loopback only, like ``/metrics``: through nginx, which
    stamps X-Request-Start, it is refused) and the middleware that fills it."""

    async def samples(request: Request) -> JSONResponse:
        if "x-request-start" in request.headers:
            return JSONResponse({"error": {"message": "no /cohort here: cosyvoice-lb canary status reads it"}}, 404)
        return JSONResponse(cohort.snapshot())

    app.add_route("/cohort", samples, methods=["GET"], include_in_schema=False)
    app.add_middleware(CohortMiddleware, cohort=cohort, segment_header=segment_header)
