"""The instance: one engine behind an HTTP API, a Gradio UI and ``/ping``.

``app.py`` runs :func:`main` once per slot, bound to 127.0.0.1 on the slot's port; nginx
is the only public listener. The model loads in a background thread so ``/ping`` can
answer 503 "loading" meanwhile, and says ready only after one warm-up synthesis worked.
Every request is answered; a bad one gets a 4xx that says what to fix, and nothing a
client sends can take the process down.

It runs in the model's Python environment (for CosyVoice: upstream's pins, gradio 5.x),
which has none of the launcher's packages: only the standard library, numpy, soundfile,
fastapi/starlette and gradio are imported here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .audio import Outputs, PromptError, pcm16, read_prompt, streaming_wav_header, wav_bytes, write_wav
from .engines import MODES, Engine, EngineError, SynthesisRequest, create_engine

log = logging.getLogger("cosyvoice_lb.instance")

MIN_SPEED, MAX_SPEED = 0.5, 2.0
FIELDS = ("text", "speed", "mode", "prompt_text", "instruct_text", "speaker", "seed", "stream")
MODE_LABELS = {"zero_shot": "Zero-shot clone (prompt audio + its transcript)",
               "cross_lingual": "Cross-lingual clone (prompt audio)",
               "instruct": "Instruct (style in words)", "sft": "Built-in speaker"}
NOT_READY = {
    "loading": "this instance is still loading its model: retry shortly",
    "draining": "this instance is shutting down: retry (another instance will answer)",
    "failed": "this instance failed to load its model: see its log",
    "ready": "this instance is not ready: retry shortly",
}


class Overloaded(RuntimeError):
    """Every engine slot is busy and the queue is full: answered 503 at once, so nginx
    tries another instance instead of the client waiting here."""


class TimedOut(RuntimeError):
    """The request's time (--request-timeout, counted from its arrival at nginx, retries
    included) ran out: answered 504 with this message."""


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
    # synthesis id -> [monotonic start, monotonic time of its last chunk (or start)]
    inflight: dict[str, list[float]] = field(default_factory=dict)
    waiting: int = 0  # requests queued for the engine (--instance-concurrency)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ping(self) -> dict[str, Any]:
        now = time.monotonic()
        with self.lock:
            busy = max((now - start for start, _ in self.inflight.values()), default=0.0)
            # (last is +inf while a chunk waits for its consumer: a slow reader is not a hang)
            stalled = sorted((round(max(0.0, now - last), 3) for _, last in self.inflight.values()), reverse=True)
            inflight, waiting = len(self.inflight), self.waiting
        return {
            "ready": self.ready, "state": self.phase, "engine": self.engine_name,
            "port": self.port, "pid": os.getpid(), "inflight": inflight, "waiting": waiting,
            # the longest-running synthesis, and per synthesis the seconds since its last
            # chunk: a synthesis making no progress is what "hung" means to the health loop
            "busy_seconds": round(busy, 3), "stalled_seconds": stalled,
            "served": self.served, "failed": self.failed,
            "uptime": round(time.time() - self.started, 3), **({"error": self.error} if self.error else {}),
        }


# --- request validation (pure) -----------------------------------------------------------

@dataclass(frozen=True)
class Limits:
    max_chars: int = 500
    max_prompt_seconds: float = 15.0
    max_upload_bytes: int = 10 * 1024 * 1024


def check_text(text: Any, max_chars: int, name: str = "text", required: bool = True) -> str:
    if text is None or (text == "" and not required):
        if required:
            raise BadRequest(f'"{name}" is missing: send the text to speak, e.g. {{"{name}": "Hello"}}')
        return ""
    if not isinstance(text, str):
        raise BadRequest(f'"{name}" must be a string, not {type(text).__name__}')
    if required and not text.strip():
        raise BadRequest(f'"{name}" is empty: send some text')
    if len(text) > max_chars:
        raise BadRequest(f'"{name}" has {len(text)} characters, more than the limit of {max_chars}: '
                         "split it into shorter requests", status=413)
    return text


def check_speed(speed: Any) -> float:
    if isinstance(speed, bool) or not isinstance(speed, (int, float)):
        raise BadRequest(f'"speed" must be a number between {MIN_SPEED} and {MAX_SPEED}, not {speed!r}')
    if not (math.isfinite(speed) and MIN_SPEED <= speed <= MAX_SPEED):
        raise BadRequest(f'"speed" is {speed}: it must be between {MIN_SPEED} and {MAX_SPEED}')
    return float(speed)


def check_seed(seed: Any) -> int | None:
    if seed is None or seed == "":
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise BadRequest(f'"seed" must be a whole number from 0 to {2**32 - 1}, not {seed!r}')
    return seed


def make_request(payload: dict, limits: Limits, modes: tuple[str, ...], speakers: list[str],
                 has_prompt: bool) -> SynthesisRequest:
    """Validate one request (already decoded: JSON or form) against what the engine offers.

    ``has_prompt``: prompt audio came with it. Raises :class:`BadRequest`.
    """
    unknown = sorted(set(payload) - set(FIELDS))
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}: accepted fields are {', '.join(FIELDS)}"
                         " (and the file prompt_audio in a multipart form)")
    text = check_text(payload.get("text"), limits.max_chars)
    speed = check_speed(payload.get("speed", 1.0))
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f'"stream" must be true or false, not {stream!r}')
    if stream and speed != 1.0:
        raise BadRequest('"speed" works only without streaming: drop "stream" or use speed 1.0')
    mode = payload.get("mode") or ""
    if not isinstance(mode, str):
        raise BadRequest(f'"mode" must be a string, one of {", ".join(MODES)}')
    if mode and mode not in MODES:
        raise BadRequest(f'unknown mode {mode!r}: choose one of {", ".join(MODES)}')
    if mode and mode not in modes:
        raise BadRequest(f'mode {mode} is not available with this model: choose one of {", ".join(modes)}')
    effective = mode or modes[0]
    prompt_text = check_text(payload.get("prompt_text", ""), limits.max_chars, "prompt_text", required=False)
    instruct_text = check_text(payload.get("instruct_text", ""), limits.max_chars, "instruct_text", required=False)
    speaker = payload.get("speaker") or ""
    if not isinstance(speaker, str):
        raise BadRequest('"speaker" must be a string')
    if speaker and speaker not in speakers:
        raise BadRequest(f'unknown speaker {speaker!r}: choose one of {", ".join(speakers) or "(none: this model has no built-in speakers)"}')
    needs_prompt = effective in ("zero_shot", "cross_lingual") or (effective == "instruct" and not speakers)
    if mode and needs_prompt and not has_prompt:
        raise BadRequest(f"mode {mode} needs prompt_audio: send a multipart form with the file prompt_audio "
                         "(3-15 s of the voice to clone)")
    if effective == "zero_shot" and (mode or has_prompt) and not prompt_text.strip():
        raise BadRequest("mode zero_shot needs prompt_text: the exact transcript of prompt_audio")
    if effective == "instruct" and not instruct_text.strip():
        raise BadRequest('mode instruct needs instruct_text, e.g. "Speak slowly and warmly"')
    return SynthesisRequest(text=text, speed=speed, mode=mode, prompt_text=prompt_text, instruct_text=instruct_text,
                            speaker=speaker, seed=check_seed(payload.get("seed")), stream=stream)


def form_payload(form: dict[str, str]) -> dict:
    """Form fields are strings: give speed, seed and stream their JSON types."""
    payload: dict[str, Any] = {k: v for k, v in form.items() if v != ""}
    for name, kind in (("speed", float), ("seed", int)):
        if name in payload:
            try:
                payload[name] = kind(payload[name])
            except ValueError:
                raise BadRequest(f'"{name}" must be a number, not {payload[name]!r}') from None
    if "stream" in payload:
        value = payload["stream"].strip().lower()
        if value not in ("true", "false", "1", "0", "yes", "no"):
            raise BadRequest(f'"stream" must be true or false, not {payload["stream"]!r}')
        payload["stream"] = value in ("true", "1", "yes")
    return payload


# --- the instance --------------------------------------------------------------------------

class Instance:
    """The engine plus its bookkeeping; shared by the API and the UI."""

    def __init__(self, engine: Engine, state: InstanceState, limits: Limits = Limits(), concurrency: int = 1,
                 outputs: Outputs | None = None, scratch: str = "", max_queue: int | None = None,
                 request_timeout: float = 0.0):
        self.engine = engine
        self.request_timeout = request_timeout  # seconds per API request, retries included; 0: none
        self.state = state
        self.limits = limits
        self.concurrency = max(1, concurrency)
        self.max_queue = max_queue  # API requests allowed to wait for a slot; None: no bound
        self.slots = threading.BoundedSemaphore(self.concurrency)
        self.outputs = outputs or Outputs("", state.port, 0, 0)
        self.scratch = scratch or tempfile.gettempdir()
        # API syntheses run here rather than in the server's shared pool: a request whose
        # time ran out is answered while a stuck engine call keeps only its own thread.
        self.workers = ThreadPoolExecutor(max_workers=32, thread_name_prefix="synthesis")

    def deadline(self, started_header: str | None) -> float | None:
        """The monotonic time by which an API request must be answered (None: no bound).

        nginx stamps ``X-Request-Start`` once per client request, so a retry on another
        instance keeps the time already spent; without it the bound counts from here.
        """
        if not self.request_timeout:
            return None
        wall, mono = time.time(), time.monotonic()
        started = wall
        try:
            stamped = float(started_header or "")
            if wall - self.request_timeout - 60 < stamped <= wall + 1:  # same host; tolerate nothing odd
                started = min(stamped, wall)
        except ValueError:
            pass
        return mono + (started + self.request_timeout - wall)

    async def run(self, deadline: float | None, fn, *args):
        """``fn(*args)`` in a synthesis worker; past the deadline (plus a moment for the
        worker's own, clearer timeout) the request is answered while the worker runs on."""
        future = asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)
        if deadline is None:
            return await future
        try:
            return await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()) + 1.0)
        except asyncio.TimeoutError:
            raise TimedOut(f"no answer within the request timeout ({self.request_timeout:g}s): the synthesis "
                           "is stuck or too long for the bound; retry (the health loop restarts hung "
                           "instances), send shorter text, or raise --request-timeout") from None

    def load(self) -> None:
        t0 = time.monotonic()
        self.engine.load()
        try:
            warm_up = self.warm_up_request()
        except BadRequest as exc:  # a cloning-only model and no bundled prompt to clone
            warm_up = None
            log.warning("no warm-up synthesis (%s): ready after loading only", exc)
        if warm_up is not None and self.synthesize(warm_up, count=False).size == 0:
            raise EngineError("the warm-up synthesis returned no audio")
        if self.state.phase != "loading":  # stopped while loading: stay out
            return
        self.state.ready, self.state.phase = True, "ready"
        log.info("ready: engine %s loaded and warmed up in %.1fs (modes: %s)", self.engine.name,
                 time.monotonic() - t0, ", ".join(self.engine.modes))

    def warm_up_request(self) -> SynthesisRequest:
        return self.complete(SynthesisRequest(text="Warm-up."))

    def complete(self, request: SynthesisRequest) -> SynthesisRequest:
        """Fill what the client left to the engine: the default mode and, for a cloning mode
        without prompt audio, the engine's bundled prompt."""
        mode = request.mode or self.engine.modes[0]
        if mode in ("zero_shot", "cross_lingual", "instruct") and not request.prompt_wav:
            default = getattr(self.engine, "default_prompt", lambda: ("", ""))()
            if mode == "instruct" and self.engine.speakers():
                default = ("", "")
            if default[0]:
                request = replace(request, prompt_wav=default[0], prompt_text=request.prompt_text or default[1])
            elif mode != "instruct" or not self.engine.speakers():
                raise BadRequest(f"mode {mode} needs prompt_audio and this model has no default prompt: "
                                 "send prompt_audio")
        if mode == "instruct" and not request.instruct_text:
            request = replace(request, instruct_text="Speak naturally.")
        return replace(request, mode=mode)

    def stream(self, request: SynthesisRequest, count: bool = True, bounded: bool = False,
               deadline: float | None = None, chunk_deadline: bool = False) -> Iterator[np.ndarray]:
        """Chunks as the engine makes them, one synthesis at a time per engine slot.

        ``bounded``: refuse with :class:`Overloaded` when the slots and the queue are full.
        ``deadline`` (monotonic): waiting for a slot past it raises :class:`TimedOut`; with
        ``chunk_deadline`` the synthesis itself stops at the first chunk after it, too.
        """
        with self.state.lock:
            busy = len(self.state.inflight) + self.state.waiting
            if bounded and self.max_queue is not None and busy >= self.concurrency + self.max_queue:
                raise Overloaded(f"this instance is busy ({len(self.state.inflight)} synthesizing, "
                                 f"{self.state.waiting} waiting): retry, another instance may be free")
            self.state.waiting += 1
        try:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.slots.acquire(timeout=wait):
                raise TimedOut(f"no engine slot came free within the request timeout ({wait:.0f}s left "
                               "when it arrived here): the cluster is overloaded, retry later")
        finally:
            with self.state.lock:
                self.state.waiting -= 1
        rid = uuid.uuid4().hex
        with self.state.lock:
            now = time.monotonic()
            self.state.inflight[rid] = [now, now]  # busy time counts from here, not the queue
        try:
            for chunk in self.engine.synthesize(request):
                if chunk_deadline and deadline is not None and time.monotonic() > deadline:
                    raise TimedOut("the synthesis ran past the request timeout: send shorter text, stream "
                                   "it (\"stream\": true), or raise --request-timeout")
                with self.state.lock:  # the engine made a chunk; now it is the consumer's turn
                    self.state.inflight[rid][1] = math.inf
                yield np.asarray(chunk, dtype=np.float32).reshape(-1)
                with self.state.lock:  # back in the engine: stall time counts from here
                    self.state.inflight[rid][1] = time.monotonic()
            if count:
                self.state.served += 1
        except GeneratorExit:
            raise
        except Exception:
            if count:
                self.state.failed += 1
            raise
        finally:
            with self.state.lock:
                self.state.inflight.pop(rid, None)
            self.slots.release()

    def synthesize(self, request: SynthesisRequest, count: bool = True, bounded: bool = False,
                   deadline: float | None = None) -> np.ndarray:
        chunks = list(self.stream(request, count, bounded, deadline, chunk_deadline=True))
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)

    def keep(self, audio: np.ndarray) -> str:
        """Save a result in the outputs dir; a full disk must not cost the client its answer."""
        try:
            return self.outputs.save(audio, self.engine.sample_rate)
        except OSError as exc:
            log.error("could not keep the result in the outputs dir: %s", exc)
            return ""

    def prepare_prompt(self, data: bytes) -> tuple[str, list[str]]:
        """Decode an upload and write it as the WAV file upstream wants; (path, notices)."""
        prompt = read_prompt(data, self.limits.max_prompt_seconds)
        path = os.path.join(self.scratch, f"prompt-{self.state.port}-{uuid.uuid4().hex}.wav")
        write_wav(path, prompt.audio, prompt.rate)
        return path, prompt.notices


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "status": status}}, status_code=status, headers=headers)


def _remove(path: str) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def build_app(instance: Instance):
    """The FastAPI app: ``/ping``, ``/v1/tts`` and the Gradio UI at ``/``."""
    state, engine, limits = instance.state, instance.engine, instance.limits
    app = FastAPI(title="cosyvoice-lb instance", docs_url=None, redoc_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else "request refused"
        return error_response(exc.status_code, detail)

    @app.api_route("/ping", methods=["GET", "HEAD"])
    async def ping():
        return JSONResponse(state.ping(), status_code=200 if state.ready else 503)

    async def read_request(request: Request) -> tuple[dict, bytes | None]:
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        # `curl -d '{...}'` labels JSON as a urlencoded form: a body that starts like JSON is JSON.
        if kind == "application/x-www-form-urlencoded" and (await request.body()).lstrip()[:1] in (b"{", b"["):
            kind = "application/json"
        if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
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
                    raise BadRequest(f"prompt_audio is larger than {limits.max_upload_bytes // 2**20} MiB: "
                                     "send 3-15 s of speech", status=413)
            elif isinstance(upload, str) and upload:
                raise BadRequest("prompt_audio must be a file upload, not a text field")
            return form_payload(fields), data
        body = await request.body()
        if not body.strip():
            raise BadRequest('no body: POST JSON like {"text": "Hello", "speed": 1.0}, '
                             "or a multipart form with prompt_audio")
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadRequest(f'the body is not valid JSON ({exc}): POST JSON like {{"text": "Hello"}}') from None
        if not isinstance(payload, dict):
            raise BadRequest('the body must be a JSON object, e.g. {"text": "Hello", "speed": 1.0}')
        return payload, None

    @app.post("/v1/tts")
    async def tts(request: Request):
        prompt_path = ""
        try:
            payload, prompt_data = await read_request(request)
            synthesis = make_request(payload, limits, engine.modes or ("sft",), engine.speakers(),
                                     has_prompt=prompt_data is not None)
            if not state.ready:
                return error_response(503, NOT_READY[state.phase], {"Retry-After": "2"})
            notices: list[str] = []
            if prompt_data is not None:
                prompt_path, notices = await run_in_threadpool(instance.prepare_prompt, prompt_data)
                synthesis = replace(synthesis, prompt_wav=prompt_path)
            synthesis = instance.complete(synthesis)
        except (BadRequest, PromptError) as exc:
            _remove(prompt_path)
            return error_response(getattr(exc, "status", 400), str(exc))
        headers = {"X-Instance-Port": str(state.port), "X-Sample-Rate": str(engine.sample_rate)}
        if notices:
            headers["X-Prompt-Notice"] = "; ".join(notices)
        deadline = instance.deadline(request.headers.get("x-request-start"))
        if synthesis.stream:
            # The first chunk is made before answering, so a refused input is still a 4xx/5xx.
            chunks = instance.stream(synthesis, bounded=True, deadline=deadline)
            try:
                first = await instance.run(deadline, next, chunks, None)
            except Overloaded as exc:
                _remove(prompt_path)
                return error_response(503, str(exc), {"Retry-After": "1"})
            except TimedOut as exc:
                _remove(prompt_path)
                return error_response(504, str(exc))
            except EngineError as exc:
                _remove(prompt_path)
                return error_response(500, f"synthesis failed: {exc}")
            except AssertionError as exc:
                _remove(prompt_path)
                return error_response(422, f"the model refused this input: {exc}")
            if first is None:
                _remove(prompt_path)
                return error_response(422, "the model produced no audio for this text: send words to speak")
            return StreamingResponse(stream_wav(first, chunks, prompt_path), media_type="audio/wav",
                                     headers=headers)
        try:
            audio = await instance.run(deadline, instance.synthesize, synthesis, True, True, deadline)
        except Overloaded as exc:
            return error_response(503, str(exc), {"Retry-After": "1"})
        except TimedOut as exc:
            log.warning("request timed out: %s", exc)
            return error_response(504, str(exc))
        except EngineError as exc:
            log.error("synthesis failed: %s", exc)
            return error_response(500, f"synthesis failed: {exc}")
        except AssertionError as exc:  # upstream checks its input with assert
            log.error("the model refused the input: %s", exc)
            return error_response(422, f"the model refused this input: {exc}")
        finally:
            _remove(prompt_path)
        data = await run_in_threadpool(wav_bytes, audio, engine.sample_rate)
        if audio.size == 0:  # e.g. text of punctuation only: the model says nothing
            return error_response(422, "the model produced no audio for this text: send words to speak")
        name = await run_in_threadpool(instance.keep, audio)
        headers.update({"X-Audio-Seconds": f"{audio.size / engine.sample_rate:.3f}", "X-Output-File": name})
        return Response(data, media_type="audio/wav", headers=headers)

    def stream_wav(first: np.ndarray, rest: Iterator[np.ndarray], prompt_path: str) -> Iterator[bytes]:
        """Header and first chunk, then PCM as the engine yields it (in a worker thread)."""
        chunks: list[np.ndarray] = [first]
        try:
            yield streaming_wav_header(engine.sample_rate) + pcm16(first)
            for chunk in rest:
                chunks.append(chunk)
                yield pcm16(chunk)
        except Exception as exc:  # the status is sent already: end the stream, keep the instance
            log.error("streaming synthesis failed: %s", exc)
        finally:
            rest.close()  # also when the client went away: frees the engine slot
            _remove(prompt_path)
        if chunks:
            instance.keep(np.concatenate(chunks))

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

    return mount_ui(app, instance)


def mount_ui(app: FastAPI, instance: Instance):
    """The Gradio UI at "/": the same modes and checks as the API, audio streamed as made."""
    import gradio as gr

    state, engine, limits = instance.state, instance.engine, instance.limits
    modes = engine.modes or ("sft",)
    cloning = any(m in modes for m in ("zero_shot", "cross_lingual", "instruct"))
    # Gradio encodes a streamed audio output with ffmpeg; without it the UI plays whole results.
    can_stream = shutil.which("ffmpeg") is not None

    def generate(text, mode, prompt_audio, prompt_text, instruct_text, speaker, speed, seed, stream):
        if not state.ready:
            raise gr.Error(NOT_READY[state.phase])
        modes = engine.modes or ("sft",)
        payload = {"text": text, "mode": mode if len(modes) > 1 else "", "prompt_text": prompt_text or "",
                   "instruct_text": instruct_text or "", "speaker": speaker or "",
                   "speed": float(speed), "stream": bool(stream) and can_stream,
                   "seed": None if seed is None or int(seed) < 0 else int(seed)}
        prompt_path = ""
        try:
            data = None
            if prompt_audio:
                with open(prompt_audio, "rb") as handle:
                    data = handle.read(limits.max_upload_bytes + 1)
                if len(data) > limits.max_upload_bytes:
                    raise BadRequest(f"the prompt audio is larger than {limits.max_upload_bytes // 2**20} MiB")
            synthesis = make_request(payload, limits, modes, engine.speakers(), has_prompt=data is not None)
            if data is not None:
                prompt_path, notices = instance.prepare_prompt(data)
                for notice in notices:
                    gr.Info(notice)
                synthesis = replace(synthesis, prompt_wav=prompt_path)
            synthesis = instance.complete(synthesis)
            if synthesis.stream:
                for chunk in instance.stream(synthesis):
                    yield engine.sample_rate, (np.clip(chunk, -1, 1) * 32767).astype(np.int16)
            else:
                audio = instance.synthesize(synthesis)
                if audio.size == 0:
                    raise BadRequest("the model produced no audio for this text: type words to speak")
                instance.keep(audio)
                yield engine.sample_rate, (np.clip(audio, -1, 1) * 32767).astype(np.int16)
        except (BadRequest, PromptError) as exc:
            raise gr.Error(str(exc)) from None
        except (EngineError, AssertionError) as exc:
            raise gr.Error(f"Synthesis failed: {exc}") from None
        finally:
            _remove(prompt_path)

    with gr.Blocks(title="cosyvoice-lb", delete_cache=(3600, 3600)) as ui:
        gr.Markdown(f"## Text to speech\nEngine `{engine.name}` · instance on port {state.port}")
        text = gr.Textbox(label="Text", lines=4, max_length=limits.max_chars,
                          placeholder="Type what to say (English or 中文)")
        mode = gr.Radio([(MODE_LABELS[m], m) for m in modes], value=modes[0], label="Mode",
                        visible=len(modes) > 1)
        with gr.Row(visible=cloning):
            prompt_audio = gr.Audio(label=f"Prompt audio (3-{limits.max_prompt_seconds:g} s, 16 kHz or more)",
                                    type="filepath", sources=["upload", "microphone"])
            with gr.Column():
                prompt_text = gr.Textbox(label="Prompt transcript (zero-shot: exactly what the prompt says)")
                instruct_text = gr.Textbox(label="Instruction (instruct mode, e.g. 'Speak slowly and warmly')")
        speaker = gr.Dropdown(engine.speakers(), value=None, label="Built-in speaker",
                              visible=bool(engine.speakers()))
        with gr.Row():
            speed = gr.Slider(MIN_SPEED, MAX_SPEED, value=1.0, step=0.1, label="Speed (not with streaming)")
            seed = gr.Number(value=-1, precision=0, label="Seed (-1: random)")
            stream = gr.Checkbox(value=False, label="Stream", visible=can_stream)
        button = gr.Button("Generate", variant="primary")
        audio = gr.Audio(label="Speech", type="numpy", interactive=False, streaming=can_stream, autoplay=False)
        if cloning:
            button.click(generate, inputs=[text, mode, prompt_audio, prompt_text, instruct_text, speaker, speed,
                                           seed, stream], outputs=audio, api_name="generate")
        else:  # API callers of a non-cloning engine pass only what it uses: generate(text, speed, seed, stream)
            def speak(text, speed, seed, stream):
                yield from generate(text, modes[0], None, "", "", None, speed, seed, stream)

            button.click(speak, inputs=[text, speed, seed, stream], outputs=audio, api_name="generate")

        def refresh():
            """At each page load: what the loaded model offers (built-in speakers are only
            known once it is loaded)."""
            now = engine.modes or ("sft",)
            return (gr.update(choices=[(MODE_LABELS[m], m) for m in now], value=now[0], visible=len(now) > 1),
                    gr.update(choices=engine.speakers(), visible=bool(engine.speakers())))

        ui.load(refresh, outputs=[mode, speaker], api_name=False)

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
    parser.add_argument("--model-dir", default="", help="CosyVoice model dir (cosyvoice3 engine)")
    parser.add_argument("--cosyvoice-root", default="", help="upstream checkout: cosyvoice/, third_party/Matcha-TTS")
    parser.add_argument("--load-trt", action="store_true")
    parser.add_argument("--load-vllm", action="store_true")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--simulated-ms-per-char", type=float, default=4.0, help="simulated engine (benchmarks)")
    parser.add_argument("--simulated-base-ms", type=float, default=0.0, help="simulated engine (benchmarks)")
    parser.add_argument("--max-prompt-seconds", type=float, default=15.0)
    parser.add_argument("--max-upload-mib", type=float, default=10.0)
    parser.add_argument("--instance-concurrency", type=int, default=1)
    parser.add_argument("--max-queue", type=int, default=-1, help="API requests waiting per instance; -1: no bound")
    parser.add_argument("--outputs-dir", default="")
    parser.add_argument("--outputs-max-age", type=float, default=86400.0, help="seconds")
    parser.add_argument("--outputs-max-mib", type=float, default=2048.0)
    parser.add_argument("--request-timeout", type=float, default=0.0,
                        help="seconds an API request may take from its arrival at nginx; 0: no bound")
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
    engine = create_engine(args.engine, model_dir=args.model_dir, cosyvoice_root=args.cosyvoice_root,
                           load_trt=args.load_trt, load_vllm=args.load_vllm, fp16=args.fp16,
                           simulated_ms_per_char=args.simulated_ms_per_char,
                           simulated_base_ms=args.simulated_base_ms)
    limits = Limits(max_chars=args.max_chars, max_prompt_seconds=args.max_prompt_seconds,
                    max_upload_bytes=int(args.max_upload_mib * 2**20))
    outputs = Outputs(args.outputs_dir, args.port, args.outputs_max_age, int(args.outputs_max_mib * 2**20))
    # Prompt uploads are written for upstream as files; leftovers of a killed run go at start.
    scratch = os.path.join(args.outputs_dir, ".prompts") if args.outputs_dir else tempfile.gettempdir()
    os.makedirs(scratch, exist_ok=True)
    for stale in os.listdir(scratch):
        if stale.startswith(f"prompt-{args.port}-"):
            _remove(os.path.join(scratch, stale))
    instance = Instance(engine, state, limits, args.instance_concurrency, outputs, scratch,
                        max_queue=None if args.max_queue < 0 else args.max_queue,
                        request_timeout=args.request_timeout)
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
    # Drained: leave now. A synthesis stuck in the engine must not keep the process (its
    # worker thread would be joined at interpreter exit).
    logging.shutdown()
    os._exit(0)
