"""The instance: one engine behind an HTTP API, a Gradio UI and ``/ping``.

``app.py`` runs :func:`main` once per slot, bound to 127.0.0.1 on the slot's port; nginx
is the only public listener. The model loads in a background thread so ``/ping`` can
answer 503 "loading" meanwhile, and says ready only after one warm-up synthesis worked.
Every request is answered; a bad one gets a 4xx that says what to fix, and nothing a
client sends can take the process down.

This module is the HTTP edge: ``/v1/tts`` decodes JSON or a form and hands it to the one
pipeline (``pipeline.py``), whose exceptions become answers through one table registered
here once; the UI (``ui.py``) is another adapter onto the same pipeline. What the pipeline
is built with comes from the command line through ``wiring.py``.

It runs in the model's Python environment (for CosyVoice: upstream's pins, gradio 5.x),
which has none of the launcher's packages: only the standard library, numpy, soundfile,
fastapi/starlette and gradio (not with --no-ui: the UI's module alone imports it) are
imported here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

import cosyvoice_lb
from cosyvoice_lb.common.checks import parse_voice_map
from cosyvoice_lb.common.error_body import error_body, error_headers
from cosyvoice_lb.common.instance_argv import parse_instance_args
from cosyvoice_lb.common.timeouts import GRACEFUL_SHUTDOWN
from cosyvoice_lb.instance.access.auth import PolicyFile
from cosyvoice_lb.instance.access.gate import Gate
from cosyvoice_lb.instance.api.forms import read_form
from cosyvoice_lb.instance.api.openai import add_openai_routes
from cosyvoice_lb.instance.api.speech_socket import StreamLimits, add_stream_route
from cosyvoice_lb.instance.api.streams import AudioStream, audio_source, collect_wav, first_of, streaming_headers
from cosyvoice_lb.instance.audio.wav import pcm16, wav_header
from cosyvoice_lb.instance.lifetime import close_engine, draining_server, outlive_uvicorns_signal
from cosyvoice_lb.instance.metrics import MISSING, RequestMetrics
from cosyvoice_lb.instance.quality.cohort import Cohort, mount_cohort
from cosyvoice_lb.instance.speech.admission import Snapshot
from cosyvoice_lb.instance.speech.canary import start_canary
from cosyvoice_lb.instance.speech.failures import ERRORS, Declined, describe
from cosyvoice_lb.instance.speech.fanout import SEGMENT_HEADER, FanOut
from cosyvoice_lb.instance.speech.pipeline import Pipeline
from cosyvoice_lb.instance.speech.validation import (
    FIELDS,
    MAX_SPEED,
    MIN_SPEED,
    OPENAI_SPEEDS,
    BadRequest,
    Limits,
    form_payload,
    prompt_span,
    request_schema,
    safe,
)
from cosyvoice_lb.instance.ui.absent import answer_without_ui
from cosyvoice_lb.instance.ui.errors import UIErrors
from cosyvoice_lb.instance.wiring import build_instance

log = logging.getLogger("cosyvoice_lb.instance")


# The staged tree's digest (staging.CODE_FILE beside the cosyvoice_lb package; "" run from a
# checkout): `status` compares it with what is staged now, so a half-done roll-out shows.
try:
    CODE = (Path(cosyvoice_lb.__file__).resolve().parent.parent / "CODE").read_text().strip()
except OSError:
    CODE = ""


def ping_body(
    snapshot: Snapshot,
    engine: str,
    port: int,
    started: float,
    routing: dict[str, float] | None = None,
    problems: list[str] | None = None,
    bad_audio: dict[str, int] | None = None,
    speech: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What ``/ping`` says: readiness, and per synthesis the seconds since its last chunk (a
    synthesis making no progress is what "hung" means to the health loop); ``routing``: what
    routing by work sees here (measured seconds per character, queued seconds, declines);
    ``problems``: what is wrong although it serves (e.g. results not kept on a full disk); ``bad_audio``:
    failed audio checks by reason (``canary``); ``speech``: the speech check, the last verdict first."""
    return {
        "ready": snapshot.ready,
        "state": snapshot.phase.value,
        "engine": engine,
        "port": port,
        "pid": os.getpid(),
        "code": CODE,
        "inflight": snapshot.inflight,
        "sessions": snapshot.sessions,  # (of inflight: streaming sessions, which a drain closes)
        "waiting": snapshot.waiting,
        "busy_seconds": snapshot.busy_seconds,
        "stalled_seconds": list(snapshot.stalled_seconds),
        "served": snapshot.served,
        "failed": snapshot.failed,
        "uptime": round(time.time() - started, 3),
        **({"routing": routing} if routing is not None else {}),
        **({"problems": problems} if problems else {}),
        **({"bad_audio": bad_audio} if bad_audio else {}),
        **({"speech": speech} if speech is not None else {}),
        **({"error": snapshot.error} if snapshot.error else {}),
    }


def speech_state(pipeline: Pipeline) -> dict[str, Any]:
    """``/ping``'s ``speech``: the verdict of the last warm-up or canary (passed, failed or
    unchecked, with why), then the speech check's own state and its last checks."""
    verdict = pipeline.probe.verdict
    state = {"verdict": verdict.state, "why": verdict.unchecked or (str(verdict.fault) if verdict.fault else "")}
    return {**state, **(pipeline.speech.state() if pipeline.speech is not None else {})}


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None, param: str | None = None
) -> JSONResponse:
    """An error in the one shape every route answers with (see ``problems``)."""
    return JSONResponse(
        error_body(status, message, param), status_code=status, headers={**error_headers(status), **(headers or {})}
    )


async def read_request(request: Request, limits: Limits) -> tuple[dict, bytes | None]:
    """The API's input: JSON, or a form with the prompt audio as the file ``prompt_audio``."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    # `curl -d '{...}'` labels JSON as a urlencoded form: a body that starts like JSON is JSON.
    if kind == "application/x-www-form-urlencoded" and (await request.body()).lstrip()[:1] in (b"{", b"["):
        kind = "application/json"
    if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
        fields, data = await read_form(request, "prompt_audio", len(FIELDS), limits.max_upload_bytes)
        return form_payload(fields), data
    body = await request.body()
    if not body.strip():
        raise BadRequest(
            'no body: POST JSON like {"text": "Hello", "speed": 1.0}, or a multipart form with prompt_audio'
        )
    try:
        payload = json.loads(body)
    except RecursionError:
        raise BadRequest('the JSON is nested too deeply: POST a flat object like {"text": "Hello"}') from None
    except ValueError as exc:  # not JSON, not UTF-8, or a number of thousands of digits
        if "digits" in str(exc):
            raise BadRequest(
                "a number in the JSON has thousands of digits: send numbers that fit their field "
                "(speed 0.5-2.0, seed below 4294967296)"
            ) from None
        raise BadRequest(f'the body is not valid JSON ({safe(str(exc))}): POST JSON like {{"text": "Hello"}}') from None
    if not isinstance(payload, dict):
        raise BadRequest('the body must be a JSON object, e.g. {"text": "Hello", "speed": 1.0}')
    return payload, None


def build_app(
    pipeline: Pipeline,
    engine_name: str = "",
    port: int = 0,
    started: float | None = None,
    policy: PolicyFile | None = None,
    fanout: FanOut | None = None,
    voice_map: dict[str, str] | None = None,
    ui: bool = True,
    cohort: Cohort | None = None,
    stream: StreamLimits | None = None,
) -> Any:
    """The FastAPI app: ``/ping``, ``/v1/tts``, the OpenAI-compatible routes
    (``openai_api``) and the Gradio UI at ``/`` (``ui=False``, --no-ui: no Gradio imported,
    ``/`` a 404 that names the API); with a ``policy``, all but ``/ping`` behind the gate
    (``gate.py``). ``fanout``: where long texts' segments go; ``cohort``: the requests a model
    roll-out compares (``quality.cohort``); ``stream``: the streaming sessions' limits."""
    engine, admission = pipeline.engine, pipeline.admission
    started = time.time() if started is None else started
    app = FastAPI(title="cosyvoice-lb instance", docs_url=None, redoc_url=None)

    def answer(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, Declined):  # not an answer to count: another instance will give it
            request.state.cvlb_outcome = "declined"
        failure = describe(exc)
        if failure is None:
            log.exception("unexpected error", exc_info=exc)
            return error_response(500, f"internal error ({type(exc).__name__}): the instance is still up; retry")
        if failure.level >= logging.WARNING:
            log.log(failure.level, "%s: %s", failure.status, failure.message)
        return error_response(failure.status, failure.message, failure.headers or None, failure.param)

    for kind, _ in ERRORS:  # the one table, registered once
        app.add_exception_handler(kind, answer)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, answer)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else "request refused"
        return error_response(exc.status_code, detail)

    @app.head("/ping", include_in_schema=False)
    @app.get("/ping")
    async def ping():
        if pipeline.router is not None:
            pipeline.router.publish()  # (the health loop's probe keeps the board fresh, e.g. a new board)
        snapshot = admission.snapshot()
        problems, bad = pipeline.problems(), pipeline.watch.counts()
        body = ping_body(
            snapshot,
            engine_name or engine.name,
            port,
            started,
            pipeline.routing(),
            problems,
            bad,
            speech_state(pipeline),
        )
        return JSONResponse(body, status_code=200 if snapshot.ready else 503)

    # What nginx answers a public /ping with: ready or not, no process details.
    @app.head("/ping/brief", include_in_schema=False)
    @app.get("/ping/brief", include_in_schema=False)
    async def ping_brief():
        ready = admission.snapshot().ready
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    # Prometheus on this box scrapes it here (the instance listens on loopback only). Through
    # nginx (which stamps X-Request-Start) it is refused: from there the cluster's /metrics,
    # behind the admin credentials, relays it.
    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request):
        if "x-request-start" in request.headers:
            return error_response(404, "no /metrics here: ask nginx's /metrics with the admin token")
        if not pipeline.metrics.enabled:
            return error_response(503, MISSING)
        body, content_type = pipeline.metrics.exposition(request.headers.get("accept", ""))
        return Response(body, media_type=content_type)

    schema = request_schema(pipeline.limits.text_chars, pipeline.modes)
    form_schema = {
        "type": "object",
        "properties": {
            **{k: {"type": "string"} for k in schema["properties"]},
            "prompt_audio": {
                "type": "string",
                "format": "binary",
                "description": f"{prompt_span(pipeline.limits.max_prompt_seconds)} of the voice to clone.",
            },
        },
        "required": ["text"],
    }
    described = {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": schema},
                "multipart/form-data": {"schema": form_schema},
            },
        },
        "responses": {"200": {"description": "WAV audio", "content": {"audio/wav": {}}}},
    }

    @app.post("/v1/tts", openapi_extra=described)
    async def tts(request: Request):
        pipeline.route(request.headers)  # (another instance would start it sooner: declined, nginx tries on)
        payload, prompt_data = await read_request(request, pipeline.limits)
        # A long text's segment (nginx passes the header only with the cluster's segment key):
        # its coordinator keeps the whole, and its speed is the OpenAI route's if it came from there.
        segment = SEGMENT_HEADER.lower() in request.headers
        speeds = OPENAI_SPEEDS if segment else (MIN_SPEED, MAX_SPEED)
        route = "segment" if segment else "api"
        job = await asyncio.get_running_loop().run_in_executor(
            None, lambda: pipeline.prepare(payload, prompt_data, speeds=speeds, route=route, headers=request.headers)
        )
        headers = {"X-Instance-Port": str(port), "X-Sample-Rate": str(engine.sample_rate)}
        if job.notices:
            headers["X-Prompt-Notice"] = "; ".join(job.notices)
        deadline = pipeline.deadline(request.headers.get("x-request-start"))
        source = audio_source(pipeline, fanout, job, payload, prompt_data, request.headers, deadline)
        if job.request.stream:
            first = await first_of(source, request)
            header = [wav_header(engine.sample_rate, None)]

            def encode(chunk: np.ndarray) -> bytes:
                return (header.pop() if header else b"") + pcm16(chunk)

            return AudioStream(pipeline, first, source, encode, bytes, "audio/wav", streaming_headers(headers))
        # (stopped when its client goes: a long text's segments, or the synthesis here)
        wav = await collect_wav(source, engine.sample_rate, request)
        headers["X-Audio-Seconds"] = f"{wav.seconds:.3f}"
        if not segment:
            headers["X-Output-File"] = await pipeline.run(None, pipeline.keep, wav)
        return Response(wav.data, media_type="audio/wav", headers=headers)

    add_openai_routes(app, pipeline, fanout, voice_map or {}, port)
    add_stream_route(app, pipeline, voice_map or {}, stream or StreamLimits(), policy)

    # Gradio is mounted at "/" and would answer everything else under /v1/ with its own 404.
    @app.api_route(
        "/v1/{path:path}", methods=["GET", "HEAD", "OPTIONS", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False
    )
    async def v1_unknown(request: Request, path: str):
        # a route that exists, asked with another method: say which methods it takes
        allowed = sorted(
            method
            for route in app.routes
            if getattr(route, "path", "") != "/v1/{path:path}" and getattr(route, "methods", None)
            for method in route.methods  # type: ignore[attr-defined]
            if route.matches({"type": "http", "path": request.url.path, "method": method})[0] is Match.FULL
        )
        if allowed:
            message = f"{request.method} is not allowed on {request.url.path}: use {' or '.join(allowed)}"
            return error_response(405, message, {"Allow": ", ".join(allowed)})
        return error_response(
            404,
            f"no endpoint /v1/{path}: the API is POST /v1/tts, POST /v1/audio/speech, GET /v1/models "
            "and /v1/audio/voices",
        )

    if ui:
        from cosyvoice_lb.instance.ui.app import mount_ui

        app = mount_ui(app, pipeline, port, fanout)
        app.add_middleware(UIErrors)  # (Gradio's refusals in the one shape)
    else:
        answer_without_ui(app)
    if cohort is not None:
        mount_cohort(app, cohort, SEGMENT_HEADER)
    app.add_middleware(RequestMetrics, metrics=pipeline.metrics, segment_header=SEGMENT_HEADER)
    if policy is not None:
        app.add_middleware(Gate, policy=policy)
    return app


def main(argv: list[str] | None = None) -> None:
    settings, args = parse_instance_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s instance:{args.port} %(levelname)s %(message)s")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    if args.starts_file:
        with open(args.starts_file, "a", encoding="utf-8") as starts:
            starts.write(f"{time.time():.3f} {os.getpid()}\n")

    import uvicorn

    pipeline, fanout = build_instance(settings, args)
    policy = PolicyFile(args.auth_file) if args.auth_file else None
    voice_map = parse_voice_map(settings.openai_voices)
    app = build_app(
        pipeline,
        settings.resolved_engine,
        args.port,
        policy=policy,
        fanout=fanout,
        voice_map=voice_map,
        ui=not settings.no_ui,
        cohort=Cohort("canary" if args.canary else "serving"),
        stream=StreamLimits(settings.stream_max_chars, settings.stream_idle_timeout, settings.stream_max_seconds),
    )

    def load() -> None:
        try:
            pipeline.load()
        except Exception as exc:  # the instance cannot serve: exit so supervision sees it
            error = f"{type(exc).__name__}: {exc}"
            pipeline.admission.fail(error)
            # (with its traceback: where in upstream's code, or vLLM's, it failed)
            log.error("engine %s failed to load: %s", settings.resolved_engine, error, exc_info=True)
            close_engine(pipeline.engine)
            logging.shutdown()
            os._exit(3)

    threading.Thread(target=load, name="engine-load", daemon=True).start()
    start_canary(
        settings.canary_interval,
        pipeline.admission,
        pipeline.watch,
        pipeline.canary,
        lambda: pipeline.probe.verdict.unchecked,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN,
        access_log=False,
    )
    outlive_uvicorns_signal()
    draining_server(config, pipeline.admission, settings.drain_timeout, pipeline.coordinating.count).run()
    if pipeline.ledger is not None and not pipeline.admission.snapshot().inflight:
        pipeline.ledger.clear_own()  # a graceful stop: what it cut short harmed nothing
    # (a synthesis still running past the drain timeout may be stuck: its mark stays as evidence)
    # Drained: leave now. A synthesis stuck in the engine must not keep the process (its
    # worker thread would be joined at interpreter exit); what the engine started goes first.
    close_engine(pipeline.engine)
    logging.shutdown()
    os._exit(0)
