"""The instance's Prometheus metrics: every synthesis observed once, every speech request
counted once by route and outcome, and the live state read at each scrape.

Routes: ``api`` (``/v1/tts``), ``openai`` (``/v1/audio/speech``), ``ui`` (Gradio) and
``segment`` (a long text's segment, sent by the instance coordinating it). A long text
counts once as its client's request and once per segment where the segment ran; its
syntheses are the segments'. The warm-up synthesis and health probes are never counted.
Bad audio (``audio.check``) is counted by reason wherever it was found: a request's answer
(then also a failed request), the warm-up or a canary.

Each instance keeps its own registry (not prometheus_client's global one): tests build
several pipelines in one process, and ``/metrics`` shows this instance only.

Instance side: prometheus_client is the only package beyond the instance's usual ones.
`up` refuses an instance Python without it (with the pip line); an instance started some
other way without it still serves, and its ``/metrics`` says how to get it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosyvoice_lb.instance.audio.check import REASONS as AUDIO_REASONS

log = logging.getLogger("cosyvoice_lb.instance")

ROUTES = ("api", "openai", "ui", "segment", "stream")
OUTCOMES = ("ok", "invalid", "refused", "timeout", "cancelled", "failed")
CHECKS = ("request", "warm_up", "canary")  # where bad audio was found
# why: the audio check's reasons, and the speech check's (a warm-up or canary heard saying
# other words, ``quality.probe``)
REASONS = (*AUDIO_REASONS, "speech_error")
SPEECH_PATHS = {"/v1/tts": "api", "/v1/audio/speech": "openai"}
MISSING = (
    "this instance has no metrics: its Python lacks prometheus_client; install it into the instance's "
    "environment (the --python of `up`): pip install prometheus_client, then cosyvoice-lb restart --all"
)

# Buckets sized for speech: a first package within tens of milliseconds (streaming on a GPU) up
# to seconds (CPU, long queues); the alert's 1.5 s sits on a bucket boundary.
FIRST_PACKAGE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
AUDIO_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 90.0)
SYNTHESIS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
COMPUTE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
# The speech check's error ratio: 0 is word for word; above 1, more words than the text had.
ERROR_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5)
SPEECH_KINDS = CHECKS  # (the speech check runs on the same three: quality.checker.KINDS)
# Speaker similarity (a cosine): the same speaker sits high, finer steps there.
SIMILARITY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0)
BATCH_STAGES = ("llm", "flow", "hift")
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


def outcome_of(status: int) -> str:
    """A request's outcome from the status it was answered with (0: no answer was sent)."""
    if 0 < status < 400:
        return "ok"
    if status == 499:
        return "cancelled"
    if status in (408, 504):
        return "timeout"
    if status in (429, 503):
        return "refused"  # overloaded, rate-limited, not ready: the cluster said "not now"
    if 400 <= status < 500:
        return "invalid"
    return "failed"


def available() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


class Metrics:
    """One instance's metrics. ``live`` is read at each scrape: a callable returning
    {"ready", "inflight", "waiting", "long_texts", "outputs_failing", "voice_cache_hits",
    "voice_cache_misses", "seconds_per_char", "queued_seconds", "declined", "last_resort"};
    it is set by :meth:`watch` once the pipeline exists."""

    def __init__(self, engine: str = "", version: str = ""):
        self.enabled = available()
        self.live: Callable[[], dict[str, float]] = dict
        if not self.enabled:
            return
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        from prometheus_client.process_collector import ProcessCollector

        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)

        def histogram(name: str, what: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, what, ["route"], buckets=buckets, registry=self.registry)

        self.first_package = histogram(
            "cosyvoice_first_package_seconds",
            "Seconds from a request's arrival at the instance to the engine's first audio chunk.",
            FIRST_PACKAGE_BUCKETS,
        )
        self.audio = histogram(
            "cosyvoice_audio_duration_seconds", "Seconds of audio one completed synthesis made.", AUDIO_BUCKETS
        )
        self.queue_wait = histogram(
            "cosyvoice_queue_wait_seconds", "Seconds a synthesis waited for an engine slot.", WAIT_BUCKETS
        )
        self.synthesis = histogram(
            "cosyvoice_synthesis_seconds",
            "Seconds a completed synthesis spent in the engine (time with a slow reader left out).",
            SYNTHESIS_BUCKETS,
        )
        self.rtf = histogram(
            "cosyvoice_real_time_factor",
            "Engine seconds per second of audio of a completed synthesis (below 1: faster than real time).",
            RTF_BUCKETS,
        )
        self.first_chunk_compute = Histogram(
            "cosyvoice_first_chunk_compute_seconds",
            "A stream's first chunk inside the engine: part=llm, seconds from the synthesis' start until its "
            "tokens were there; part=audio, seconds of their token2wav (the compute floor of the first chunk).",
            ["part"],
            buckets=COMPUTE_BUCKETS,
            registry=self.registry,
        )
        self.batch = Histogram(
            "cosyvoice_batch_size",
            "Syntheses in one batched step of the model: stage=llm, the sequences of one vLLM engine step "
            "(--load-vllm); stage=flow and stage=hift, the token2wav work of one batched flow or HiFT run "
            "(--token2wav-batch).",
            ["stage"],
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "cosyvoice_requests",
            "Speech requests answered, by route and outcome.",
            ["route", "outcome"],
            registry=self.registry,
        )
        self.results_not_kept = Counter(
            "cosyvoice_results_not_kept",
            "Results (streamed or not) that could not be written to the outputs dir (disk full, unwritable).",
            registry=self.registry,
        )
        self.bad = Counter(
            "cosyvoice_bad_audio",
            "Syntheses that failed the audio check (NaN, beyond ±1, silent, implausible duration), by reason and "
            "where: a request's (never sent: retried elsewhere), the warm-up's or a canary's.",
            ["reason", "during"],
            registry=self.registry,
        )
        self.speech_error = Histogram(
            "cosyvoice_speech_error_ratio",
            "The speech check: the error (WER; CER for Chinese and Japanese) of what the recogniser heard "
            "against the text, by kind (request: a sampled live answer; warm_up; canary).",
            ["kind"],
            buckets=ERROR_BUCKETS,
            registry=self.registry,
        )
        self.speech_checks = Counter(
            "cosyvoice_speech_checks",
            "Speech checks, by kind and outcome (passed; failed: error above --asr-max-error; unchecked: "
            "no recogniser, or a text it cannot judge).",
            ["kind", "outcome"],
            registry=self.registry,
        )
        self.speaker_similarity = Histogram(
            "cosyvoice_speaker_similarity",
            "The speech check: the cosine of an answer's speaker embedding to its prompt's (upstream's "
            "campplus.onnx; answers spoken with a prompt), by kind (request: a sampled live answer; warm_up; canary).",
            ["kind"],
            buckets=SIMILARITY_BUCKETS,
            registry=self.registry,
        )
        for kind in SPEECH_KINDS:
            self.speech_error.labels(kind)
            self.speaker_similarity.labels(kind)
            for outcome in ("passed", "failed", "unchecked"):
                self.speech_checks.labels(kind, outcome)
        for route in ROUTES:  # every series from the start: rate() sees the first request
            for outcome in OUTCOMES:
                self.requests.labels(route, outcome)
        for part in ("llm", "audio"):
            self.first_chunk_compute.labels(part)
        for stage in BATCH_STAGES:
            self.batch.labels(stage)
        for reason in REASONS:
            for during in CHECKS:
                self.bad.labels(reason, during)
        labels = {"engine": engine, "version": version}
        metrics = self

        class Live:
            def collect(self) -> Any:
                state = metrics.live()
                info = GaugeMetricFamily(
                    "cosyvoice_instance_info", "The instance's engine and version.", labels=list(labels)
                )
                info.add_metric(list(labels.values()), 1)
                yield info
                for name, key, what in (
                    ("cosyvoice_instance_ready", "ready", "1 when the instance takes requests."),
                    ("cosyvoice_syntheses_in_flight", "inflight", "Syntheses holding an engine slot."),
                    ("cosyvoice_queue_depth", "waiting", "Requests waiting for an engine slot."),
                    ("cosyvoice_long_texts_in_flight", "long_texts", "Long texts this instance coordinates."),
                    (
                        "cosyvoice_outputs_failing",
                        "outputs_failing",
                        "1 while results cannot be kept: the last write to the outputs dir failed.",
                    ),
                    (
                        "cosyvoice_seconds_per_char",
                        "seconds_per_char",
                        "Engine seconds per character of text, a moving average of this instance's syntheses.",
                    ),
                    (
                        "cosyvoice_queued_work_seconds",
                        "queued_seconds",
                        "Seconds a request arriving now would wait here (estimated from the texts held).",
                    ),
                    (
                        "cosyvoice_speech_unchecked",
                        "speech_unchecked",
                        "1 while the last warm-up's or canary's speech could not be checked (no recogniser, "
                        "nothing to judge): not a pass.",
                    ),
                ):
                    yield GaugeMetricFamily(name, what, value=float(state.get(key, 0)))
                for name, key, what in (
                    ("cosyvoice_voice_cache_hits", "voice_cache_hits", "Saved voices spoken from the speaker cache."),
                    (
                        "cosyvoice_voice_cache_misses",
                        "voice_cache_misses",
                        "Saved voices whose prompt features were extracted (first use here).",
                    ),
                    (
                        "cosyvoice_routing_declined",
                        "declined",
                        "Requests declined because another instance would start them sooner (--routing work).",
                    ),
                    (
                        "cosyvoice_routing_last_resort",
                        "last_resort",
                        "Requests taken as nginx's last resort after every instance declined them.",
                    ),
                ):
                    yield CounterMetricFamily(name, what, value=float(state.get(key, 0)))

        self.registry.register(Live())

    def watch(self, live: Callable[[], dict[str, float]]) -> None:
        self.live = live

    # --- what the pipeline and the routes report ------------------------------------------

    def queued(self, route: str, seconds: float) -> None:
        if self.enabled:
            self.queue_wait.labels(route).observe(max(0.0, seconds))

    def first_chunk(self, route: str, seconds: float) -> None:
        if self.enabled:
            self.first_package.labels(route).observe(max(0.0, seconds))

    def first_chunk_parts(self, llm: float, audio: float) -> None:
        """A stream's first chunk as the engine timed it: its LLM and its token2wav seconds."""
        if self.enabled:
            self.first_chunk_compute.labels("llm").observe(max(0.0, llm))
            self.first_chunk_compute.labels("audio").observe(max(0.0, audio))

    def batched(self, stage: str, size: int) -> None:
        """One batched step of the model (``stage``: llm, flow, hift) ran ``size`` syntheses."""
        if self.enabled and stage in BATCH_STAGES:
            self.batch.labels(stage).observe(size)

    def completed(self, route: str, audio_seconds: float, engine_seconds: float) -> None:
        if not self.enabled:
            return
        self.audio.labels(route).observe(audio_seconds)
        self.synthesis.labels(route).observe(max(0.0, engine_seconds))
        if audio_seconds > 0:
            self.rtf.labels(route).observe(max(0.0, engine_seconds) / audio_seconds)

    def not_kept(self) -> None:
        if self.enabled:
            self.results_not_kept.inc()

    def speech_checked(self, kind: str, outcome: str, error: float | None, similarity: float | None = None) -> None:
        if not self.enabled:
            return
        self.speech_checks.labels(kind, outcome).inc()
        if error is not None:
            self.speech_error.labels(kind).observe(error)
        if similarity is not None:
            self.speaker_similarity.labels(kind).observe(similarity)

    def bad_audio(self, reason: str, during: str) -> None:
        if self.enabled:
            self.bad.labels(reason, during).inc()

    def request(self, route: str, outcome: str) -> None:
        if self.enabled:
            self.requests.labels(route, outcome).inc()

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """The scrape's body and content type (OpenMetrics when the scraper asks for it)."""
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


class RequestMetrics:
    """ASGI middleware: counts each speech request once, by route and outcome, and logs one
    line for it with nginx's request id (the id in nginx's access log and the client's
    ``X-Request-Id``). A stream whose status went out before it broke off says its outcome
    in ``scope["state"]["cvlb_outcome"]``, and so does a declined request ("declined": not
    counted, the instance nginx sends it to counts it)."""

    def __init__(
        self, app: ASGIApp, metrics: Metrics, segment_header: str, clock: Callable[[], float] = time.monotonic
    ):
        self.app, self.metrics, self.clock = app, metrics, clock
        self.segment_header = segment_header.lower().encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in SPEECH_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        route = "segment" if self.segment_header in headers else SPEECH_PATHS[path]
        rid = headers.get(b"x-request-id", b"-").decode("latin-1")[:128]
        state = scope.setdefault("state", {})
        status = 0
        started = self.clock()

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        raised = False
        try:
            await self.app(scope, receive, sending)
        except BaseException:
            raised = True
            raise
        finally:
            # (raised: an error no handler answered, or a stream that broke after its status went out)
            outcome = state.get("cvlb_outcome") or (
                "failed" if raised else outcome_of(status) if status else "cancelled"
            )
            if outcome == "declined":  # routing by work sent it on: the instance that answers it counts it
                log.debug("request %s %s declined rid=%s", route, path, rid)
            else:
                self.metrics.request(route, outcome)
                log.info(
                    "request %s %s %s %s in %.3fs rid=%s",
                    route,
                    path,
                    status or "-",
                    outcome,
                    self.clock() - started,
                    rid,
                )
