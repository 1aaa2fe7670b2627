"""The instance: one engine behind an HTTP API, a Gradio UI and ``/ping``.

``app.py`` runs :func:`main` once per slot, bound to 127.0.0.1 on the slot's port; nginx
is the only public listener. The model loads in a background thread so ``/ping`` can
answer 503 "loading" meanwhile, and says ready only after one warm-up synthesis worked.
Every request is answered; a bad one gets a 4xx that says what to fix, and nothing a
client sends can take the process down.

This module is the HTTP edge: ``/v1/tts`` decodes JSON or a form and hands it to the one
pipeline (``pipeline.py``), whose exceptions become answers through one table registered
here once; the UI (``ui.py``) is another adapter onto the same pipeline.

It runs in the model's Python environment (for CosyVoice: upstream's pins, gradio 5.x),
which has none of the launcher's packages: only the standard library, numpy, soundfile,
fastapi/starlette and gradio are imported here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from .admission import Admission, Snapshot
from .audio import Outputs, pcm16, streaming_wav_header
from .auth import PolicyFile
from .engines import create_engine
from .gate import Gate
from .ledger import Ledger
from .pipeline import ERRORS, Job, NoAudio, Pipeline, StorageFailed, describe
from .planner import parse_size
from .settings import Settings, parse_instance_args
from .timeouts import GRACEFUL_SHUTDOWN
from .validation import FIELDS, BadRequest, Limits, form_payload, request_schema, safe

log = logging.getLogger("cosyvoice_lb.instance")


def ping_body(snapshot: Snapshot, engine: str, port: int, started: float) -> dict[str, Any]:
    """What ``/ping`` says: readiness, and per synthesis the seconds since its last chunk (a
    synthesis making no progress is what "hung" means to the health loop)."""
    return {
        "ready": snapshot.ready,
        "state": snapshot.phase.value,
        "engine": engine,
        "port": port,
        "pid": os.getpid(),
        "inflight": snapshot.inflight,
        "waiting": snapshot.waiting,
        "busy_seconds": snapshot.busy_seconds,
        "stalled_seconds": list(snapshot.stalled_seconds),
        "served": snapshot.served,
        "failed": snapshot.failed,
        "uptime": round(time.time() - started, 3),
        **({"error": snapshot.error} if snapshot.error else {}),
    }


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    # (a message that quotes client input must still encode: lone surrogates are escaped)
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse({"error": {"message": message, "status": status}}, status_code=status, headers=headers)


def multipart_problem(content_type: str, body: bytes) -> str:
    """What is wrong with a multipart body's frame ("" if nothing): a body cut off inside a
    file part would otherwise be read as a shorter file."""
    boundary = ""
    for param in content_type.split(";")[1:]:
        key, _, value = param.strip().partition("=")
        if key.lower() == "boundary":
            boundary = value.strip('"')
    if not boundary:
        return "its Content-Type names no boundary"
    closing = b"--" + boundary.encode("latin-1", "replace") + b"--"
    if not body.rstrip(b"\r\n").endswith(closing):
        return f"it does not end with its closing boundary --{safe(boundary, 40)}--: cut off, or a different boundary"
    return ""


async def read_request(request: Request, limits: Limits) -> tuple[dict, bytes | None]:
    """The API's input: JSON, or a form with the prompt audio as the file ``prompt_audio``."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    # `curl -d '{...}'` labels JSON as a urlencoded form: a body that starts like JSON is JSON.
    if kind == "application/x-www-form-urlencoded" and (await request.body()).lstrip()[:1] in (b"{", b"["):
        kind = "application/json"
    if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
        if kind == "multipart/form-data":
            problem = multipart_problem(request.headers["content-type"], await request.body())
            if problem:
                raise BadRequest(f"the form could not be read ({problem}): send the whole multipart/form-data body")
        try:
            form = await request.form(max_files=1, max_fields=len(FIELDS) + 1)
        except Exception as exc:  # malformed multipart, too many parts
            raise BadRequest(f"the form could not be read ({exc}): send multipart/form-data") from None
        upload = form.get("prompt_audio")
        fields = {k: v for k, v in form.items() if k != "prompt_audio"}
        if any(not isinstance(v, str) for v in fields.values()):
            raise BadRequest("only prompt_audio may be a file; the other fields are text")
        data = None
        if upload is not None and not isinstance(upload, str):
            data = await upload.read(limits.max_upload_bytes + 1)
            if len(data) > limits.max_upload_bytes:
                raise BadRequest(
                    f"prompt_audio is larger than {limits.max_upload_bytes // 2**20} MiB: send 3-15 s of speech",
                    status=413,
                )
        elif isinstance(upload, str) and upload:
            raise BadRequest("prompt_audio must be a file upload, not a text field")
        return form_payload({k: str(v) for k, v in fields.items()}), data
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


class SynthesisStream(Response):
    """A streamed WAV answer that watches its client: when the client goes away the
    synthesis stops at its next chunk and its engine slot is free at once (a plain
    streaming response would notice only once the socket's buffers are full)."""

    def __init__(
        self,
        pipeline: Pipeline,
        job: Job,
        first: np.ndarray,
        rest: Iterator[np.ndarray],
        cancelled: threading.Event,
        headers: dict[str, str],
    ):
        super().__init__(media_type="audio/wav", headers=headers)
        # (a body of unknown length: no Content-Length, chunked transfer)
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k.lower() != b"content-length"]
        self.pipeline, self.job, self.first, self.rest, self.cancelled = pipeline, job, first, rest, cancelled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        chunks = [self.first]
        complete = False

        async def watch() -> None:
            while not self.cancelled.is_set():
                if (await receive())["type"] == "http.disconnect":
                    self.cancelled.set()

        def following() -> bytes | None:
            chunk = next(self.rest, None)
            if chunk is None:
                return None
            chunks.append(chunk)
            return pcm16(chunk)

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send(
                {
                    "type": "http.response.body",
                    "more_body": True,
                    "body": streaming_wav_header(self.pipeline.engine.sample_rate) + pcm16(self.first),
                }
            )
            while not self.cancelled.is_set():
                try:
                    data = await loop.run_in_executor(self.pipeline.workers, following)
                except Exception as exc:  # the status is sent already: end the stream, keep the instance
                    failure = describe(exc)
                    log.log(failure.level if failure else logging.ERROR, "streaming synthesis failed: %s", exc)
                    complete = True  # what it made is kept, as any result
                    break
                if data is None:
                    complete = not self.cancelled.is_set()
                    break
                await send({"type": "http.response.body", "body": data, "more_body": True})
            if not self.cancelled.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we wrote
            self.cancelled.set()
        finally:
            watcher.cancel()
            if not complete:
                self.cancelled.set()  # a generator still in a worker stops at its next chunk
            # (in a worker: the generator may still be in one, finishing its current chunk)
            await loop.run_in_executor(self.pipeline.workers, self.close, chunks if complete else None)

    def close(self, chunks: list[np.ndarray] | None) -> None:
        close = getattr(self.rest, "close", None)
        try:
            if close is not None:
                close()  # frees the engine slot now, also when the client went away
        except ValueError:  # still running in a worker (the task was cancelled): it stops on its own
            pass
        self.pipeline.finish(self.job)
        if chunks:
            try:
                self.pipeline.keep(np.concatenate(chunks))
            except StorageFailed as exc:  # the client has its audio already: only the copy is lost
                log.error("%s", exc)


def build_app(
    pipeline: Pipeline,
    engine_name: str = "",
    port: int = 0,
    started: float | None = None,
    policy: PolicyFile | None = None,
) -> Any:
    """The FastAPI app: ``/ping``, ``/v1/tts`` and the Gradio UI at ``/``; with a ``policy``,
    all but ``/ping`` behind the gate (``gate.py``)."""
    engine, admission = pipeline.engine, pipeline.admission
    started = time.time() if started is None else started
    app = FastAPI(title="cosyvoice-lb instance", docs_url=None, redoc_url=None)

    def answer(_request: Request, exc: Exception) -> JSONResponse:
        failure = describe(exc)
        if failure is None:
            log.exception("unexpected error", exc_info=exc)
            return error_response(500, f"internal error ({type(exc).__name__}): the instance is still up; retry")
        if failure.level >= logging.WARNING:
            log.log(failure.level, "%s: %s", failure.status, failure.message)
        return error_response(failure.status, failure.message, failure.headers or None)

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
        snapshot = admission.snapshot()
        body = ping_body(snapshot, engine_name or engine.name, port, started)
        return JSONResponse(body, status_code=200 if snapshot.ready else 503)

    # What nginx answers a public /ping with: ready or not, no process details.
    @app.head("/ping/brief", include_in_schema=False)
    @app.get("/ping/brief", include_in_schema=False)
    async def ping_brief():
        ready = admission.snapshot().ready
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    schema = request_schema(pipeline.limits.max_chars, pipeline.modes)
    form_schema = {
        "type": "object",
        "properties": {
            **{k: {"type": "string"} for k in schema["properties"]},
            "prompt_audio": {"type": "string", "format": "binary", "description": "3-15 s of the voice to clone."},
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
        payload, prompt_data = await read_request(request, pipeline.limits)
        job: Job | None = await asyncio.get_running_loop().run_in_executor(None, pipeline.prepare, payload, prompt_data)
        assert job is not None
        try:
            headers = {"X-Instance-Port": str(port), "X-Sample-Rate": str(engine.sample_rate)}
            if job.notices:
                headers["X-Prompt-Notice"] = "; ".join(job.notices)
            deadline = pipeline.deadline(request.headers.get("x-request-start"))
            if job.request.stream:
                # The first chunk is made before answering, so a refused input is still a 4xx/5xx.
                cancelled = threading.Event()
                chunks = pipeline.chunks(job, bounded=True, deadline=deadline, cancelled=cancelled)
                try:
                    first = await pipeline.run(deadline, next, chunks, None)
                    if first is None:
                        raise NoAudio()
                except BaseException:
                    cancelled.set()  # a synthesis still in its worker (timed out) stops at its next chunk
                    try:
                        chunks.close()  # type: ignore[attr-defined]
                    except ValueError:  # still running in that worker: it releases its slot itself
                        pass
                    raise
                streamed, job = job, None  # the stream finishes it
                return SynthesisStream(pipeline, streamed, first, chunks, cancelled, headers)
            audio = await pipeline.run(deadline, lambda: pipeline.synthesize(job, bounded=True, deadline=deadline))
            data = await pipeline.run(None, pipeline.encode_wav, audio)
            name = await pipeline.run(None, pipeline.keep, audio)
            headers.update({"X-Audio-Seconds": f"{audio.size / engine.sample_rate:.3f}", "X-Output-File": name})
            return Response(data, media_type="audio/wav", headers=headers)
        finally:
            if job is not None:
                pipeline.finish(job)

    # Gradio is mounted at "/" and would answer everything else under /v1/ with its own 404.
    @app.api_route("/v1/tts", methods=["GET", "HEAD", "OPTIONS", "PUT", "DELETE", "PATCH"], include_in_schema=False)
    async def tts_wrong_method(request: Request):
        return JSONResponse(
            {
                "error": {
                    "message": f'{request.method} is not allowed on /v1/tts: POST JSON like {{"text": "Hello"}}',
                    "status": 405,
                }
            },
            status_code=405,
            headers={"Allow": "POST"},
        )

    @app.api_route(
        "/v1/{path:path}", methods=["GET", "HEAD", "OPTIONS", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False
    )
    async def v1_unknown(path: str):
        return error_response(404, f"no endpoint /v1/{path}: the API is POST /v1/tts")

    from .ui import mount_ui

    app = mount_ui(app, pipeline, port)
    if policy is not None:
        app.add_middleware(Gate, policy=policy)
    return app


def draining_server(config: Any, admission: Admission, drain_timeout: float) -> Any:
    """A uvicorn server that, on SIGTERM/SIGINT, first stops taking work and lets the
    syntheses in flight finish (at most ``drain_timeout``), then shuts down.

    Waiting for syntheses rather than for connections matters: a browser tab keeps
    Gradio's heartbeat stream open forever, and that must not hold a stop for the full
    drain time.
    """
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not admission.drain():  # a second signal: stop now
                return super().handle_exit(sig, frame)
            log.info(
                "stopping: draining %d synthesis(es) in flight (at most %gs)",
                admission.snapshot().inflight,
                drain_timeout,
            )

            def drain() -> None:
                deadline = time.monotonic() + drain_timeout
                while admission.snapshot().inflight and time.monotonic() < deadline:
                    time.sleep(0.05)
                if admission.snapshot().inflight:
                    log.warning("drain timeout: %d synthesis(es) still running", admission.snapshot().inflight)
                super(DrainingServer, self).handle_exit(sig, frame)

            threading.Thread(target=drain, name="drain", daemon=True).start()

    return DrainingServer(config)


def build_pipeline(settings: Settings, port: int, ledger_dir: str = "") -> Pipeline:
    """The instance's pipeline for its settings (as parsed from its command line)."""
    engine = create_engine(settings.resolved_engine, **asdict(settings))
    limits = Limits(
        max_chars=settings.max_chars,
        max_prompt_seconds=settings.max_prompt_seconds,
        max_upload_bytes=parse_size(settings.max_upload),
    )
    outputs = Outputs(settings.outputs_dir, port, settings.outputs_max_age, parse_size(settings.outputs_max_size))
    # Prompt uploads are written for upstream as files; leftovers of a killed run go at start.
    scratch = os.path.join(settings.outputs_dir, ".prompts") if settings.outputs_dir else tempfile.gettempdir()
    os.makedirs(scratch, exist_ok=True, mode=0o700)
    for stale in os.listdir(scratch):
        if stale.startswith(f"prompt-{port}-"):
            try:
                os.unlink(os.path.join(scratch, stale))
            except FileNotFoundError:
                pass
    admission = Admission(settings.instance_concurrency, settings.max_queue)
    ledger = Ledger(ledger_dir) if ledger_dir else None
    return Pipeline(
        engine, admission, limits, outputs, scratch, port=port, request_timeout=settings.request_timeout, ledger=ledger
    )


def main(argv: list[str] | None = None) -> None:
    settings, args = parse_instance_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s instance:{args.port} %(levelname)s %(message)s")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    if args.starts_file:
        with open(args.starts_file, "a", encoding="utf-8") as starts:
            starts.write(f"{time.time():.3f} {os.getpid()}\n")

    import uvicorn

    pipeline = build_pipeline(settings, args.port, args.ledger_dir)
    policy = PolicyFile(args.auth_file) if args.auth_file else None
    app = build_app(pipeline, settings.resolved_engine, args.port, policy=policy)

    def load() -> None:
        try:
            pipeline.load()
        except Exception as exc:  # the instance cannot serve: exit so supervision sees it
            error = f"{type(exc).__name__}: {exc}"
            pipeline.admission.fail(error)
            log.error("engine %s failed to load: %s", settings.resolved_engine, error)
            logging.shutdown()
            os._exit(3)

    threading.Thread(target=load, name="engine-load", daemon=True).start()
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN,
        access_log=False,
    )
    draining_server(config, pipeline.admission, settings.drain_timeout).run()
    if pipeline.ledger is not None and not pipeline.admission.snapshot().inflight:
        pipeline.ledger.clear_own()  # a graceful stop: what it cut short harmed nothing
    # (a synthesis still running past the drain timeout may be stuck: its mark stays as evidence)
    # Drained: leave now. A synthesis stuck in the engine must not keep the process (its
    # worker thread would be joined at interpreter exit).
    logging.shutdown()
    os._exit(0)
