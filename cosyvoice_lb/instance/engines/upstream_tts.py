"""A thin layer over upstream's CosyVoice2/3 model: concurrent syntheses in one model, and
chunks handed over when they are ready.

Upstream's ``CosyVoice2Model.tts`` (which CosyVoice3 inherits) keeps each request's state in
dicts keyed by a uuid and runs its LLM in a thread per request, so several requests can run
in one process, but:

- a stream rewrites ``self.token_hop_len`` on the shared model after each chunk (doubling it
  up to ``token_max_hop_len``): concurrent streams change each other's chunk schedule, and
  every stream after the first starts from a long hop;
- the calling thread checks for new tokens every ``time.sleep(0.1)``: up to 100 ms added to
  each chunk, the first included;
- an exception in the LLM thread leaves the caller polling forever;
- every request ends with ``torch.cuda.empty_cache()`` and a device-wide synchronize.

:func:`install` replaces ``tts`` on the loaded model object (never on upstream's classes, and
no upstream file changes) with :func:`_synthesis`, which calls upstream's own ``llm_job``,
``vc_job`` and ``token2wav`` in upstream's order, with each stream's hop its own, a condition
that wakes the caller at each token, the LLM thread's error raised in the caller, a client
that leaves stopping its LLM at the next token (on vLLM: its request aborted in the engine),
and the cache flush only when asked. A
stream's first chunk is timed (``on_first_chunk``): the seconds until its tokens were there
(the LLM's share, frontend work before ``tts`` left out) and the seconds of its ``token2wav``.

What a synthesis brings besides upstream's inputs (its seed, its client's cancel event)
reaches the layer through :func:`drive`, which the engine wraps around upstream's
``inference_*`` generator: set for the thread that runs each step of it, read when ``tts``
starts, handed to the LLM thread (:func:`llm_seed`, which vLLM's sampling reads).

It relies on upstream's internals, so :func:`shape_problem` checks at load time that they are
the shape it was written against (upstream ace7c47, the commit the tests run); otherwise the
engine keeps upstream's own path and says why, once. The upstream tests pin it to that commit.
Runs in the user's CosyVoice environment: standard library and torch (through the model).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from cosyvoice_lb.instance.engines import upstream_vllm

log = logging.getLogger("cosyvoice_lb.upstream")

# What the layer calls, with the parameters it passes (upstream ace7c47, cosyvoice/cli/model.py).
CALLS = {
    "llm_job": ("text", "prompt_text", "llm_prompt_speech_token", "llm_embedding", "uuid"),
    "vc_job": ("source_speech_token", "uuid"),
    "token2wav": (
        "token",
        "prompt_token",
        "prompt_feat",
        "embedding",
        "token_offset",
        "uuid",
        "stream",
        "finalize",
        "speed",
    ),
    "tts": (
        "text",
        "flow_embedding",
        "llm_embedding",
        "prompt_text",
        "llm_prompt_speech_token",
        "flow_prompt_speech_token",
        "prompt_speech_feat",
        "source_speech_token",
        "stream",
        "speed",
    ),
}
NUMBERS = ("token_hop_len", "token_max_hop_len", "stream_scale_factor")
DICTS = ("tts_speech_token_dict", "llm_end_dict", "hift_cache_dict")
FLOW_NUMBERS = ("pre_lookahead_len", "token_mel_ratio")
VLLM_PARTS = ("lock", "vllm_output_queue")  # what abort needs of upstream's LLM on vLLM


def shape_problem(model: Any) -> str:
    """What about upstream's model object (``AutoModel(...).model``) is not the shape this
    layer knows ("" when all of it is)."""
    for name, params in CALLS.items():
        method = getattr(model, name, None)
        if not callable(method):
            return f"the model has no {name}()"
        try:
            have = tuple(inspect.signature(method).parameters)
        except (TypeError, ValueError):
            return f"{name}() has no readable signature"
        missing = [p for p in params if p not in have]
        if missing:
            return f"{name}() takes no {', '.join(missing)}"
    for name in NUMBERS:
        if not _number(getattr(model, name, None)):
            return f"the model has no number {name}"
    for name in DICTS:
        if not isinstance(getattr(model, name, None), dict):
            return f"the model has no dict {name}"
    if not hasattr(getattr(model, "lock", None), "acquire"):
        return "the model has no lock"
    flow = getattr(model, "flow", None)
    for name in FLOW_NUMBERS:
        if not _number(getattr(flow, name, None)):
            return f"the model's flow has no number {name}"
    llm = getattr(model, "llm", None)
    if upstream_vllm.uses_vllm(model):
        if not callable(getattr(getattr(llm, "vllm", None), "abort_request", None)):
            return "the model's vLLM engine has no abort_request()"
        for name in VLLM_PARTS:
            if getattr(llm, name, None) is None:
                return f"the model's LLM on vLLM has no {name}"
    return ""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


FirstChunk = Callable[[float, float], None]  # (llm seconds, audio seconds) of a stream's first chunk


def install(
    model: Any,
    *,
    empty_cache: bool = False,
    on_first_chunk: FirstChunk | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """Put :func:`_synthesis` in place of ``model.tts`` on this one object; returns what
    stopped it ("" when installed: then the model's first hop, as loaded, starts every stream).
    ``on_first_chunk(llm, audio)`` hears each stream's first chunk: seconds from the start of
    ``tts`` until its tokens (hop, pad and lookahead) were there, and seconds of its token2wav."""
    problem = shape_problem(model)
    if problem:
        return problem
    defaults = {
        name: p.default
        for name, p in inspect.signature(model.tts).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    first_hop = int(model.token_hop_len)
    flush = _flusher() if empty_cache else None

    def tts(**inputs: Any) -> Iterator[dict]:
        return _synthesis(model, {**defaults, **inputs}, first_hop, flush, on_first_chunk, clock)

    model.tts = tts
    return ""


def _flusher() -> Callable[[], None] | None:
    """Upstream's end of every request (``--empty-cache``): free the CUDA cache, then wait for
    the device."""
    import torch

    if not torch.cuda.is_available():
        return None

    def flush() -> None:
        torch.cuda.empty_cache()
        torch.cuda.current_stream().synchronize()

    return flush


class Stopped(Exception):
    """Raised inside the LLM thread at its next token once nobody reads the synthesis."""


class Cancelled(Exception):
    """The synthesis's client went away (its cancel event is set): raised to the reader."""


class Call(threading.local):
    """What the thread running a step of a synthesis brings (see :func:`drive`)."""

    seed: int | None = None
    cancel: threading.Event | None = None


CALL = Call()
LLM = Call()  # in an LLM thread: its synthesis's seed


@contextlib.contextmanager
def calling(seed: int | None, cancel: threading.Event | None) -> Iterator[None]:
    CALL.seed, CALL.cancel = seed, cancel
    try:
        yield
    finally:
        CALL.seed, CALL.cancel = None, None


def drive(outputs: Iterator[Any], seed: int | None = None, cancel: threading.Event | None = None) -> Iterator[Any]:
    """``outputs`` (upstream's ``inference_*`` generator), each step run with ``seed`` and
    ``cancel`` set for the thread that runs it: a step may start a ``tts`` (a sentence group)
    and the steps of one synthesis may run in different threads."""
    while True:
        with calling(seed, cancel):
            try:
                output = next(outputs)
            except StopIteration:
                return
        yield output


def llm_seed() -> int | None:
    """The seed of the synthesis whose LLM thread calls (None: unseeded, or not an LLM thread)."""
    return LLM.seed


class Enough(Exception):
    """A streaming session's LLM made as many speech tokens as upstream allows for the text it
    read (``MAX_TOKEN_TEXT_RATIO`` per text token): its end, as upstream's ``max_len`` is."""


# Upstream's bound on speech tokens per text token (its LLM's max_token_text_ratio). Its
# bistream decode has none once the text is done: a model that never says EOS would run on.
MAX_TOKEN_TEXT_RATIO = 20


def _counted(text: Iterator[Any], fed: list[int]) -> Iterator[Any]:
    """Upstream's text token generator, its tokens counted in ``fed[0]`` as the LLM reads them."""
    for token in text:
        fed[0] += 1
        yield token


class Tokens(list):
    """One request's speech tokens: the append that brings as many as the reader waits for
    (``wanted``) wakes it, not every one (each wake-up costs the LLM thread the GIL); while
    ``held``, the LLM thread waits at its next append; once ``stopped`` (or its client's
    ``cancel`` is set), the next append ends the LLM thread."""

    def __init__(
        self, ready: threading.Condition, cancel: threading.Event | None = None, limit: Callable[[], int] | None = None
    ):
        super().__init__()
        self.ready = ready
        self.limit = limit  # the most tokens there may be now (a streaming session's: see Enough)
        self.stopped = False
        self.held = False
        self.cancel = cancel
        self.wanted = 0.0  # (set by the reader, under ``ready``)

    def ended(self) -> bool:
        return self.stopped or (self.cancel is not None and self.cancel.is_set())

    def append(self, token: Any) -> None:
        if self.ended():
            raise Stopped()
        if self.limit is not None and len(self) >= self.limit():
            raise Enough()
        with self.ready:
            while self.held and not self.ended():
                self.ready.wait(0.1)  # (a client's cancel sets no condition: looked at again soon)
            if self.ended():
                raise Stopped()
            super().append(token)
            if len(self) >= self.wanted:
                self.ready.notify_all()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """The LLM thread waits meanwhile (at its next token)."""
        with self.ready:
            self.held = True
        try:
            yield
        finally:
            with self.ready:
                self.held = False
                self.ready.notify_all()


class Run:
    """What the reader and the LLM thread of one request share."""

    def __init__(self, cancel: threading.Event | None = None) -> None:
        self.ready = threading.Condition()
        self.ended = False
        self.error: BaseException | None = None
        self.abandoned = False  # the reader left first: the LLM thread clears the dicts
        self.cancel = cancel

    def wait(self, tokens: Callable[[], list], count: float) -> list:
        """The tokens, once there are ``count`` or the LLM ended; :class:`Cancelled` when the
        client left (the LLM thread stops at its next token, which wakes this)."""
        with self.ready:
            made = tokens()
            if isinstance(made, Tokens):
                made.wanted = count
            while len(tokens()) < count and not self.ended:
                self.ready.wait()
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled()
        if self.error is not None:
            raise self.error
        return tokens()


def _synthesis(
    model: Any,
    inputs: dict,
    first_hop: int,
    flush: Callable[[], None] | None,
    on_first_chunk: FirstChunk | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[dict]:
    """Upstream's ``CosyVoice2Model.tts``, step for step, less its shared hop and its poll."""
    import torch

    started = clock()
    key = str(uuid.uuid1())
    seed, cancel = CALL.seed, CALL.cancel
    run = Run(cancel)
    limit = None
    if inspect.isgenerator(inputs["text"]):  # a streaming session's text (upstream's bistream)
        fed = [0]
        inputs = {**inputs, "text": _counted(inputs["text"], fed)}
        limit = lambda: fed[0] * MAX_TOKEN_TEXT_RATIO  # noqa: E731
    tokens = Tokens(run.ready, cancel, limit)
    with model.lock:
        model.tts_speech_token_dict[key], model.llm_end_dict[key] = tokens, False
        model.hift_cache_dict[key] = None

    def current() -> list:
        return model.tts_speech_token_dict[key]  # (vc_job puts a list of its own there)

    source = inputs["source_speech_token"]
    args: tuple[Any, ...]
    if source.shape[1] == 0:
        job, args = (
            model.llm_job,
            (
                inputs["text"],
                inputs["prompt_text"],
                inputs["llm_prompt_speech_token"],
                inputs["llm_embedding"],
                key,
            ),
        )
    else:
        job, args = model.vc_job, (source, key)
    thread = threading.Thread(target=_produce, args=(model, key, run, job, args, seed), daemon=True)
    thread.start()
    prompt = inputs["flow_prompt_speech_token"]
    common = {
        "prompt_token": prompt,
        "prompt_feat": inputs["prompt_speech_feat"],
        "embedding": inputs["flow_embedding"],
        "uuid": key,
    }
    try:
        if inputs["stream"] is True:
            offset, hop = 0, first_hop
            pad = int(math.ceil(prompt.shape[1] / first_hop) * first_hop - prompt.shape[1])
            lookahead = int(model.flow.pre_lookahead_len)
            while True:
                this_hop = hop + pad if offset == 0 else hop
                need = offset + this_hop + lookahead
                made = run.wait(current, need)
                if len(made) < need:  # the LLM ended short of another whole hop
                    break
                tokens_there = clock()
                # The first chunk first: its own LLM waits while its audio is made, so the two
                # do not share the cores (the rest of the stream has the first chunk's playing
                # time to catch up): on 2 cores, small model, 0.261 s to the first chunk held
                # against 0.274 s not (medians of 8, in turns).
                with tokens.holding() if offset == 0 and tokens is made else contextlib.nullcontext():
                    speech = model.token2wav(
                        token=torch.tensor(made[:need]).unsqueeze(dim=0),
                        token_offset=offset,
                        stream=True,
                        finalize=False,
                        **common,
                    ).cpu()  # (on a GPU: its work done, so the time below is the chunk's)
                if offset == 0 and on_first_chunk is not None:
                    on_first_chunk(tokens_there - started, clock() - tokens_there)
                offset += this_hop
                hop = min(int(model.token_max_hop_len), int(hop * model.stream_scale_factor))
                yield {"tts_speech": speech}
            thread.join()
            speech = model.token2wav(
                token=torch.tensor(current()).unsqueeze(dim=0), token_offset=offset, finalize=True, **common
            )
        else:
            made = run.wait(current, math.inf)
            thread.join()
            speech = model.token2wav(
                token=torch.tensor(made).unsqueeze(dim=0),
                token_offset=0,
                finalize=True,
                speed=inputs["speed"],
                **common,
            )
        yield {"tts_speech": speech.cpu()}
    finally:
        with run.ready:
            tokens.stopped = True
            run.ready.notify_all()  # (an LLM thread held at its next token ends there)
            left_first = run.abandoned = not run.ended
        if not left_first:
            _clear(model, key)
        if flush is not None:
            flush()


def _produce(model: Any, key: str, run: Run, job: Callable[..., None], args: tuple, seed: int | None = None) -> None:
    """The LLM thread: upstream's job (its sampling seeded with ``seed`` on vLLM), its error
    kept for the reader; stopped, its request leaves vLLM's engine at once."""
    LLM.seed = seed
    try:
        job(*args)
    except Enough:
        log.info("a streaming session's LLM reached %d speech tokens per text token: its end", MAX_TOKEN_TEXT_RATIO)
    except Stopped:
        if upstream_vllm.uses_vllm(model):
            try:
                upstream_vllm.abort(model.llm, key)
                log.info(
                    "the client left: its request %s left vLLM's engine after %d tokens",
                    key,
                    len(run_tokens(model, key)),
                )
            except Exception as exc:  # noqa: BLE001 - the reader is gone; the engine ends it at max_tokens
                log.warning("could not abort a vLLM request: %s", exc)
    except BaseException as exc:  # noqa: BLE001 - the reader raises it
        run.error = exc
    finally:
        with run.ready:
            run.ended = True
            run.ready.notify_all()
            abandoned = run.abandoned
        if abandoned:
            _clear(model, key)


def run_tokens(model: Any, key: str) -> list:
    return model.tts_speech_token_dict.get(key) or []


def _clear(model: Any, key: str) -> None:
    with model.lock:
        for name in DICTS:
            getattr(model, name).pop(key, None)


def serialize_frontend(frontend: Any, lock: Any) -> None:
    """Upstream's frontend (tokenizer, text normalizer, prompt feature extractors) one call at
    a time: a Rust tokenizer used from two threads at once can fail ("Already borrowed"), and
    text normalizers are native code of unknown thread safety. It is a small share of a
    synthesis; the LLM, flow and vocoder still run side by side."""
    for name in dir(frontend):
        if name.startswith("frontend_") or name == "text_normalize":
            method = getattr(frontend, name)
            if callable(method):
                setattr(frontend, name, _locked(method, lock))


def _locked(method: Callable[..., Any], lock: Any) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return method(*args, **kwargs)

    return call
