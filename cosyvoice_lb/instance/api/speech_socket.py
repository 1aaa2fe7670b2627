"""``/v1/audio/speech/stream``: a voice agent's text in as it is written, audio out as it is
made, one session per WebSocket (the messages: ``socket_protocol``).

A session holds one of the instance's engine slots from its start to its end (a
:class:`~cosyvoice_lb.instance.speech.admission.Lease`): admission, routing by work, ``/ping``
and the metrics see it like any synthesis, and while it waits for its client's text it is not
taken for hung. No slot free: the handshake is refused with the API's 503 and Retry-After
(nginx tries another instance). A client that proves its token in its first message (a
browser cannot set headers on a WebSocket) gets its slot after that message, or an error
event and close 4503.

How it speaks: with an engine that reads text while it speaks (CosyVoice2/3 on upstream's
LLM: ``engines.streams_text``) the text goes to upstream's generator input as it arrives,
one synthesis for the session; with any other engine (or a speed other than 1) each
sentence is spoken as soon as it is complete (``speech.text_feed``). Every synthesis goes
through the pipeline, with its checks.

How it ends: ``done`` and close 1000 once the text is done and spoken; on a drain (the
instance stops) the sentence being spoken is finished, then close 1001; on a limit, bad input
or a failure an error event and the class's close code; a client that vanishes stops the
synthesis at its next chunk and frees the slot at once.

Instance side: standard library, numpy and starlette.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from cosyvoice_lb.common.error_body import error_body, error_headers
from cosyvoice_lb.instance.access.auth import PolicyFile
from cosyvoice_lb.instance.api import socket_protocol as protocol
from cosyvoice_lb.instance.api.openai import speech_request
from cosyvoice_lb.instance.api.streams import local_audio
from cosyvoice_lb.instance.audio.formats import OUTPUT_RATE, Encoder
from cosyvoice_lb.instance.engines import streams_text
from cosyvoice_lb.instance.metrics import outcome_of
from cosyvoice_lb.instance.speech.admission import Lease, NotReady, Phase
from cosyvoice_lb.instance.speech.failures import describe
from cosyvoice_lb.instance.speech.pipeline import Job, Pipeline
from cosyvoice_lb.instance.speech.text_feed import Sentences, TextFeed
from cosyvoice_lb.instance.speech.validation import WORD, BadRequest, check_text

log = logging.getLogger("cosyvoice_lb.instance")

TICK = 0.1  # seconds between looks at the instance's phase (a drain) while a client writes
SESSION_CHARS = 200  # what a session is counted as, for routing, until its rate is known


@dataclass(frozen=True)
class StreamLimits:
    max_chars: int = 4000
    idle_timeout: float = 20.0
    max_seconds: float = 300.0


class Ended(Exception):
    """The session ends with an error event of ``status`` and its close code."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.param, self.retry_after = status, param, retry_after


class Draining(Exception):
    """The instance stops: the session closes with 1001 once its sentence is spoken."""


def add_stream_route(
    app: Any, pipeline: Pipeline, voice_map: dict[str, str], limits: StreamLimits, policy: PolicyFile | None
) -> None:
    @app.websocket(protocol.PATH)
    async def speech_stream(ws: WebSocket) -> None:
        await serve(ws, pipeline, voice_map, limits, policy)


async def serve(
    ws: WebSocket, pipeline: Pipeline, voice_map: dict[str, str], limits: StreamLimits, policy: PolicyFile | None
) -> None:
    """One session, from the handshake to the close; counted in the metrics by outcome."""
    token_needed = bool(ws.scope.get("state", {}).get("cvlb_token_needed"))  # (the gate's mark)
    lease: Lease | None = None
    if not token_needed:
        try:
            lease = pipeline.lease(SESSION_CHARS)
        except Exception as exc:  # noqa: BLE001 - not ready, or no slot: the API's 503
            failure = describe(exc)
            status = failure.status if failure else 503
            headers = {**error_headers(status), **(failure.headers if failure else {})}
            pipeline.metrics.request("stream", "refused")
            await ws.send_denial_response(JSONResponse(error_body(status, str(exc)), status, headers))
            return
    session = Session(ws, pipeline, voice_map, limits, policy)
    session.token_needed = token_needed
    session.lease, outcome = lease, "cancelled"  # (its slot goes back however it ends, the accept too)
    try:
        await ws.accept()
        outcome = await session.run(lease)
    finally:
        if session.lease is not None:
            session.lease.release(None)
        pipeline.metrics.request("stream", outcome)
        log.info("stream session %s %s: %s", session.id, outcome, json.dumps(session.summary()))


class Session:
    def __init__(
        self,
        ws: WebSocket,
        pipeline: Pipeline,
        voice_map: dict[str, str],
        limits: StreamLimits,
        policy: PolicyFile | None,
        clock: Any = time.monotonic,
    ):
        self.ws, self.pipeline, self.voice_map, self.limits, self.policy = ws, pipeline, voice_map, limits, policy
        self.clock = clock
        self.id = uuid.uuid4().hex[:12]
        self.lease: Lease | None = None
        self.token_needed = False  # its credentials come in its first message
        self.started = clock()
        self.omni = False  # the client speaks vLLM-Omni's names
        self.chars = self.sentences = self.bytes = 0
        self.audio_samples = 0
        self.first_audio: float | None = None
        self.text_done: float | None = None
        self.last_audio: float | None = None
        self.draining = False
        self.recv: asyncio.Future | None = None

    def summary(self) -> dict[str, Any]:
        def ms(at: float | None, since: float | None) -> int | None:
            return None if at is None or since is None else round((at - since) * 1000)

        return {
            "session_id": self.id,
            "characters": self.chars,
            "sentences": self.sentences,
            "audio_seconds": round(self.audio_samples / OUTPUT_RATE, 3),
            "bytes": self.bytes,
            "first_audio_ms": ms(self.first_audio, self.started),
            "last_audio_after_done_ms": ms(self.last_audio, self.text_done),
            "elapsed_ms": ms(self.clock(), self.started),
        }

    async def run(self, lease: Lease | None) -> str:
        """The session; its outcome for the metrics."""
        self.lease = lease
        try:
            left = self.limits.max_seconds - (self.clock() - self.started)
            await asyncio.wait_for(self.converse(), max(0.0, left))
        except WebSocketDisconnect:
            return "cancelled"
        except asyncio.TimeoutError:
            return await self.end(
                Ended(408, f"the session ran past --stream-max-seconds ({self.limits.max_seconds:g}s): open a new one")
            )
        except Draining:
            event = error_body(
                503, "this instance is stopping: the sentence in progress was finished; open a new session"
            )
            await self.close(protocol.GOING_AWAY, json.dumps({"type": "error", **event}))
            return "cancelled"
        except Ended as end:
            return await self.end(end)
        except Exception as exc:  # noqa: BLE001 - a session never takes the instance down
            failure = describe(exc)
            if failure is None:
                log.exception("stream session %s failed", self.id)
            status = failure.status if failure else 500
            message = failure.message if failure else f"internal error ({type(exc).__name__}): retry"
            retry = failure.headers.get("Retry-After") if failure else None
            return await self.end(
                Ended(status, message, failure.param if failure else None, int(retry) if retry else None)
            )
        finally:
            if self.recv is not None:
                self.recv.cancel()
        done = {"type": "session.done" if self.omni else "done", **self.summary()}
        await self.close(protocol.NORMAL, json.dumps(done))
        return "ok"

    async def end(self, end: Ended) -> str:
        event = protocol.error_event(end.status, str(end), end.param, end.retry_after)
        await self.close(protocol.close_code(end.status), event)
        return "refused" if end.status == 503 else outcome_of(end.status)

    async def close(self, code: int, last: str) -> None:
        if self.ws.application_state is not WebSocketState.CONNECTED:
            return
        try:
            await self.ws.send_text(last)
            await self.ws.close(code)
        except (WebSocketDisconnect, RuntimeError, OSError):  # (the client left meanwhile)
            pass

    # --- the conversation ------------------------------------------------------------------

    async def converse(self) -> None:
        config = await self.configure()
        payload, fmt, _ = speech_request(
            {**config.body, "input": "Hello."}, self.voice_map, self.pipeline.engine.speakers()
        )
        loop = asyncio.get_running_loop()
        pipeline = self.pipeline
        # (checked now, before any text: a voice that does not exist is said at once)
        job = await loop.run_in_executor(None, lambda: pipeline.prepare(payload, config.prompt_audio, route="stream"))
        bistream = payload["stream"] and streams_text(pipeline.engine, job.request.mode)
        if not bistream:
            pipeline.finish(job)
        if self.lease is None:  # (a token proven in the first message: its slot now)
            self.lease = pipeline.lease(SESSION_CHARS)
        encoder = Encoder(fmt, pipeline.engine.sample_rate)
        await self.ws.send_text(
            json.dumps(
                {
                    "type": "session.created",
                    "session_id": self.id,
                    "engine": pipeline.engine.name,
                    "speaking": "text stream" if bistream else "sentences",
                    "response_format": fmt,
                    "sample_rate": OUTPUT_RATE,
                    "channels": 1,
                    "stream_format": "events" if config.events else "audio",
                    "limits": {
                        "max_chars": self.limits.max_chars,
                        "idle_timeout": self.limits.idle_timeout,
                        "max_seconds": self.limits.max_seconds,
                    },
                }
            )
        )
        if bistream:
            feed = TextFeed(self.lease)
            job.request, job.fingerprint, job.lease = replace(job.request, text="", text_stream=feed), "", self.lease
            speaker = self.speak_stream(job, feed, encoder, config.events)
            sink: Any = feed
        else:
            sentences: asyncio.Queue[str | None] = asyncio.Queue()
            speaker = self.speak_sentences(sentences, payload, config, encoder)
            sink = _SentenceSink(sentences, Sentences(min(300, pipeline.limits.max_chars)))
        await self.both(self.listen(sink), speaker)
        await self.send_audio(encoder.finish(), config.events)

    async def both(self, listener: Any, speaker: Any) -> None:
        """The client's messages and the speech, at once: the speech's end ends the session;
        the listener's error (a limit, bad input, the client gone) stops the speech."""
        listening, speaking = asyncio.ensure_future(listener), asyncio.ensure_future(speaker)
        try:
            done, _ = await asyncio.wait({listening, speaking}, return_when=asyncio.FIRST_COMPLETED)
            failed = listening.exception() if listening in done else None
            if failed is not None:
                raise failed
            await speaking  # (the listener returned: a drain, or the text is done)
            if self.draining:
                raise Draining()
        finally:
            for task in (listening, speaking):
                task.cancel()
            await asyncio.gather(listening, speaking, return_exceptions=True)

    async def configure(self) -> protocol.Config:
        message = await self.receive(self.limits.idle_timeout)
        if message.kind != "config":
            raise Ended(400, 'the first message must be {"type": "session.config", ...}: the voice and the format')
        config = protocol.read_config(message.fields, self.pipeline.limits.max_upload_bytes)
        if self.token_needed and not self.token_ok(config.token):
            offered = "the token in session.config is not valid" if config.token else "this service needs credentials"
            raise Ended(401, f'{offered}: send the header Authorization: Bearer <token>, or "token" in session.config')
        return config

    def token_ok(self, token: str) -> bool:
        return bool(token) and self.policy is not None and self.policy.current().bearer_ok(f"Bearer {token}")

    async def receive(self, timeout: float | None) -> protocol.Message:
        """The client's next message; Ended (408) when none comes in ``timeout`` seconds,
        Draining when the instance starts to stop meanwhile."""
        deadline = None if timeout is None else self.clock() + timeout
        while True:
            if self.recv is None:
                self.recv = asyncio.ensure_future(self.ws.receive())
            done, _ = await asyncio.wait({self.recv}, timeout=TICK)
            if self.pipeline.admission.phase is Phase.DRAINING and self.lease is not None and not self.draining:
                self.draining = True
                return protocol.Message("drain")
            if done:
                frame, self.recv = self.recv.result(), None
                if frame["type"] == "websocket.disconnect":
                    raise WebSocketDisconnect(frame.get("code", 1000))
                message = protocol.parse(frame.get("text") if frame.get("text") is not None else frame.get("bytes"))
                self.omni = self.omni or message.omni
                return message
            if deadline is not None and self.clock() > deadline:
                raise Ended(
                    408,
                    f"no message for --stream-idle-timeout ({self.limits.idle_timeout:g}s): send text deltas sooner",
                )

    async def listen(self, sink: Any) -> None:
        """Text in until it is done; then only a close or the client's leaving matters."""
        done = False
        while True:
            message = await self.receive(None if done else self.limits.idle_timeout)
            if message.kind == "drain":
                sink.end()
                return
            if message.kind == "close":
                raise WebSocketDisconnect(1000)
            if message.kind == "config":
                raise Ended(400, "session.config comes once, first: open a new session for another voice")
            if done:
                continue
            if message.kind == "done":
                done, self.text_done = True, self.clock()
                sink.end()
                continue
            self.chars += len(message.text)
            if self.chars > self.limits.max_chars:
                raise Ended(
                    413,
                    f"the session's text ran past --stream-max-chars ({self.limits.max_chars}): send the rest in a new one",
                )
            if "<|" in message.text or "|>" in message.text or "<|" in sink.tail():
                _check_tokens(sink.tail() + message.text)
            sink.put(message.text)

    async def speak_stream(self, job: Job, feed: TextFeed, encoder: Encoder, events: bool) -> None:
        audio: Any = local_audio(self.pipeline, job, None, stream=True)  # (an async generator)
        try:
            async for chunk in audio:
                await self.send_audio(encoder.feed(chunk), events, chunk)
            self.sentences = 1 if self.audio_samples else 0
        finally:
            feed.stop()  # (first: an engine still reading the text stops there, and lets go)
            await audio.aclose()

    async def speak_sentences(
        self, sentences: asyncio.Queue, payload: dict, config: protocol.Config, encoder: Encoder
    ) -> None:
        """Each sentence as a request of its own: ``payload`` (the config's, checked once) with its text."""
        loop, pipeline = asyncio.get_running_loop(), self.pipeline
        while True:
            sentence = await sentences.get()
            if sentence is None or self.draining:
                return
            said = {**payload, "text": sentence}
            try:
                job = await loop.run_in_executor(
                    None, partial(pipeline.prepare, said, config.prompt_audio, route="stream")
                )
            except NotReady:
                if pipeline.admission.phase is Phase.DRAINING:  # (before the listener saw it)
                    self.draining = True
                    return
                raise
            job.lease = self.lease
            source: Any = local_audio(pipeline, job, None, stream=job.request.stream)  # (an async generator)
            async with aclosing(source) as audio:
                async for chunk in audio:
                    await self.send_audio(encoder.feed(chunk), config.events, chunk)
            self.sentences += 1

    async def send_audio(self, data: bytes, events: bool, chunk: np.ndarray | None = None) -> None:
        if chunk is not None:
            self.audio_samples += round(chunk.size * OUTPUT_RATE / self.pipeline.engine.sample_rate)
        if not data:
            return
        now = self.clock()
        self.first_audio = self.first_audio if self.first_audio is not None else now
        self.last_audio = now
        self.bytes += len(data)
        if events:
            await self.ws.send_text(
                json.dumps({"type": "audio.delta", "audio": base64.b64encode(data).decode("ascii")})
            )
        else:
            await self.ws.send_bytes(data)


class _SentenceSink:
    """The listener's side of sentence-by-sentence speech: text in, complete sentences to the speaker."""

    def __init__(self, queue: asyncio.Queue, sentences: Sentences):
        self.queue, self.sentences = queue, sentences

    def put(self, delta: str) -> None:
        self.speak(self.sentences.feed(delta))

    def end(self) -> None:
        self.speak(self.sentences.finish())
        self.queue.put_nowait(None)

    def speak(self, sentences: list[str]) -> None:
        for sentence in sentences:
            if WORD.search(sentence):  # ("* * *", "..." between sentences: nothing to say)
                self.queue.put_nowait(sentence)

    def tail(self) -> str:
        return self.sentences.pending[-16:]


def _check_tokens(text: str) -> None:
    """Special tokens are refused as in every request (``validation``), across deltas too."""
    try:
        check_text(text, len(text) + 1, "delta")
    except BadRequest as exc:
        raise Ended(400, str(exc), "delta") from None
