"""The speech check, off the hot path: a worker thread of its own transcribes answers and
scores them against their text (``score``), never delaying an answer.

* Live answers: a share of them (``--asr-sample``) is kept whole while it is made (a
  :class:`Tap`; up to ``MAX_SECONDS`` of audio, a longer one is not kept) and queued after it
  was answered. The queue is bounded: when the worker falls behind, answers are not queued
  (counted as skipped), nothing waits.
* The warm-up and every canary are checked too, and their callers wait for the verdict
  (:meth:`SpeechChecker.check_now`): their audio is bad when its error is above
  ``--asr-max-error``.

"Could not check" is never a pass: with no recogniser (none installed, or it failed to load)
or a text it cannot judge (another language than the recogniser's), a check says so
(:attr:`Check.unchecked`), and ``/ping`` shows the instance as unchecked.

Speaker similarity: an answer spoken with a prompt is also compared with the prompt's speaker
when there is a speaker model (``speaker``; upstream's ``campplus.onnx``), recogniser or not
(:attr:`Check.similarity`). A live answer's prompt is a file of its own request, removed once
it was answered: it is opened when the answer is queued, and read through that.

Instance side: numpy and the recogniser's own library, loaded lazily in the worker.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import IO

import numpy as np

from cosyvoice_lb.instance.quality.compared import Sample
from cosyvoice_lb.instance.quality.compared import current as current_comparison
from cosyvoice_lb.instance.quality.recognizers import Recognizer, RecognizerError
from cosyvoice_lb.instance.quality.score import Score, score, scored_by_character
from cosyvoice_lb.instance.quality.speaker import SpeakerError, SpeakerModel

log = logging.getLogger("cosyvoice_lb.instance")

MAX_SECONDS = 60.0  # the longest live answer kept for a check
QUEUE = 8  # live answers waiting for the worker at most
LAST = 20  # the checks /ping and the panel show
KINDS = ("request", "warm_up", "canary")


@dataclass(frozen=True)
class Check:
    """One answer checked: ``kind`` (one of KINDS), its ``text`` and what was heard, its
    ``score`` (None: unchecked, ``unchecked`` says why), the ``seconds`` of audio and the
    CPU ``cost`` of the check in seconds; ``failed``: its error above the threshold;
    ``similarity``: the cosine of its speaker embedding to its prompt's (None: no prompt, no
    speaker model, or it could not embed them)."""

    kind: str
    text: str
    transcript: str = ""
    score: Score | None = None
    unchecked: str = ""
    failed: bool = False
    seconds: float = 0.0
    cost: float = 0.0
    similarity: float | None = None
    at: float = field(default_factory=time.time)

    @property
    def outcome(self) -> str:
        return "unchecked" if self.score is None else "failed" if self.failed else "passed"

    def summary(self) -> dict:
        return {
            "kind": self.kind,
            "text": self.text[:200],
            "transcript": self.transcript[:200],
            "metric": self.score.kind if self.score else None,
            "error": round(self.score.ratio, 4) if self.score else None,
            "failed": self.failed,
            "unchecked": self.unchecked,
            "seconds": round(self.seconds, 3),
            "similarity": round(self.similarity, 4) if self.similarity is not None else None,
            "at": round(self.at, 3),
        }


class Tap:
    """A live answer's audio, kept while it is made (``add``) for a check after it was sent
    (``done``: queued to ``checker``; without one, :data:`NO_TAP`, it keeps nothing);
    ``prompt``: the prompt WAV it is spoken with ("" for none)."""

    def __init__(
        self,
        text: str,
        rate: int,
        limit: float = MAX_SECONDS,
        checker: SpeechChecker | None = None,
        prompt: str = "",
    ):
        self.text, self.rate, self.checker, self.prompt = text, rate, checker, prompt
        self.compared: Sample | None = None  # a model roll-out compares it: told what was heard
        self.parts: list[np.ndarray] = []
        self.samples, self.limit = 0, int(limit * rate)

    def done(self) -> None:
        """The answer was sent whole: queue it for its check."""
        if self.checker is not None:
            self.checker.submit(self)

    def add(self, audio: np.ndarray) -> None:
        if self.samples <= self.limit:
            self.parts.append(audio)
        self.samples += audio.size

    @property
    def whole(self) -> np.ndarray | None:
        """The answer's audio; None when it grew past the limit."""
        if self.samples > self.limit or not self.parts:
            return None
        return np.concatenate(self.parts)


class _NoTap(Tap):
    """An answer not chosen for a check: keeps nothing, queues nothing."""

    def add(self, audio: np.ndarray) -> None:
        pass

    def done(self) -> None:
        pass


NO_TAP = _NoTap("", 1)


# What the worker is handed: kind, text, audio, rate, whom to answer, and the prompt (a path, or
# the file opened when it was queued; "" for none).
_Queued = tuple[str, str, np.ndarray, int, Callable[[Check], None], str | IO[bytes]]


WORKER_NICENESS = 10  # what the worker thread adds to its niceness (Linux: per thread)


def yield_the_cpu() -> None:
    """Lower this thread's CPU priority: on a box whose cores also synthesise (a CPU box, or
    a GPU box's CPU-side work), a check must never take a core from an answer being made.
    Where a thread's niceness cannot be set, the worker runs as it is."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICENESS)
    except (AttributeError, OSError):  # (no per-thread priority here)
        pass


class SpeechChecker:
    """Checks answers with the recogniser ``make_recognizer`` builds (in the worker, at its
    first check; a :class:`RecognizerError` then leaves every check unchecked, with why).
    ``language``: what the recogniser understands ("en"; "" for any); ``record(check)``: the
    metrics; ``speaker``: the speaker model that gives answers spoken with a prompt their
    similarity (loaded in the worker at its first use; a :class:`SpeakerError` then leaves
    every similarity None, with one warning)."""

    def __init__(
        self,
        make_recognizer: Callable[[], Recognizer] | None,
        sample: float = 0.02,
        max_error: float = 0.5,
        language: str = "en",
        record: Callable[[Check], None] = lambda check: None,
        rng: random.Random | None = None,
        unavailable: str = "no speech recogniser here",
        speaker: SpeakerModel | None = None,
    ):
        self.make_recognizer, self.sample, self.max_error = make_recognizer, sample, max_error
        self.language = language
        self.listeners = [record]  # each check is told to these (the metrics; the pipeline's watch)
        self.rng = rng or random.Random()
        self.recognizer: Recognizer | None = None
        self.broken = "" if make_recognizer is not None else unavailable
        self.speaker, self.speaker_loaded = speaker, False
        self.skipped = 0  # live answers not queued: the worker was behind
        self.last: deque[Check] = deque(maxlen=LAST)
        self._queue: queue.Queue[_Queued] = queue.Queue(QUEUE)
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None

    def listen(self, listener: Callable[[Check], None]) -> None:
        """Tell ``listener`` of every check (in the worker, after it was made)."""
        self.listeners.append(listener)

    @property
    def name(self) -> str:
        return getattr(self.recognizer, "name", "") if self.recognizer is not None else ""

    # --- live answers ---------------------------------------------------------------------

    def tap(self, text: str, rate: int, prompt: str = "") -> Tap:
        """A :class:`Tap` for a live answer chosen for a check (``--asr-sample``), else
        :data:`NO_TAP`: also when no check of it could say more than unchecked (no
        recogniser, or a language it does not hear, and no speaker similarity), so such
        answers are neither kept nor queued. ``prompt``: the WAV it is spoken with. An answer
        a model roll-out compares (``compared``) is always checked, when it can be."""
        compared = current_comparison()
        if compared is not None and self.unjudged(text, prompt):
            compared.heard(None, None, self.broken or f"{self.name or 'the recogniser'} hears English only")
        elif compared is not None:
            tap = Tap(text, rate, checker=self, prompt=prompt)
            tap.compared = compared
            return tap
        if self.sample <= 0 or self.unjudged(text, prompt) or self.rng.random() >= self.sample:
            return NO_TAP
        return Tap(text, rate, checker=self, prompt=prompt)

    def unheard(self, text: str) -> bool:
        """The recogniser hears English only and ``text`` is scored by character (Chinese, Japanese)."""
        return self.language == "en" and scored_by_character(text)

    def unjudged(self, text: str, prompt: str = "") -> bool:
        """No check of ``text`` (spoken with ``prompt``) could say more than unchecked."""
        no_transcript = bool(self.broken) or self.unheard(text)
        return no_transcript and not (prompt and self.speaker is not None)

    def submit(self, tap: Tap) -> None:
        """Queue a live answer that was sent whole and good; never blocks."""
        audio = tap.whole
        compared = tap.compared
        if audio is None:
            if compared is not None:
                compared.heard(None, None, f"longer than the {MAX_SECONDS:g}s a check keeps")
            return
        if self._queue.full():  # (before the prompt is opened; put_nowait below still decides)
            self._skip(compared)
            return
        held = self._hold(tap.prompt)

        def answer(check: Check) -> None:
            if compared is not None:
                compared.heard(check.score.ratio if check.score else None, check.similarity, check.unchecked)

        try:
            self._queue.put_nowait(("request", tap.text, audio, tap.rate, answer, held))
        except queue.Full:
            self._skip(compared)
            _close(held)
            return
        self._start()

    def _skip(self, compared: Sample | None) -> None:
        self.skipped += 1
        if compared is not None:
            compared.heard(None, None, "the speech check was behind (its queue was full)")

    def _hold(self, prompt: str) -> str | IO[bytes]:
        """``prompt`` opened now, when there is a speaker model to read it later: a request's
        own prompt file is removed once it was answered, the open file stays readable."""
        if not prompt or self.speaker is None:
            return ""
        try:
            return open(prompt, "rb")  # (closed by the worker, after its check)
        except OSError:
            return prompt  # (the check says why it cannot be read)

    # --- the warm-up and canaries ----------------------------------------------------------

    def check_now(
        self, kind: str, text: str, audio: np.ndarray, rate: int, timeout: float = 120.0, prompt: str = ""
    ) -> Check:
        """Check ``audio`` in the worker and wait for the verdict (the warm-up, a canary);
        ``prompt``: the WAV it was spoken with."""
        done: list[Check] = []
        arrived = threading.Event()

        def answer(check: Check) -> None:
            done.append(check)
            arrived.set()

        held = self._hold(prompt)
        try:
            self._queue.put((kind, text, audio, rate, answer, held), timeout=timeout)
        except queue.Full:
            _close(held)
            raise
        self._start()
        if not arrived.wait(timeout):
            return Check(kind, text, unchecked=f"the speech check took longer than {timeout:.0f}s")
        return done[0]

    # --- the worker -------------------------------------------------------------------------

    def _start(self) -> None:
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="speech-check", daemon=True)
                self._worker.start()

    def _run(self) -> None:
        yield_the_cpu()
        while True:
            kind, text, audio, rate, answer, prompt = self._queue.get()
            try:
                check = self.check(kind, text, audio, rate, prompt)
            except Exception as exc:  # noqa: BLE001  (the worker outlives any one check; its caller hears why)
                log.exception("a speech check failed")
                check = Check(kind, text, unchecked=f"the speech check failed: {type(exc).__name__}: {exc}")
            finally:
                _close(prompt)
            self.last.append(check)
            for listener in self.listeners:
                try:
                    listener(check)
                except Exception:  # noqa: BLE001  (a listener never stops the checks)
                    log.exception("a speech check's listener failed")
            answer(check)

    def check(self, kind: str, text: str, audio: np.ndarray, rate: int, prompt: str | IO[bytes] = "") -> Check:
        """One check, here and now (the worker's step): what was heard and, with a ``prompt``
        (its WAV: a path or the file opened), how like the prompt's speaker it sounds."""
        heard = self._transcribed(kind, text, audio, rate)
        speaker = self._speaker() if prompt else None
        if speaker is None:
            return heard
        started = time.thread_time()
        try:
            similarity = speaker.similarity(audio, rate, prompt)
        except SpeakerError as exc:
            log.info("no speaker similarity for this check: %s", exc)
            return heard
        return replace(heard, similarity=similarity, cost=heard.cost + time.thread_time() - started)

    def _transcribed(self, kind: str, text: str, audio: np.ndarray, rate: int) -> Check:
        seconds = audio.size / rate if rate else 0.0
        if self.unheard(text):
            return Check(kind, text, unchecked=f"{self.name or 'the recogniser'} hears English only", seconds=seconds)
        recognizer = self._recognizer()
        if recognizer is None:
            return Check(kind, text, unchecked=self.broken, seconds=seconds)
        started = time.thread_time()
        try:
            heard = recognizer.transcribe(audio, rate)
        except RecognizerError as exc:
            return Check(kind, text, unchecked=str(exc), seconds=seconds)
        scored = score(text, heard)
        failed = scored.ratio > self.max_error
        return Check(kind, text, heard, scored, "", failed, seconds, time.thread_time() - started)

    def _recognizer(self) -> Recognizer | None:
        if self.recognizer is None and not self.broken and self.make_recognizer is not None:
            try:
                self.recognizer = self.make_recognizer()
            except RecognizerError as exc:
                self.broken = str(exc)
                log.warning("no speech check: %s", exc)
        return self.recognizer

    def _speaker(self) -> SpeakerModel | None:
        """The speaker model, loaded (at its first use); None without one or when it failed to."""
        if self.speaker is not None and not self.speaker_loaded:
            try:
                self.speaker.load()
                self.speaker_loaded = True
            except SpeakerError as exc:
                self.speaker = None
                log.warning("no speaker similarity in the speech check: %s", exc)
        return self.speaker

    def state(self) -> dict:
        """What ``/ping`` says of the speech check."""
        last = list(self.last)
        return {
            "recognizer": self.name or None,
            "problem": self.broken,
            "sample": self.sample,
            "max_error": self.max_error,
            "skipped": self.skipped,
            "last": [c.summary() for c in last[-5:]],
        }


def _close(prompt: str | IO[bytes]) -> None:
    if not isinstance(prompt, str):
        prompt.close()
