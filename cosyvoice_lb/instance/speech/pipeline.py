"""The one synthesis pipeline of an instance: validate → prompt → admission → synthesize →
encode → keep.

Every entry point (the HTTP API, the Gradio UI, and whatever comes next) is a small
adapter onto :class:`Pipeline`: it decodes its own input into a payload, calls
:meth:`Pipeline.prepare` and one of the synthesis methods, and turns the errors into its
own answers through :func:`~cosyvoice_lb.instance.speech.failures.describe`, the one table
from exceptions to HTTP statuses.

Instance side: standard library, numpy and what ``audio``/``engines`` use.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_lb.common.timeouts import WORKER_GRACE
from cosyvoice_lb.instance.audio.check import AudioCheck, Fault
from cosyvoice_lb.instance.audio.outputs import Outputs
from cosyvoice_lb.instance.audio.prompts import read_prompt
from cosyvoice_lb.instance.audio.wav import WavBuilder, wav_bytes, write_wav
from cosyvoice_lb.instance.engines import CLONING, Engine, SynthesisRequest, clones
from cosyvoice_lb.instance.lifetime import Tally
from cosyvoice_lb.instance.metrics import Metrics
from cosyvoice_lb.instance.quality.checker import NO_TAP, Check, SpeechChecker, Tap
from cosyvoice_lb.instance.quality.compared import ContextPool, compared_wait
from cosyvoice_lb.instance.quality.probe import Probe
from cosyvoice_lb.instance.routing.router import Router
from cosyvoice_lb.instance.routing.rule import LAST_HEADER, TRY_HEADER, Rate
from cosyvoice_lb.instance.speech.admission import Admission, Clock, Lease, TimedOut, deadline_for
from cosyvoice_lb.instance.speech.canary import AudioWatch
from cosyvoice_lb.instance.speech.failures import BadAudio, Declined, NoAudio, StorageFailed
from cosyvoice_lb.instance.speech.poison import Ledger, fingerprint
from cosyvoice_lb.instance.speech.validation import (
    MAX_SPEED,
    MIN_SPEED,
    BadRequest,
    Limits,
    check_text,
    make_request,
    prompt_span,
    safe,
)
from cosyvoice_lb.instance.speech.voices import Registry, Voice, check_consent

log = logging.getLogger("cosyvoice_lb.instance")


@dataclass
class Job:
    """A validated request on its way: the synthesis, notices for the client, and the
    prompt file written for it (removed by :meth:`Pipeline.finish`)."""

    request: SynthesisRequest
    notices: list[str] = field(default_factory=list)
    prompt_path: str = ""
    fingerprint: str = ""  # the same request on any instance (see ``poison``)
    attempt: str = ""  # nginx's id of the client request, the same on each of its tries
    route: str = "api"  # where it came in (see ``metrics.ROUTES``)
    arrived: float = 0.0  # on the admission clock: its first package is timed from here
    background: bool = False  # served after interactive requests (see ``admission``)
    lease: Any = None  # a streaming session's engine slot: it runs on it (see ``admission.Lease``)


class Pipeline:
    """The engine, its admission and the outputs dir, shared by every entry point."""

    def __init__(
        self,
        engine: Engine,
        admission: Admission | None = None,
        limits: Limits | None = None,
        outputs: Outputs | None = None,
        scratch: str = "",
        port: int = 0,
        request_timeout: float = 0.0,
        wall: Clock = time.time,
        ledger: Ledger | None = None,
        registry: Registry | None = None,
        metrics: Metrics | None = None,
        speech: SpeechChecker | None = None,
        check_prompt: tuple[str, str] = ("", ""),
        measured_only: bool = False,
        router: Router | None = None,
    ):
        self.engine = engine
        self.admission = admission or Admission()
        self.limits = limits or Limits()
        self.port = port
        self.outputs = outputs or Outputs("", port, 0, 0)
        self.scratch = scratch or tempfile.gettempdir()
        self.request_timeout = request_timeout  # seconds per API request, retries included; 0: none
        self.wall = wall
        self.ledger = ledger  # poison requests: see ``poison``
        self.registry = registry  # saved voices: see ``voices``
        self.metrics = metrics or Metrics(engine.name)
        self.speech = speech  # the speech check (``quality``); None: none here
        if speech is not None:
            speech.listen(self.heard)
        self.probe = Probe(self, check_prompt, measured_only)  # the warm-up and the canary, and their verdict
        self.watch = AudioWatch(self.admission.clock, self.metrics.bad_audio)  # bad audio found (see ``canary``)
        self.router = router  # routing by work (see ``routing``); None: never declines
        # this engine's seconds per character, measured (the router's: what it publishes)
        self.rate = router.rate if router is not None else Rate()
        self.storage_problem = ""  # why the last result could not be kept; "" once one was
        self.metrics.watch(self.live)
        self.coordinating = Tally()  # long texts this instance is fanning out (a drain waits for them)
        # API syntheses run here rather than in the server's shared pool: a request whose
        # time ran out is answered while a stuck engine call keeps only its own thread.
        self.workers = ContextPool(max_workers=32, thread_name_prefix="synthesis")

    def heard(self, check: Check) -> None:
        """A speech check was made: counted; a live answer that failed it owes a canary (which
        says whether the instance or the request was at fault, as for bad audio)."""
        error = check.score.ratio if check.score else None
        self.metrics.speech_checked(check.kind, check.outcome, error, check.similarity)
        if check.kind == "request" and check.failed and not self.probe.measured_only:  # (a model canary: compared)
            log.warning("a live answer failed the speech check: heard %r for %r", check.transcript, check.text)
            self.watch.owed.set()

    def live(self) -> dict[str, float]:
        """What a scrape reads of this instance now (see ``metrics``)."""
        snapshot = self.admission.snapshot()
        return {
            "ready": float(snapshot.ready),
            "inflight": snapshot.inflight,
            "waiting": snapshot.waiting,
            "long_texts": self.coordinating.count(),
            "speech_unchecked": float(bool(self.probe.verdict.unchecked)),
            "outputs_failing": float(bool(self.storage_problem)),
            "voice_cache_hits": getattr(self.engine, "voice_cache_hits", 0),
            "voice_cache_misses": getattr(self.engine, "voice_cache_misses", 0),
            **self.routing(),
        }

    def routing(self) -> dict[str, float]:
        """What routing by work sees here: the measured seconds per character (0 until the
        first synthesis after the warm-up ends), the seconds a request arriving now would wait, and the requests
        declined and taken as nginx's last resort."""
        router = self.router
        return {
            "seconds_per_char": self.rate.per_char or 0.0,
            "queued_seconds": round(self.admission.load().wait(self.admission.clock()), 6),
            "declined": router.declined if router is not None else 0,
            "last_resort": router.last_resort if router is not None else 0,
        }

    def route(self, headers: Any) -> None:
        """Take a speech request here, or raise :class:`Declined` when another instance would
        start it sooner. Decided first, before the body is read: what it weighs is this
        instance's queue against the others'. Only a request nginx marked as a try of its own
        is ever declined (a caller at the instance's port gets an answer, never a decline).
        ``headers``: the request's (lower-case keys)."""
        if self.router is None:
            return
        decision = self.router.check(
            headers.get(TRY_HEADER.lower(), ""), headers.get(LAST_HEADER.lower(), "") == "last"
        )
        if decision.decline:
            raise Declined(decision.message())

    @property
    def modes(self) -> tuple[str, ...]:
        return self.engine.modes or ("sft",)

    # --- loading ---------------------------------------------------------------------------

    def load(self) -> None:
        """Load the engine, run one warm-up synthesis, then turn ready (``quality.probe``)."""
        self.probe.load()

    # --- validate → prompt ---------------------------------------------------------------

    def prepare(
        self,
        payload: dict,
        prompt_data: bytes | None = None,
        speeds: tuple[float, float] = (MIN_SPEED, MAX_SPEED),
        route: str = "api",
        headers: Any = None,
    ) -> Job:
        """Validate, refuse when not ready, write the prompt file, fill in the defaults.
        ``route``: where the request came in, for its metrics; ``headers``: the request's
        (lower-case keys), for nginx's id of its tries."""
        arrived = self.admission.clock()
        payload = dict(payload)
        voice = self.voice(payload.pop("voice", None))
        if voice is not None:
            if prompt_data is not None:
                raise BadRequest("send a saved voice or prompt_audio, not both")
            if payload.get("prompt_text"):
                raise BadRequest("a saved voice brings its own transcript: drop prompt_text")
            payload["prompt_text"] = voice.prompt_text
            if not payload.get("mode"):
                payload["mode"] = "instruct" if payload.get("instruct_text") else "zero_shot"
        request = make_request(
            payload,
            self.limits,
            self.modes,
            self.engine.speakers(),
            has_prompt=prompt_data is not None or voice is not None,
            speeds=speeds,
        )
        self.admission.check_ready()
        # (the voice's file, not the per-request copy, so the same request has one fingerprint)
        voice_file = self.registry.audio_path(voice) if voice is not None and self.registry is not None else ""
        job = Job(
            request,
            fingerprint=fingerprint(request, voice_file, prompt_data or b""),
            attempt=headers.get(TRY_HEADER.lower(), "") if headers is not None else "",
            route=route,
            arrived=arrived,
        )
        try:
            if voice is not None and self.registry is not None:
                job.prompt_path = self.registry.borrow(voice, self.scratch)
                job.request = replace(job.request, prompt_wav=job.prompt_path, voice_id=voice.id)
            if prompt_data is not None:
                job.prompt_path, job.notices = self.prepare_prompt(prompt_data)
                job.request = replace(job.request, prompt_wav=job.prompt_path)
            job.request = self.complete(job.request)
        except BaseException:
            self.finish(job)
            raise
        return job

    # --- saved voices ---------------------------------------------------------------------

    def voices(self) -> Registry:
        if self.registry is None:
            raise BadRequest("this instance keeps no saved voices (started without --voices-dir)", status=404)
        if not clones(self.engine):
            raise BadRequest(
                f"the {self.engine.name} engine cannot speak saved voices (it does not clone voices): "
                "start the cluster with a CosyVoice model (--model-dir)"
            )
        return self.registry

    def voice(self, key: Any) -> Voice | None:
        """The saved voice a request names (None: none named)."""
        if key is None or key == "":
            return None
        if not isinstance(key, str):
            raise BadRequest(f'"voice" must be a saved voice\'s id or name, not {safe(key)}')
        registry = self.voices()
        retain = getattr(self.engine, "retain_voices", None)
        if retain is not None:  # deleted voices leave the engine's cache too
            retain(registry.ids())
        return registry.require(key)

    def save_voice(self, name: Any, data: bytes | None, prompt_text: Any, consent: str = "") -> tuple[Voice, list[str]]:
        """Check a prompt by the prompt rules and store it as a voice: (voice, notices)."""
        registry = self.voices()
        consent = check_consent(consent)  # (before the upload is decoded: nothing to do without it)
        transcript = check_text(prompt_text, self.limits.max_chars, "prompt_text")
        if data is None:
            span = prompt_span(self.limits.max_prompt_seconds)
            raise BadRequest(f"audio_sample is missing: upload {span} of the voice as the file audio_sample")
        prompt = read_prompt(data, self.limits.max_prompt_seconds)
        try:
            voice = registry.create(name, prompt.audio, prompt.rate, transcript, consent)
        except OSError as exc:
            raise StorageFailed("the voice", str(registry.root), exc, "--voices-dir") from None
        return voice, prompt.notices

    def prepare_prompt(self, data: bytes) -> tuple[str, list[str]]:
        """Decode an upload and write it as the WAV file upstream wants; (path, notices)."""
        prompt = read_prompt(data, self.limits.max_prompt_seconds)
        path = os.path.join(self.scratch, f"prompt-{self.port}-{uuid.uuid4().hex}.wav")
        try:
            write_wav(Path(path), prompt.audio, prompt.rate)
        except OSError as exc:
            raise StorageFailed("the prompt audio", self.scratch, exc) from None
        return path, prompt.notices

    def complete(self, request: SynthesisRequest) -> SynthesisRequest:
        """Fill what the client left to the engine: the default mode and, for a cloning mode
        without prompt audio, the engine's bundled prompt."""
        mode = request.mode or self.engine.modes[0]
        if mode in CLONING and not request.prompt_wav:
            default = getattr(self.engine, "default_prompt", lambda: ("", ""))()
            if mode == "instruct" and self.engine.speakers():
                default = ("", "")
            if default[0]:
                request = replace(request, prompt_wav=default[0], prompt_text=request.prompt_text or default[1])
            elif mode != "instruct" or not self.engine.speakers():
                raise BadRequest(
                    f"mode {mode} needs prompt_audio and this model has no default prompt: send prompt_audio"
                )
        if mode == "instruct" and not request.instruct_text:
            request = replace(request, instruct_text="Speak naturally.")
        return replace(request, mode=mode)

    def finish(self, job: Job) -> None:
        """The job is done with its prompt file."""
        if job.prompt_path:
            try:
                os.unlink(job.prompt_path)
            except FileNotFoundError:
                pass
            job.prompt_path = ""

    # --- admission → synthesize ----------------------------------------------------------

    def deadline(self, stamp: str | None) -> float | None:
        """The request's deadline on the admission clock (nginx's X-Request-Start stamp)."""
        return deadline_for(self.request_timeout, stamp, self.wall(), self.admission.clock())

    def chunks(
        self,
        job: Job,
        *,
        bounded: bool = False,
        deadline: float | None = None,
        chunk_deadline: bool = False,
        count: bool = True,
        cancelled: Any = None,
    ) -> Iterator[np.ndarray]:
        """Chunks as the engine makes them, holding an engine slot from the first ``next``.

        ``bounded``/``deadline``: see :meth:`Admission.admit`; with ``chunk_deadline`` the
        synthesis itself stops at the first chunk past the deadline. ``cancelled`` (an
        Event): set when the client went away; the synthesis stops at its next chunk and
        frees the slot, counted neither served nor failed. ``count``: False for the warm-up,
        which is neither counted nor observed in the metrics.

        Every chunk passes the audio check before it is yielded, and the whole at the end
        (``audio.check``): bad audio raises :class:`BadAudio` (a request's is counted here).
        """
        ledger = self.ledger if job.fingerprint else None
        deaths = ledger.check(job.fingerprint) if ledger is not None else 0  # refused before it waits
        clock, metrics = self.admission.clock, self.metrics if count else None
        queued = clock()
        chars = len(job.request.text)
        cost, background, lease = self.rate.estimate(chars), job.background, job.lease
        ticket = self.admission.admit(bounded=bounded, deadline=deadline, cost=cost, background=background, lease=lease)
        admitted = clock()
        if metrics is not None:
            metrics.queued(job.route, admitted - queued)
            compared_wait(admitted - queued)  # (a model roll-out judges latency from the engine's start)
        samples, working = 0, 0.0  # audio made; seconds spent in the engine (not with the reader)
        # Marked only while it holds the engine: a request queued behind a culprit is no suspect.
        try:
            mark = ledger.enter(job.fingerprint, deaths, job.attempt) if ledger is not None else ""
        except BaseException:
            ticket.release(None)
            raise
        outcome: bool | None = None
        made: Iterator[Any] | None = None
        check = AudioCheck(job.request.spoken(), job.request.speed, self.engine.sample_rate)
        tap = self.tap(job.request, count)
        try:
            request = job.request if cancelled is None else replace(job.request, cancel=cancelled)
            made = iter(self.engine.synthesize(request))
            resumed = clock()
            for chunk in made:
                working += clock() - resumed
                if cancelled is not None and cancelled.is_set():
                    return
                if chunk_deadline and deadline is not None and self.admission.clock() > deadline:
                    raise TimedOut(
                        "the synthesis ran past the request timeout: send shorter text, stream "
                        'it ("stream": true), or raise --request-timeout'
                    )
                ticket.handed_out()  # the engine made a chunk; now it is the reader's turn
                audio = np.asarray(chunk, dtype=np.float32).reshape(-1)
                self.refuse_bad(check.chunk(audio), count)
                if metrics is not None and samples == 0 and audio.size:
                    metrics.first_chunk(job.route, clock() - (job.arrived or queued))
                samples += audio.size
                tap.add(audio)
                yield audio
                if cancelled is not None and cancelled.is_set():  # gone while it had the chunk
                    return
                ticket.working()  # back in the engine: the stall clock runs from here
                resumed = clock()
            working += clock() - resumed
            self.refuse_bad(check.finish(), count)
            outcome = True
            if count:  # (not the warm-up: a first run's one-time costs would skew it)
                self.watch.good()
                self.rate.observe(chars, working)
            if metrics is not None:
                metrics.completed(job.route, samples / self.engine.sample_rate, working)
            tap.done()
        except GeneratorExit:
            raise
        except Exception:
            if cancelled is not None and cancelled.is_set():
                return  # (the engine stopped because the client left: neither served nor failed)
            outcome = False
            raise
        finally:
            try:
                close = getattr(made, "close", None)
                if close is not None:
                    close()  # the engine's generator lets go of what it holds
            finally:
                ticket.release(outcome if count else None)
                if mark and ledger is not None:
                    # it ended, and this process lives: no evidence; spoken to the end, it
                    # clears the deaths its request was present at (see ``poison``)
                    ledger.leave(mark, spoken=outcome is True)

    def lease(self, chars: int) -> Lease:
        """An engine slot for a streaming session, its cost estimated for ``chars`` (see ``Admission.lease``)."""
        return self.admission.lease(self.rate.estimate(chars))

    def tap(self, request: SynthesisRequest, count: bool) -> Tap:
        """Where a live answer's audio goes for the speech check, after it was sent (a share of
        them, ``--asr-sample``; never the warm-up's or a canary's: those are checked whole)."""
        if self.speech is None or not count or not request.text:  # ("": a session's text stream)
            return NO_TAP
        return self.speech.tap(request.text, self.engine.sample_rate, request.prompt_wav)

    def speak(self, request: SynthesisRequest) -> np.ndarray:
        """A synthesis of the instance's own (the warm-up, a canary): never counted as served."""
        return self.synthesize(Job(request), count=False)

    def refuse_bad(self, fault: Fault | None, count: bool) -> None:
        """Bad audio is never answered: :class:`BadAudio` (502: nginx retries it elsewhere); a
        request's is counted against the instance, and owes a canary (see ``canary``)."""
        if fault is None:
            return
        if count:
            self.watch.bad(fault, "request")
            log.warning("bad audio not sent: %s", fault)
        raise BadAudio(fault, self.port)

    def canary(self) -> Fault | None:
        """One canary synthesis (never counted as served): its audio's fault, or None."""
        return self.probe.run("canary").fault

    def synthesize(
        self,
        job: Job,
        *,
        bounded: bool = False,
        deadline: float | None = None,
        count: bool = True,
        cancelled: Any = None,
    ) -> np.ndarray:
        """The whole audio (stops at the first chunk past ``deadline``; ``cancelled``: see
        :meth:`chunks`, the audio so far then)."""
        chunks = list(
            self.chunks(job, bounded=bounded, deadline=deadline, chunk_deadline=True, count=count, cancelled=cancelled)
        )
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)

    async def run(self, deadline: float | None, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a synthesis worker; past the deadline (plus a moment for the
        worker's own, clearer timeout) the request is answered while the worker runs on."""
        future = asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)
        if deadline is None:
            return await future
        try:
            return await asyncio.wait_for(future, max(0.0, deadline - self.admission.clock()) + WORKER_GRACE)
        except asyncio.TimeoutError:
            raise TimedOut(
                f"no answer within the request timeout ({self.request_timeout:g}s): the synthesis "
                "is stuck or too long for the bound; retry (the health loop restarts hung "
                "instances), send shorter text, or raise --request-timeout"
            ) from None

    # --- encode → keep -------------------------------------------------------------------

    def encode_wav(self, audio: np.ndarray) -> bytes:
        if audio.size == 0:  # e.g. text of punctuation only: the model says nothing
            raise NoAudio()
        return wav_bytes(audio, self.engine.sample_rate)

    def problems(self) -> list[str]:  # what is wrong with this instance although it serves (``/ping`` says it)
        return [self.storage_problem] if self.storage_problem else []

    def keep(self, audio: np.ndarray | WavBuilder) -> str:
        """Save a result in the outputs dir (whole or not at all); StorageFailed when the
        disk is full or the dir unwritable. A failure is counted and reported as a problem
        of the instance until a result is kept again."""
        try:
            path = self.outputs.save(audio, self.engine.sample_rate)
        except OSError as exc:
            failed = StorageFailed("the result", str(self.outputs.dir), exc)
            self.storage_problem = f"results are not being kept: {failed}"
            self.metrics.not_kept()
            raise failed from None
        self.storage_problem = ""
        return path
