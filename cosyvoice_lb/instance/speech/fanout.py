"""Long texts across the cluster: the instance that took the request coordinates it.

A text past ``--max-chars`` is split at sentence boundaries (``segments``); each segment
goes back through the balancer (nginx) as an ordinary ``POST /v1/tts``, so the segments run
on every instance at once, least-busy first, and each one is an ordinary request there
(admission, queue bound, hang detection, poison ledger). All segments use the request's
voice and one seed (chosen here when the client gave none): less drift between segments.
At most ``parallel`` segments are out at a time, started in order; results come back in
order, each as soon as it and all before it are done.

A segment that fails for a reason a retry can change (no instance answered, overloaded,
a connection lost, bad audio: 502 from an instance whose synthesis failed the audio check,
once nginx's own retries are spent) is sent again, at most ``RETRIES`` more times, while the request has
time left; any other failure (the input, a poison request, a text the engine cannot speak)
ends the whole request with that segment's answer, naming the segment and its first words:
audio with a sentence silently missing would pass for the whole. No segment is sent twice
once it succeeded.

Instance side: standard library, numpy, soundfile and httpx (which gradio brings).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import random
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile

from cosyvoice_lb.instance.speech.admission import TimedOut

log = logging.getLogger("cosyvoice_lb.instance")

SEGMENT_HEADER = "X-Cvlb-Segment"  # "i/n": a segment of a long text (never split again)
KEY_HEADER = "X-Cvlb-Segment-Key"  # proves to nginx that an instance sent it (credentials.write_segment_key)
RETRIES = 2
RETRY_STATUSES = frozenset({502, 503})  # (502: also bad audio, see ``failures.BadAudio``)
# The client's credentials (the segments are its work) and nginx's id of its request (a
# segment's id is the request's with its number: one grep finds a long text's every line).
FORWARDED = ("authorization", "cookie", "x-request-id")


class SegmentFailed(Exception):
    """A segment got an answer a retry cannot change (or ran out of retries): the whole
    request gets that answer."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


@dataclass(frozen=True)
class Balancer:
    """Where segments go: nginx, as this box reaches it."""

    url: str  # http://127.0.0.1:8080
    parallel: int  # segments out at once (the number of instances)
    segment_chars: int  # the size segments are packed to (at most --max-chars)
    key: str = ""  # the cluster's segment key


def forwarded(headers: Any) -> dict[str, str]:
    """The credentials of the client's request, for its segments."""
    return {name: headers[name] for name in FORWARDED if headers.get(name)}


def segment_payload(payload: dict, text: str, seed: int) -> dict:
    return {**{k: v for k, v in payload.items() if v not in (None, "")}, "text": text, "seed": seed, "stream": False}


def opening(text: str, chars: int = 60) -> str:
    """A segment's first words, quoted, to name it in a message."""
    text = " ".join(text.split())
    return json.dumps(text if len(text) <= chars else text[:chars] + "...", ensure_ascii=False)


def message_of(body: bytes, status: int) -> str:
    try:
        error = json.loads(body)["error"]
        return str(error["message"])
    except (ValueError, KeyError, TypeError):
        return f"a segment got HTTP {status} from the balancer"


class FanOut:
    """Sends the segments of long texts through the balancer."""

    def __init__(self, balancer: Balancer, clock: Callable[[], float], backoff: float = 0.25):
        self.balancer = balancer
        self.clock = clock  # the admission clock (deadlines are on it)
        self.backoff = backoff  # seconds before the first retry of a segment, doubled after

    async def audio(
        self,
        segments: list[str],
        payload: dict,
        prompt_data: bytes | None,
        headers: dict[str, str],
        deadline: float | None,
    ) -> AsyncIterator[np.ndarray]:
        """Each segment's audio, in order (float32 mono at the engine's rate)."""
        seed = payload.get("seed")
        seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else random.randrange(2**32)
        parallel = max(1, self.balancer.parallel)
        gate = asyncio.Semaphore(parallel)  # segments out at once; waiters wake in order
        # Segments done but not yet taken stay few: a slow reader holds back the work, and
        # the memory it would fill.
        ahead = asyncio.Semaphore(2 * parallel)
        import httpx

        # One client per long text (its connections belong to this event loop); trust_env
        # off: a proxy from the environment must not carry loopback traffic.
        async with httpx.AsyncClient(trust_env=False, timeout=None) as client:
            tasks = [
                asyncio.ensure_future(
                    self.one(client, gate, ahead, i, len(segments), segment_payload(payload, text, seed),
                             prompt_data, headers, deadline)
                )
                for i, text in enumerate(segments)
            ]  # fmt: skip
            try:
                for task in tasks:
                    audio = await task
                    ahead.release()  # taken: one more may start
                    yield audio
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def one(
        self,
        client: Any,
        gate: asyncio.Semaphore,
        ahead: asyncio.Semaphore,
        index: int,
        count: int,
        payload: dict,
        prompt_data: bytes | None,
        headers: dict[str, str],
        deadline: float | None,
    ) -> np.ndarray:
        """One segment: sent when it is among the next few and a slot is free; retried in
        that slot (a retry does not queue behind later segments)."""
        import httpx

        sent = {**headers, SEGMENT_HEADER: f"{index + 1}/{count}", KEY_HEADER: self.balancer.key}
        if headers.get("x-request-id"):
            sent["x-request-id"] = f"{headers['x-request-id'][:100]}-{index + 1}"
        timed_out = TimedOut(
            f"segment {index + 1} of {count} had not finished within the request timeout: "
            "send a shorter text, stream it, or raise --request-timeout"
        )
        await ahead.acquire()  # (released by the reader once it took this segment)
        async with gate:
            for attempt in range(RETRIES + 1):
                if attempt:
                    await asyncio.sleep(min(2.0, self.backoff * 2 ** (attempt - 1)))
                left = None if deadline is None else deadline - self.clock()
                if left is not None and left <= 0:
                    raise timed_out
                try:
                    response = await client.post(
                        f"{self.balancer.url}/v1/tts", timeout=left, headers=sent, **self.body(payload, prompt_data)
                    )
                    status, body, answer = response.status_code, response.content, dict(response.headers)
                except httpx.TimeoutException:
                    raise timed_out from None
                except httpx.TransportError as exc:
                    status, body, answer = 502, b"", {}
                    log.warning("segment %d/%d: the balancer did not answer (%s)", index + 1, count, exc)
                if status == 200:
                    return decode(body)
                # Only what a retry can change: nobody answered, or everyone was busy. (A
                # timed-out segment may hang its model: sent again it would hang another.)
                retry = status in RETRY_STATUSES and answer.get("x-should-retry", "").lower() != "false"
                if not retry:
                    break
        message = message_of(body, status) if body else "the balancer did not answer"
        keep = {k: v for k, v in answer.items() if k.lower() in ("retry-after", "x-should-retry")}
        where = f"segment {index + 1} of {count} of the long text"
        if 400 <= status < 500:  # the input's fault: say which words, so they can be fixed
            where += f" (it begins {opening(payload.get('text', ''))})"
        raise SegmentFailed(status, f"{where} failed: {message}", keep)

    @staticmethod
    def body(payload: dict, prompt_data: bytes | None) -> dict[str, Any]:
        if prompt_data is None:
            return {"json": payload}
        form = {k: json.dumps(v) if isinstance(v, bool) else str(v) for k, v in payload.items()}
        return {"data": form, "files": {"prompt_audio": ("prompt.wav", prompt_data)}}


def decode(data: bytes) -> np.ndarray:
    audio, _rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return audio.mean(axis=1).astype(np.float32)


def blocking(source: Callable[[], AsyncIterator[np.ndarray]]) -> Iterator[np.ndarray]:
    """An async source driven from synchronous code (the UI's handlers run in threads).

    Its event loop runs in a thread of its own: Gradio may close this generator from a
    thread whose loop is running, and closing must still reach the source (which cancels
    its segments and closes its connections)."""
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, name="long-text", daemon=True)
    runner.start()
    iterator = source().__aiter__()
    try:
        while True:
            try:
                step = iterator.__anext__()
                yield asyncio.run_coroutine_threadsafe(step, loop).result()  # type: ignore[arg-type]
            except StopAsyncIteration:
                return
    finally:
        try:
            asyncio.run_coroutine_threadsafe(iterator.aclose(), loop).result(timeout=30)  # type: ignore[attr-defined]
        finally:
            loop.call_soon_threadsafe(loop.stop)
            runner.join(5)
            loop.close()
