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

Instance side: numpy and the recogniser's own library, loaded lazily in the worker.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from cosyvoice_lb.instance.quality.recognizers import Recognizer, RecognizerError
from cosyvoice_lb.instance.quality.score import Score, score, scored_by_character

log = logging.getLogger("cosyvoice_lb.instance")

MAX_SECONDS = 60.0  # the longest live answer kept for a check
QUEUE = 8  # live answers waiting for the worker at most
LAST = 20  # the checks /ping and the panel show
KINDS = ("request", "warm_up", "canary")


@dataclass(frozen=True)
class Check:
    """One answer checked: ``kind`` (one of KINDS), its ``text`` and what was heard, its
    ``score`` (None: unchecked, ``unchecked`` says why), the ``seconds`` of audio and the
    CPU ``cost`` of the check in seconds; ``failed``: its error above the threshold."""

    kind: str
    text: str
    transcript: str = ""
    score: Score | None = None
    unchecked: str = ""
    failed: bool = False
    seconds: float = 0.0
    cost: float = 0.0
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
            "at": round(self.at, 3),
        }


class Tap:
    """A live answer's audio, kept while it is made (``add``) for a check after it was sent
    (``done``: queued to ``checker``; without one, :data:`NO_TAP`, it keeps nothing)."""

    def __init__(self, text: str, rate: int, limit: float = MAX_SECONDS, checker: SpeechChecker | None = None):
        self.text, self.rate, self.checker = text, rate, checker
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


class SpeechChecker:
    """Checks answers with the recogniser ``make_recognizer`` builds (in the worker, at its
    first check; a :class:`RecognizerError` then leaves every check unchecked, with why).
    ``language``: what the recogniser understands ("en"; "" for any); ``record(check)``: the
    metrics."""

    def __init__(
        self,
        make_recognizer: Callable[[], Recognizer] | None,
        sample: float = 0.02,
        max_error: float = 0.5,
        language: str = "en",
        record: Callable[[Check], None] = lambda check: None,
        rng: random.Random | None = None,
        unavailable: str = "no speech recogniser here",
    ):
        self.make_recognizer, self.sample, self.max_error = make_recognizer, sample, max_error
        self.language = language
        self.listeners = [record]  # each check is told to these (the metrics; the pipeline's watch)
        self.rng = rng or random.Random()
        self.recognizer: Recognizer | None = None
        self.broken = "" if make_recognizer is not None else unavailable
        self.skipped = 0  # live answers not queued: the worker was behind
        self.last: deque[Check] = deque(maxlen=LAST)
        self._queue: queue.Queue[tuple[str, str, np.ndarray, int, Callable[[Check], None]]] = queue.Queue(QUEUE)
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None

    def listen(self, listener: Callable[[Check], None]) -> None:
        """Tell ``listener`` of every check (in the worker, after it was made)."""
        self.listeners.append(listener)

    @property
    def name(self) -> str:
        return getattr(self.recognizer, "name", "") if self.recognizer is not None else ""

    # --- live answers ---------------------------------------------------------------------

    def tap(self, text: str, rate: int) -> Tap:
        """A :class:`Tap` for a live answer chosen for a check (``--asr-sample``), else
        :data:`NO_TAP`: also when no check of it could say more than unchecked (no
        recogniser, or a language it does not hear), so such answers are neither kept nor
        queued."""
        if self.sample <= 0 or self.broken or self.unheard(text) or self.rng.random() >= self.sample:
            return NO_TAP
        return Tap(text, rate, checker=self)

    def unheard(self, text: str) -> bool:
        """The recogniser hears English only and ``text`` is scored by character (Chinese, Japanese)."""
        return self.language == "en" and scored_by_character(text)

    def submit(self, tap: Tap) -> None:
        """Queue a live answer that was sent whole and good; never blocks."""
        audio = tap.whole
        if audio is None:
            return
        try:
            self._queue.put_nowait(("request", tap.text, audio, tap.rate, lambda check: None))
        except queue.Full:
            self.skipped += 1
            return
        self._start()

    # --- the warm-up and canaries ----------------------------------------------------------

    def check_now(self, kind: str, text: str, audio: np.ndarray, rate: int, timeout: float = 120.0) -> Check:
        """Check ``audio`` in the worker and wait for the verdict (the warm-up, a canary)."""
        done: list[Check] = []
        arrived = threading.Event()

        def answer(check: Check) -> None:
            done.append(check)
            arrived.set()

        self._queue.put((kind, text, audio, rate, answer), timeout=timeout)
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
        while True:
            kind, text, audio, rate, answer = self._queue.get()
            try:
                check = self.check(kind, text, audio, rate)
            except Exception as exc:  # noqa: BLE001  (the worker outlives any one check; its caller hears why)
                log.exception("a speech check failed")
                check = Check(kind, text, unchecked=f"the speech check failed: {type(exc).__name__}: {exc}")
            self.last.append(check)
            for listener in self.listeners:
                try:
                    listener(check)
                except Exception:  # noqa: BLE001  (a listener never stops the checks)
                    log.exception("a speech check's listener failed")
            answer(check)

    def check(self, kind: str, text: str, audio: np.ndarray, rate: int) -> Check:
        """One check, here and now (the worker's step)."""
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
