"""Audio as it is made: where a request's chunks come from, and the streamed answer.

A source is an async iterator of mono float32 chunks at the engine's rate: this
instance's engine (:func:`local_audio`), or the segments of a long text coming back from
the cluster, joined with a crossfade (:func:`joined`). :class:`AudioStream` sends one
source to the client through an encoder (WAV, or any format of ``formats``, optionally as
server-sent events), watching the client: when it goes away the source is closed at once,
which stops a local synthesis at its next chunk and frees its engine slot.

Every entry point makes the first chunk before answering, so a refused input is still a
4xx/5xx rather than a stream that breaks off. The same holds for bad audio: the pipeline
checks every chunk before it comes out (``audio.check``), so a stream whose first chunk is
bad (NaN, beyond ±1) is a 502 before any byte is sent, which nginx retries on another
instance. Bad audio found later (a chunk, or the whole: silent, too short) cuts the stream
off: a raw stream's connection ends without its final chunk, an SSE stream ends with an
error event and no ``speech.audio.done``, and nothing is kept, so no client can take a
stream with bad audio in it for a complete answer.

Instance side: standard library, numpy and starlette.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import numpy as np
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from cosyvoice_lb.common.error_body import error_body
from cosyvoice_lb.instance.audio.segments import Joiner, split_text
from cosyvoice_lb.instance.audio.wav import WavBuilder
from cosyvoice_lb.instance.metrics import outcome_of
from cosyvoice_lb.instance.speech.admission import Cancelled
from cosyvoice_lb.instance.speech.failures import NoAudio, StorageFailed, describe
from cosyvoice_lb.instance.speech.fanout import SEGMENT_HEADER, FanOut, forwarded
from cosyvoice_lb.instance.speech.memory import release
from cosyvoice_lb.instance.speech.pipeline import Job, Pipeline
from cosyvoice_lb.instance.speech.validation import WORD, BadRequest

T = TypeVar("T")

log = logging.getLogger("cosyvoice_lb.instance")


def audio_source(
    pipeline: Pipeline,
    fanout: FanOut | None,
    job: Job,
    payload: dict,
    prompt_data: bytes | None,
    headers: Any,
    deadline: float | None,
) -> AsyncIterator[np.ndarray]:
    """Where a prepared request's audio comes from: this instance's engine, or, for a text
    past --max-chars, its segments across the cluster (``payload``: the client's fields,
    which every segment repeats). A streamed long text has no overall deadline: each
    segment is bounded as a request of its own, as a stream's first chunk is."""
    text = job.request.text
    if not pipeline.limits.long(text):
        return local_audio(pipeline, job, deadline, stream=job.request.stream)
    pipeline.finish(job)  # the coordinator synthesizes nothing itself
    if fanout is None or SEGMENT_HEADER.lower() in headers:  # (headers: lower-case keys, or any case)
        raise BadRequest(
            f"the text has {len(text)} characters, more than --max-chars {pipeline.limits.max_chars}, and this "
            "instance cannot split it (no balancer to send segments to): send shorter texts",
            status=413,
        )
    size = fanout.balancer.segment_chars
    # A piece with no word in it ("* * *" between chapters) has nothing to say: the model
    # would answer "no audio" and fail the whole text.
    segments = [piece for piece in split_text(text, size, first_chars=max(1, size // 2)) if WORD.search(piece)]
    if not segments:
        raise NoAudio()
    log.info("long text: %d characters in %d segments across the cluster", len(text), len(segments))
    source = fanout.audio(segments, payload, prompt_data, forwarded(headers), None if job.request.stream else deadline)
    return coordinated(pipeline, joined(source, pipeline.engine.sample_rate))


async def coordinated(pipeline: Pipeline, source: AsyncIterator[np.ndarray]) -> AsyncIterator[np.ndarray]:
    """Counts a long text in flight while its audio is being made (a drain waits for it)."""
    try:
        with pipeline.coordinating:
            async for chunk in source:
                yield chunk
    finally:
        await source.aclose()  # type: ignore[attr-defined]
        # its segments went through the heap: give those pages back (off the loop: tens of ms)
        await asyncio.get_running_loop().run_in_executor(None, release)


async def local_audio(pipeline: Pipeline, job: Job, deadline: float | None, stream: bool) -> AsyncIterator[np.ndarray]:
    """This instance's engine: chunk by chunk (``stream``), or the whole audio at once (the
    engine's ``speed`` works only then). The first chunk is bounded by the deadline; the
    job is finished (its prompt file removed) when the source ends, however it ends."""
    loop = asyncio.get_running_loop()
    cancelled = threading.Event()
    chunks: Iterator[np.ndarray] | None = None
    ended = False
    try:
        if not stream:
            audio = await pipeline.run(
                deadline, lambda: pipeline.synthesize(job, bounded=True, deadline=deadline, cancelled=cancelled)
            )
            if audio.size == 0:
                raise NoAudio()
            ended = True
            yield audio
            return
        chunks = pipeline.chunks(job, bounded=True, deadline=deadline, cancelled=cancelled)
        first = await pipeline.run(deadline, next, chunks, None)
        if first is None:
            raise NoAudio()
        yield first
        while True:
            chunk = await loop.run_in_executor(pipeline.workers, next, chunks, None)
            if chunk is None:
                ended = True
                return
            yield chunk
    finally:
        if not ended:
            cancelled.set()  # a synthesis still in its worker stops at its next chunk
        if chunks is not None:
            await loop.run_in_executor(pipeline.workers, _close, chunks)
        pipeline.finish(job)


def _close(chunks: Iterator[np.ndarray]) -> None:
    close = getattr(chunks, "close", None)
    try:
        if close is not None:
            close()  # frees the engine slot now
    except ValueError:  # still running in a worker (a timed-out first chunk): it stops on its own
        pass


async def joined(source: AsyncIterator[np.ndarray], rate: int) -> AsyncIterator[np.ndarray]:
    """Segments joined with a short crossfade, each out as soon as it is final."""
    joiner = Joiner(rate)
    try:
        async for segment in source:
            out = joiner.feed(segment)
            if out.size:
                yield out
        tail = joiner.finish()
        if tail.size:
            yield tail
    finally:
        await source.aclose()  # type: ignore[attr-defined]


async def while_connected(work: Awaitable[T], request: Any = None, poll: float = 0.5) -> T:
    """``work``, unless the client of ``request`` goes away first: then it is cancelled (a
    synthesis stops at once, its slot freed; a long text's segments are not made for nobody)
    and Cancelled (499) raised. Without a request: ``work`` as it is."""
    if request is None:
        return await work
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=poll)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise Cancelled()
    return task.result()


async def collect_wav(source: AsyncIterator[np.ndarray], rate: int, request: Any = None) -> WavBuilder:
    """The whole audio as a WAV file, encoded chunk by chunk (never held as float). With
    the client's ``request``, a client that goes away stops it (:func:`while_connected`).
    No audio at all: NoAudio."""
    wav = WavBuilder(rate)

    async def gather() -> WavBuilder:
        try:
            async for chunk in source:
                wav.feed(chunk)
            return wav
        finally:
            await source.aclose()  # type: ignore[attr-defined]

    await while_connected(gather(), request)
    if wav.samples == 0:  # e.g. text of punctuation only: the model says nothing
        raise NoAudio()
    return wav


async def first_of(source: AsyncIterator[np.ndarray], request: Any = None) -> np.ndarray:
    """The first chunk (made before answering; with the client's ``request``, stopped if
    the client goes away meanwhile); the source is closed if that fails."""
    try:
        return await while_connected(source.__anext__(), request)
    except StopAsyncIteration:
        raise NoAudio() from None
    except BaseException:
        await source.aclose()  # type: ignore[attr-defined]
        raise


class Framing:
    """How encoded bytes go on the wire: as they are, or as OpenAI's server-sent events."""

    def __init__(self, sse: bool = False, usage: dict[str, int] | None = None):
        self.sse, self.usage = sse, usage or {}

    def data(self, payload: bytes) -> bytes:
        if not self.sse or not payload:
            return payload
        event = {"type": "speech.audio.delta", "audio": base64.b64encode(payload).decode("ascii")}
        return f"data: {json.dumps(event)}\n\n".encode()

    def end(self) -> bytes:
        if not self.sse:
            return b""
        return f"data: {json.dumps({'type': 'speech.audio.done', 'usage': self.usage})}\n\n".encode()

    def error(self, status: int, message: str) -> bytes | None:
        """What tells the client its stream broke off: an error event, or (None) nothing,
        and the connection is cut before the stream's end, which every client sees."""
        if not self.sse:
            return None
        return f"data: {json.dumps({'type': 'error', **error_body(status, message)})}\n\n".encode()


class AudioStream(Response):
    """A streamed answer of unknown length (chunked), encoded chunk by chunk."""

    def __init__(
        self,
        pipeline: Pipeline,
        first: np.ndarray,
        rest: AsyncIterator[np.ndarray],
        encode: Callable[[np.ndarray], bytes],
        finish: Callable[[], bytes],
        media_type: str,
        headers: dict[str, str],
        framing: Framing | None = None,
    ):
        super().__init__(media_type=media_type, headers=headers)
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k.lower() != b"content-length"]
        self.pipeline, self.first, self.rest = pipeline, first, rest
        self.encode, self.finish = encode, finish
        self.framing = framing or Framing()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        gone = asyncio.Event()
        whole = WavBuilder(self.pipeline.engine.sample_rate)  # the copy kept, as it goes out
        whole.feed(self.first)
        complete = False

        async def watch() -> None:
            while not gone.is_set():
                if (await receive())["type"] == "http.disconnect":
                    gone.set()

        async def body(data: bytes, more: bool = True) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": more})

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await body(self.framing.data(await loop.run_in_executor(self.pipeline.workers, self.encode, self.first)))
            rest = self.rest.__aiter__()
            while not gone.is_set():
                following = asyncio.ensure_future(rest.__anext__())
                waiting = asyncio.ensure_future(gone.wait())
                await asyncio.wait({following, waiting}, return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                if not following.done():  # the client went away while the source worked
                    following.cancel()
                    await asyncio.gather(following, return_exceptions=True)
                    break
                try:
                    chunk = following.result()
                except StopAsyncIteration:
                    complete = True
                    break
                except Exception as exc:  # the status is sent already: break the stream off, keep the instance
                    failure = describe(exc)
                    log.log(failure.level if failure else logging.ERROR, "streaming synthesis failed: %s", exc)
                    # (not a result: nothing is kept; the client must not take it for the whole)
                    event = self.framing.error(failure.status if failure else 500, str(exc))
                    outcome = outcome_of(failure.status if failure else 500)
                    scope.setdefault("state", {})["cvlb_outcome"] = "failed" if outcome == "ok" else outcome
                    if event is not None:
                        await body(event, more=False)
                    return  # a raw stream ends without its last chunk: the client sees it cut off
                whole.feed(chunk)
                await body(self.framing.data(await loop.run_in_executor(self.pipeline.workers, self.encode, chunk)))
            if not gone.is_set():
                tail = await loop.run_in_executor(self.pipeline.workers, self.finish)
                await body(self.framing.data(tail) + self.framing.end(), more=False)
        except OSError:  # the client went away while we wrote
            gone.set()
        finally:
            watcher.cancel()
            await self.rest.aclose()  # type: ignore[attr-defined]
            if gone.is_set() and not complete:  # (its status said 200; the client left before the end)
                scope.setdefault("state", {}).setdefault("cvlb_outcome", "cancelled")
            if complete:
                await loop.run_in_executor(self.pipeline.workers, self.keep, whole)

    def keep(self, whole: WavBuilder) -> None:
        try:
            self.pipeline.keep(whole)
        except StorageFailed as exc:  # the client has its audio already: only the copy is lost
            log.error("a streamed result was sent but not kept: %s", exc)


def streaming_headers(extra: dict[str, str] | None = None) -> dict[str, Any]:
    """No buffering on the way (nginx honours X-Accel-Buffering)."""
    return {"X-Accel-Buffering": "no", "Cache-Control": "no-store", **(extra or {})}
