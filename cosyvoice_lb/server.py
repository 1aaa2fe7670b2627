"""The instance: one engine behind an HTTP API, a Gradio UI and ``/ping``.

``app.py`` runs :func:`main` once per slot, bound to 127.0.0.1 on the slot's port; nginx
is the only public listener. The model loads in a background thread so ``/ping`` can
answer 503 "loading" meanwhile, and says ready only after one warm-up synthesis worked.
Every request is answered; a bad one gets a 4xx that says what to fix, and nothing a
client sends can take the process down.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import soundfile
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engines import Engine, EngineError, SynthesisRequest, create_engine

log = logging.getLogger("cosyvoice_lb.instance")

MIN_SPEED, MAX_SPEED = 0.5, 2.0
JSON_FIELDS = ("text", "speed")
NOT_READY = {
    "loading": "this instance is still loading its model: retry shortly",
    "draining": "this instance is shutting down: retry (another instance will answer)",
    "failed": "this instance failed to load its model: see its log",
    "ready": "this instance is not ready: retry shortly",
}


class BadRequest(ValueError):
    """Client input that cannot be served; the message tells the client what to change."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class InstanceState:
    """What ``/ping`` reports and the health loop judges."""

    engine_name: str
    port: int
    max_chars: int = 500
    ready: bool = False
    phase: str = "loading"  # loading, ready, draining, failed
    error: str = ""
    started: float = field(default_factory=time.time)
    served: int = 0
    failed: int = 0
    inflight: dict[str, float] = field(default_factory=dict)  # request id -> monotonic start
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ping(self) -> dict[str, Any]:
        now = time.monotonic()
        with self.lock:
            busy = max((now - t for t in self.inflight.values()), default=0.0)
            inflight = len(self.inflight)
        return {
            "ready": self.ready, "state": self.phase, "engine": self.engine_name,
            "port": self.port, "pid": os.getpid(), "inflight": inflight,
            "busy_seconds": round(busy, 3), "served": self.served, "failed": self.failed,
            "uptime": round(time.time() - self.started, 3), **({"error": self.error} if self.error else {}),
        }


def validate_tts(payload: Any, max_chars: int) -> SynthesisRequest:
    """A :class:`SynthesisRequest` from a decoded JSON body, or :class:`BadRequest`."""
    if not isinstance(payload, dict):
        raise BadRequest('the body must be a JSON object, e.g. {"text": "Hello", "speed": 1.0}')
    unknown = sorted(set(payload) - set(JSON_FIELDS))
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}: accepted fields are {', '.join(JSON_FIELDS)}")
    return make_request(payload.get("text"), payload.get("speed", 1.0), max_chars)


def make_request(text: Any, speed: Any, max_chars: int) -> SynthesisRequest:
    if text is None:
        raise BadRequest('"text" is missing: send the text to speak, e.g. {"text": "Hello"}')
    if not isinstance(text, str):
        raise BadRequest(f'"text" must be a string, not {type(text).__name__}')
    if not text.strip():
        raise BadRequest('"text" is empty: send some text to speak')
    if len(text) > max_chars:
        raise BadRequest(
            f'"text" has {len(text)} characters, more than the limit of {max_chars}: '
            "split it into shorter requests", status=413,
        )
    if isinstance(speed, bool) or not isinstance(speed, (int, float)):
        raise BadRequest(f'"speed" must be a number between {MIN_SPEED} and {MAX_SPEED}, not {speed!r}')
    if not (math.isfinite(speed) and MIN_SPEED <= speed <= MAX_SPEED):
        raise BadRequest(f'"speed" is {speed}: it must be between {MIN_SPEED} and {MAX_SPEED}')
    return SynthesisRequest(text=text, speed=float(speed))


class Instance:
    """The engine plus its bookkeeping; shared by the API and the UI."""

    def __init__(self, engine: Engine, state: InstanceState):
        self.engine = engine
        self.state = state

    def load(self) -> None:
        t0 = time.monotonic()
        self.engine.load()
        warm = self.synthesize(SynthesisRequest(text="Warm-up."), count=False)
        if warm.size == 0:
            raise EngineError("the warm-up synthesis returned no audio")
        if self.state.phase != "loading":  # stopped while loading: stay out
            return
        self.state.ready, self.state.phase = True, "ready"
        log.info("ready: engine %s loaded and warmed up in %.1fs", self.engine.name, time.monotonic() - t0)

    def synthesize(self, request: SynthesisRequest, count: bool = True) -> np.ndarray:
        rid = uuid.uuid4().hex
        with self.state.lock:
            self.state.inflight[rid] = time.monotonic()
        try:
            chunks = [np.asarray(c, dtype=np.float32).reshape(-1) for c in self.engine.synthesize(request)]
            audio = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
            if count:
                self.state.served += 1
            return audio
        except Exception:
            if count:
                self.state.failed += 1
            raise
        finally:
            with self.state.lock:
                self.state.inflight.pop(rid, None)


def wav_bytes(audio: np.ndarray, sample_rate: int) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.clip(audio, -1.0, 1.0), sample_rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "status": status}}, status_code=status)


def build_app(instance: Instance):
    """The FastAPI app: ``/ping``, ``/v1/tts`` and the Gradio UI at ``/``."""
    import gradio as gr

    state = instance.state
    app = FastAPI(title="cosyvoice-lb instance", docs_url=None, redoc_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        hint = {404: "see /ping, POST /v1/tts or the UI at /", 405: "check the method (POST /v1/tts)"}
        detail = exc.detail if isinstance(exc.detail, str) else "request refused"
        extra = hint.get(exc.status_code)
        return error_response(exc.status_code, f"{detail}: {extra}" if extra else detail)

    @app.api_route("/ping", methods=["GET", "HEAD"])
    async def ping():
        return JSONResponse(state.ping(), status_code=200 if state.ready else 503)

    @app.post("/v1/tts")
    async def tts(request: Request):
        body = await request.body()
        if not body.strip():
            return error_response(400, 'no body: POST JSON like {"text": "Hello", "speed": 1.0}')
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return error_response(400, f'the body is not valid JSON ({exc}): POST JSON like {{"text": "Hello"}}')
        try:
            synthesis = validate_tts(payload, state.max_chars)
        except BadRequest as exc:
            return error_response(exc.status, str(exc))
        if not state.ready:
            return error_response(503, NOT_READY[state.phase])
        try:
            audio = await run_in_threadpool(instance.synthesize, synthesis)
        except EngineError as exc:
            log.error("synthesis failed: %s", exc)
            return error_response(500, f"synthesis failed: {exc}")
        data = await run_in_threadpool(wav_bytes, audio, instance.engine.sample_rate)
        return Response(data, media_type="audio/wav", headers={
            "X-Instance-Port": str(state.port),
            "X-Audio-Seconds": f"{audio.size / instance.engine.sample_rate:.3f}",
        })

    # Gradio is mounted at "/" and would answer everything else under /v1/ with its own 404.
    @app.api_route("/v1/tts", methods=["GET", "PUT", "DELETE", "PATCH"])
    async def tts_wrong_method(request: Request):
        return JSONResponse({"error": {"message": f"{request.method} is not allowed on /v1/tts: POST JSON like "
                                                  '{"text": "Hello"}', "status": 405}},
                            status_code=405, headers={"Allow": "POST"})

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def v1_unknown(path: str):
        return error_response(404, f"no endpoint /v1/{path}: the API is POST /v1/tts")

    @app.exception_handler(Exception)
    async def unexpected(_request, exc: Exception):
        log.exception("unexpected error")
        return error_response(500, f"internal error ({type(exc).__name__}): the instance is still up; retry")

    def generate(text: str, speed: float):
        if not state.ready:
            raise gr.Error(NOT_READY[state.phase])
        try:
            synthesis = make_request(text, float(speed), state.max_chars)
        except BadRequest as exc:
            raise gr.Error(str(exc)) from None
        try:
            audio = instance.synthesize(synthesis)
        except EngineError as exc:
            raise gr.Error(f"Synthesis failed: {exc}") from None
        pcm = (np.clip(audio, -1.0, 1.0) * 32767).astype(np.int16)
        return instance.engine.sample_rate, pcm

    with gr.Blocks(title="cosyvoice-lb") as ui:
        gr.Markdown(f"## Text to speech\nEngine `{instance.engine.name}` · instance on port {state.port}")
        text = gr.Textbox(label="Text", lines=4, max_length=state.max_chars,
                          placeholder="Type what to say (English or 中文)")
        speed = gr.Slider(MIN_SPEED, MAX_SPEED, value=1.0, step=0.1, label="Speed")
        button = gr.Button("Generate", variant="primary")
        audio = gr.Audio(label="Speech", type="numpy", interactive=False)
        button.click(generate, inputs=[text, speed], outputs=audio, api_name="generate")

    return gr.mount_gradio_app(app, ui, path="/")


def draining_server(config, state: InstanceState, drain_timeout: float):
    """A uvicorn server that, on SIGTERM/SIGINT, first stops taking work and lets the
    syntheses in flight finish (at most ``drain_timeout``), then shuts down.

    Waiting for syntheses rather than for connections matters: a browser tab keeps
    Gradio's heartbeat stream open forever, and that must not hold a stop for the full
    drain time.
    """
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if state.phase == "draining":  # a second signal: stop now
                return super().handle_exit(sig, frame)
            state.ready, state.phase = False, "draining"
            log.info("stopping: draining %d synthesis(es) in flight (at most %gs)",
                     len(state.inflight), drain_timeout)

            def drain() -> None:
                deadline = time.monotonic() + drain_timeout
                while state.inflight and time.monotonic() < deadline:
                    time.sleep(0.05)
                if state.inflight:
                    log.warning("drain timeout: %d synthesis(es) still running", len(state.inflight))
                super(DrainingServer, self).handle_exit(sig, frame)

            threading.Thread(target=drain, name="drain", daemon=True).start()

    return DrainingServer(config)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="One cosyvoice-lb instance (run by supervisord).")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--engine", default="espeak")
    parser.add_argument("--max-chars", type=int, default=500)
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM")
    parser.add_argument("--starts-file", default="",
                        help="a line is appended here at every start (restart counting)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s instance:{args.port} %(levelname)s %(message)s")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    if args.starts_file:
        with open(args.starts_file, "a", encoding="utf-8") as starts:
            starts.write(f"{time.time():.3f} {os.getpid()}\n")

    import uvicorn

    state = InstanceState(engine_name=args.engine, port=args.port, max_chars=args.max_chars)
    instance = Instance(create_engine(args.engine), state)
    app = build_app(instance)

    def load() -> None:
        try:
            instance.load()
        except Exception as exc:  # the instance cannot serve: exit so supervision sees it
            state.phase, state.error = "failed", f"{type(exc).__name__}: {exc}"
            log.error("engine %s failed to load: %s", args.engine, state.error)
            logging.shutdown()
            os._exit(3)

    threading.Thread(target=load, name="engine-load", daemon=True).start()
    # After the drain, connections that are only streams (Gradio heartbeats) get 2 s.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=2, access_log=False)
    draining_server(config, state, args.drain_timeout).run()
