"""The job runner: takes queued jobs from the store and makes their audio, segment by segment.

A job's text is split as the long-text path splits one (:func:`segments_of`); every segment is
an ordinary speech request through the balancer (``send``, :class:`cosyvoice_lb.jobs.sender.Sender`
in the service), its audio kept in the results dir (``results``,
:class:`cosyvoice_lb.jobs.results.Results`) and recorded done in the store; once all are done
they are joined and encoded into the job's result, and the job succeeds.

- Slots: at most ``slots`` segments are out at a time, over every job this runner holds; a
  job's segments start in order, the oldest job's first, and a new job is claimed only when a
  slot would stay free otherwise. With ``share`` (:mod:`cosyvoice_lb.jobs.yielding`) the
  bound is what it says at each round (fewer while interactive requests come): a segment out
  is never called back, the next is sent only once fewer are out.
- Retries: a segment that failed for a reason a retry can change (nothing answered, every
  instance busy, bad audio) is sent again after a backoff (doubling, capped), at most
  ``retries`` more times; any other failure (the input, a poison request, the credentials, a
  timeout) fails the job with a reason that names the segment and its first words. A job's
  failure never stops the runner.
- Leases: the runner renews each job's lease while it works on it; a job it no longer holds
  (cancelled, removed, or taken over by another runner after its lease expired) is dropped:
  its segments in flight are not recorded, and a cancelled job's files are removed.
- Crash safety: a job taken over (this runner restarted, or another's died) keeps the segments
  that are recorded done *and* whose audio is on disk; only the rest are made again. The
  segment size a job was first split with is kept with its files, so a changed
  ``--segment-chars`` does not change a job under way.
- A full disk (the results' or the store's) fails the job with "the disk is full: ...".

All I/O is in the collaborators; the runner itself is the rules above, on one thread
(:meth:`Runner.step`, called by :meth:`Runner.run`), with the segments' requests on a pool
of ``slots`` threads and the joining of results on one more.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Protocol

from cosyvoice_lb.instance.audio.segments import split_text
from cosyvoice_lb.instance.speech.fanout import opening
from cosyvoice_lb.instance.speech.validation import WORD
from cosyvoice_lb.jobs import model
from cosyvoice_lb.jobs.base import JobStore, StoreError, StoreFailure
from cosyvoice_lb.jobs.model import Job, Result
from cosyvoice_lb.jobs.results import ResultsError
from cosyvoice_lb.jobs.sender import SegmentError

log = logging.getLogger("cosyvoice_lb.jobs")

Send = Callable[[Mapping[str, Any], str, int | None], bytes]
RETRIES = 6  # more tries of a segment that failed retryably
BACKOFF = 1.0  # seconds before a segment's first retry, doubled for each next one
MAX_BACKOFF = 30.0
POLL = 0.1  # seconds between rounds while segments are out
IDLE = 0.5  # ... and while there is nothing to do
DRAIN = 10.0  # on stop, seconds the segments out get to come back (and be kept)
RELEASE = 0.001  # the lease a stopping runner leaves its jobs with: the next runner takes them at once
STORE_LOG_EVERY = 30.0  # seconds between warnings about a store that keeps failing
DISK_FULL = "the disk is full"


class Results(Protocol):
    """What the runner needs of the results dir (:class:`cosyvoice_lb.jobs.results.Results`)."""

    def plan(self, job_id: str) -> int | None: ...
    def write_plan(self, job_id: str, segment_chars: int, total: int) -> None: ...
    def write_segment(self, job_id: str, index: int, wav: bytes) -> None: ...
    def has_segment(self, job_id: str, index: int) -> bool: ...
    def assemble(self, job_id: str, count: int, fmt: str) -> Result: ...
    def drop_segments(self, job_id: str) -> None: ...
    def remove(self, job_id: str) -> int: ...


def segments_of(text: str, segment_chars: int) -> list[str]:
    """The segments a job's text is made in: the long-text path's split at sentence ends into
    pieces of at most ``segment_chars``, less pieces without a word ("* * *" between chapters:
    the model has nothing to say for them). An empty list: nothing to say at all."""
    if isinstance(segment_chars, bool) or not isinstance(segment_chars, int) or segment_chars < 1:
        raise ValueError(f"segment_chars: a whole number of characters, at least 1, not {segment_chars!r}")
    return [piece for piece in split_text(text, segment_chars) if WORD.search(piece)]


def seed_of(job: Job) -> int:
    """The one seed of every segment of the job: its own, else one its id always gives (a job
    taken over keeps its voice)."""
    seed = job.params.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**32:
        return seed
    return int.from_bytes(hashlib.sha256(job.id.encode()).digest()[:4], "big")


@dataclass
class Active:
    """A job this runner holds, and where its segments are."""

    job: Job
    segments: list[str]
    seed: int
    renewed: float
    done: set[int] = field(default_factory=set)  # on disk and recorded in the store
    pending: list[int] = field(default_factory=list)  # to send, in order (retries among them)
    inflight: dict[int, futures.Future] = field(default_factory=dict)
    written: set[int] = field(default_factory=set)  # on disk, not recorded yet (the store failed)
    tries: dict[int, int] = field(default_factory=dict)
    not_before: dict[int, float] = field(default_factory=dict)  # a retry's earliest time
    assembling: futures.Future | None = None
    result: Result | None = None  # made, not yet recorded (the store failed)
    stopped: bool = False  # dropped: finished, failed, cancelled or lost; draining its segments
    discard: bool = False  # remove its files once drained

    @property
    def id(self) -> str:
        return self.job.id

    def next_index(self, now: float) -> int | None:
        for index in self.pending:
            if self.not_before.get(index, 0.0) <= now:
                return index
        return None

    def busy(self) -> bool:
        return bool(self.inflight) or (self.assembling is not None and not self.assembling.done())


class Runner:
    """Makes the jobs of ``store``: ``send(params, text, seed) -> wav bytes`` per segment
    (raising :class:`SegmentError`), ``results`` for the files. ``worker`` names this
    runner in leases (its host and pid); ``clock`` is the leases' and retries' time,
    ``monotonic`` the close's deadline and the store warnings'; ``sleep`` waits while no
    segment is out (the process passes its stop event's ``wait``: a stop ends it early);
    ``share``, the segments that may be out now (:class:`cosyvoice_lb.jobs.yielding.Yielding`,
    which reads the routing board), is asked once a round."""

    def __init__(
        self,
        store: JobStore,
        send: Send,
        results: Results,
        *,
        worker: str,
        slots: int,
        segment_chars: int,
        lease: float = 30.0,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], object] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
        retries: int = RETRIES,
        backoff: float = BACKOFF,
        max_backoff: float = MAX_BACKOFF,
        share: Callable[[], int] | None = None,
    ) -> None:
        model.check_worker(worker, lease)
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots: segments out at once, at least 1, not {slots!r}")
        segments_of("x", segment_chars)  # (checks it)
        self.store, self.send, self.results = store, send, results
        self.worker, self.slots, self.segment_chars, self.lease = worker, slots, segment_chars, lease
        self.clock, self.sleep, self.monotonic = clock, sleep, monotonic
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.share = share
        self.allowed = self.out = 0  # the segments that may be out, and are, at the last round (for metrics)
        self.active: dict[str, Active] = {}  # in the order claimed
        self.closed = self.closing = False
        self._store_warned = -STORE_LOG_EVERY
        self._pool = futures.ThreadPoolExecutor(max_workers=slots, thread_name_prefix="job-segment")
        self._joiner = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="job-result")

    # --- the loop ------------------------------------------------------------------------

    def step(self) -> bool:
        """One round: tend every job held (segments back, leases, results), claim a job if a
        slot would stay free, send segments into the free slots. Whether jobs are held."""
        if self.closed:
            return False
        for active in list(self.active.values()):
            self._guarded(active, self._tend)
        self._claim()
        self._submit()
        return bool(self.active)

    def run(self, stop: threading.Event) -> None:
        """Rounds until ``stop`` is set, then :meth:`close`."""
        try:
            while not stop.is_set():
                busy = self.step()
                self.wait(POLL if busy else IDLE)
        finally:
            self.close()

    def wait(self, seconds: float) -> None:
        """Until a segment or result comes back, at most ``seconds`` (``sleep`` while none is out)."""
        out = [f for a in self.active.values() for f in a.inflight.values()]
        out += [a.assembling for a in self.active.values() if a.assembling is not None]
        if out:
            futures.wait(out, timeout=seconds, return_when=futures.FIRST_COMPLETED)
        else:
            self.sleep(seconds)

    @property
    def in_flight(self) -> int:
        return sum(len(a.inflight) for a in self.active.values())

    def close(self, drain: float = DRAIN) -> None:
        """Stop: let the segments out come back for up to ``drain`` seconds (kept and recorded),
        then leave every job held with a lease that has run out, so the next runner (this
        one restarted, or another) takes it over at once."""
        if self.closed:
            return
        deadline = self.monotonic() + drain
        self.closing = True
        for active in self.active.values():
            active.pending.clear()
        while self.in_flight and self.monotonic() < deadline:
            self.wait(POLL)
            for active in list(self.active.values()):
                self._guarded(active, self._tend)
        self.closed = True
        for active in self.active.values():
            if not active.stopped:
                self._store_call(self.store.renew, active.id, self.worker, RELEASE, self.clock())
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._joiner.shutdown(wait=False, cancel_futures=True)

    # --- a job's round -------------------------------------------------------------------

    def _tend(self, active: Active) -> None:
        now = self.clock()
        self._harvest(active, now)
        self._record(active, now)
        if active.stopped:
            if not active.busy():
                self._drop(active)
            return
        if now - active.renewed >= self.lease / 3:
            self._renew(active, now)
        if active.stopped:
            return
        if active.result is not None:
            self._succeed(active, active.result)
        elif active.assembling is not None:
            if active.assembling.done():
                self._finish(active, active.assembling)
        elif self._complete(active) and not self.closing:
            fmt = str(active.job.params.get("response_format") or "wav")
            active.assembling = self._joiner.submit(self.results.assemble, active.id, len(active.segments), fmt)

    def _harvest(self, active: Active, now: float) -> None:
        for index in sorted(active.inflight):
            future = active.inflight[index]
            if not future.done():
                continue
            del active.inflight[index]
            if active.stopped or future.cancelled():
                continue
            try:
                wav = future.result()
            except SegmentError as exc:
                self._failed_try(active, index, exc, now)
                continue
            except Exception as exc:  # (a bug in the sender: the job fails, the runner goes on)
                log.exception("job %s: segment %d could not be sent", active.id, index + 1)
                self._fail(active, self._where(active, index) + f" failed: {exc}")
                continue
            self.results.write_segment(active.id, index, wav)
            active.written.add(index)

    def _record(self, active: Active, now: float) -> None:
        """Tell the store of the segments on disk (a store that failed is told again later)."""
        for index in sorted(active.written):
            if active.stopped:
                return
            try:
                job = self.store.segment_done(active.id, index, now)
            except StoreError as exc:
                if exc.kind == StoreFailure.FULL:
                    raise
                self._store_trouble(exc)
                return
            active.written.discard(index)
            if job is None or job.status != model.RUNNING:
                log.info("job %s: %s, its remaining segments are not made", active.id, job.status if job else "gone")
                self._stop(active, discard=True)
                return
            active.job = job
            active.done.add(index)

    def _failed_try(self, active: Active, index: int, exc: SegmentError, now: float) -> None:
        tries = active.tries[index] = active.tries.get(index, 0) + 1
        if not exc.retryable or tries > self.retries:
            after = f" after {tries} tries" if exc.retryable else ""
            self._fail(active, f"{self._where(active, index)} failed{after}: {exc}")
            return
        delay = min(self.max_backoff, self.backoff * 2 ** (tries - 1))
        if exc.retry_after is not None:
            delay = max(delay, min(exc.retry_after, self.max_backoff))
        active.not_before[index] = now + delay
        bisect.insort(active.pending, index)
        log.info("job %s: segment %d: %s; again in %.1f s (try %d)", active.id, index + 1, exc, delay, tries + 1)

    def _where(self, active: Active, index: int) -> str:
        return f"segment {index + 1} of {len(active.segments)} (it begins {opening(active.segments[index])})"

    def _renew(self, active: Active, now: float) -> None:
        try:
            job = self.store.renew(active.id, self.worker, self.lease, now)
        except StoreError as exc:
            self._store_trouble(exc)
            return
        if job is not None:
            active.renewed = now
            return
        current = self.store.get(active.id, active.job.owner)
        cancelled = current is None or current.status == model.CANCELLED
        why = "cancelled" if cancelled else "taken over by another runner"
        log.info("job %s: %s; this runner stops making it", active.id, why)
        self._stop(active, discard=cancelled)

    @staticmethod
    def _complete(active: Active) -> bool:
        return len(active.done) == len(active.segments) and not active.inflight and not active.written

    def _finish(self, active: Active, assembled: futures.Future) -> None:
        active.assembling = None
        try:
            result = assembled.result()
        except (ResultsError, ValueError) as exc:
            self._fail(active, str(exc))
            return
        self._succeed(active, result)

    def _succeed(self, active: Active, result: Result) -> None:
        active.result = result  # (kept: a store that fails now is told again, the audio is not made again)
        job = self.store.finish(active.id, self.worker, model.SUCCEEDED, self.clock(), result=result)
        active.result = None
        if job is None:
            current = self.store.get(active.id, active.job.owner)
            self._stop(active, discard=current is None or current.status == model.CANCELLED)
            return
        log.info("job %s succeeded: %d segments, %d bytes", active.id, len(active.segments), result.bytes)
        self.results.drop_segments(active.id)
        self._stop(active, discard=False)

    def _fail(self, active: Active, reason: str) -> None:
        if active.stopped:
            return
        self._stop(active, discard=True)
        log.warning("job %s failed: %s", active.id, reason)
        self._store_call(self.store.finish, active.id, self.worker, model.FAILED, self.clock(), error=reason)

    def _stop(self, active: Active, discard: bool) -> None:
        active.stopped, active.discard = True, discard
        active.pending.clear()
        for future in active.inflight.values():
            future.cancel()

    def _drop(self, active: Active) -> None:
        del self.active[active.id]
        if active.discard:
            self.results.remove(active.id)

    # --- claiming and sending ------------------------------------------------------------

    def _claim(self) -> None:
        held = [a for a in self.active.values() if not a.stopped and a.assembling is None]
        joining = sum(1 for a in self.active.values() if a.assembling is not None)
        if len(held) >= self.slots or self.in_flight >= self.slots or joining >= self.slots:
            return  # (results wait their turn to be joined: no more jobs claimed than that queue drains)
        now = self.clock()
        if any(a.next_index(now) is not None for a in held):
            return  # (the jobs held fill the free slots first)
        job = self._store_call(self.store.claim_next, self.worker, self.lease, now)
        if job is None:
            return
        held_already = self.active.get(job.id)
        if held_already is not None:  # (our own lease ran out while we held it: ours again)
            if held_already.stopped:  # (but we are dropping it: the next claim, once dropped)
                self._store_call(self.store.renew, job.id, self.worker, RELEASE, now)
            else:
                held_already.job, held_already.renewed = job, now
            return
        active = Active(job=job, segments=[], seed=seed_of(job), renewed=now)
        self.active[job.id] = active
        self._guarded(active, self._start)

    def _start(self, active: Active) -> None:
        job = active.job
        text = self.store.text(job.id)
        if text is None:  # (removed since it was claimed)
            self._stop(active, discard=True)
            return
        planned = self.results.plan(job.id)
        chars = planned or self.segment_chars
        active.segments = segments_of(text, chars)
        if len(active.segments) != job.segments_total:
            self._fail(
                active,
                f"its text splits into {len(active.segments)} segments of up to {chars} characters, not the "
                f"{job.segments_total} it was sent with: send it again",
            )
            return
        if planned is None:
            self.results.write_plan(job.id, chars, len(active.segments))
        recorded = self.store.done_segments(job.id)
        active.done = {i for i in recorded if i < len(active.segments) and self.results.has_segment(job.id, i)}
        active.pending = [i for i in range(len(active.segments)) if i not in active.done]
        log.info(
            "job %s: %d segments, %d done before (try %d)", job.id, len(active.segments), len(active.done), job.attempts
        )

    def _submit(self) -> None:
        allowed = self.slots if self.share is None else max(0, min(self.slots, self.share()))
        free = allowed - self.in_flight
        now = self.clock()
        for active in list(self.active.values()):
            while free > 0 and not active.stopped and active.assembling is None:
                index = active.next_index(now)
                if index is None:
                    break
                active.pending.remove(index)
                text = active.segments[index]
                active.inflight[index] = self._pool.submit(self.send, active.job.params, text, active.seed)
                free -= 1
        self.allowed, self.out = allowed, self.in_flight

    # --- failures ------------------------------------------------------------------------

    def _guarded(self, active: Active, work: Callable[[Active], None]) -> None:
        """``work`` on one job: what goes wrong with it fails that job, never the runner."""
        try:
            work(active)
        except ResultsError as exc:
            self._fail(active, str(exc))
        except StoreError as exc:
            if exc.kind == StoreFailure.FULL:
                self._fail(active, f"{DISK_FULL}: {exc}")
            else:
                self._store_trouble(exc)
        except Exception as exc:
            log.exception("job %s: unexpected failure", active.id)
            self._fail(active, f"the job could not be made ({type(exc).__name__}: {exc})")

    def _store_call(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except StoreError as exc:
            self._store_trouble(exc)
            return None

    def _store_trouble(self, exc: StoreError) -> None:
        """A store that fails (unreachable, locked): the work waits; said every so often."""
        now = self.monotonic()
        if now - self._store_warned >= STORE_LOG_EVERY:
            self._store_warned = now
            log.warning("the job store failed (%s); jobs wait until it answers again", exc)
