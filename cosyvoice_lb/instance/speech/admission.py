"""Admission to the engine: whether, when and for how long a request may use it.

One object per instance owns everything that decides it, under one lock: the instance's
phase (only a ready instance takes work; a draining one never turns ready again), the
engine slots (``--instance-concurrency``), the bounded queue in front of them
(``--max-queue``), deadlines, the progress clock of each synthesis in flight (what
``/ping``'s ``stalled_seconds`` reports and the health loop judges hangs by), and the
served/failed counters behind ``--max-requests``.

Interactive work first. A request marked background (:data:`BACKGROUND_HEADER`: a long-form
job's segment) never takes a slot while an interactive request waits: a free slot goes to
the oldest interactive waiter, and to the oldest background one only when none waits. A
background request does not count toward ``--max-queue`` (it never makes an interactive one
refused), nor in the backlog routing weighs (it starts only when nobody interactive waits).
It waits at most ``background_wait`` seconds (and half the request's time left, so that its
synthesis still fits), behind at most ``background_queue`` others, else it is refused with
:class:`Overloaded` (503, Retry-After): nginx tries another instance, then the job runner
retries later. A slot a background synthesis holds is not taken back; the job runner
sends fewer segments the moment interactive requests come (``--job-slots``): ``load`` counts
the interactive requests taken here and those in flight or waiting, published on the
routing board for it (``cosyvoice_lb.jobs.yielding``).

Standard library only (the instance runs in the model's environment); the clock is passed
in, so every rule is tested without sleeping.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from cosyvoice_lb.common.timeouts import STAMP_AHEAD, STAMP_SLACK
from cosyvoice_lb.instance.routing.rule import RESERVATION_SECONDS, Backlog, queue_load
from cosyvoice_lb.instance.speech.waiting_line import Line, Waiter

Clock = Callable[[], float]

# A request that asks to be served after interactive ones ("1"). It is trusted as a lowering
# of its own priority only: it grants nothing (anyone may ask to wait longer), so no secret
# proves it and nginx passes it through from any client.
BACKGROUND_HEADER = "X-Cvlb-Background"
BACKGROUND_WAIT = 30.0  # seconds a background request waits for a slot at most, then 503


class Phase(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"
    BAD_AUDIO = "bad-audio"  # its warm-up or a canary made bad audio: out until restarted


NOT_READY = {
    Phase.LOADING: "this instance is still loading its model: retry shortly",
    Phase.DRAINING: "this instance is shutting down: retry (another instance will answer)",
    Phase.FAILED: "this instance failed to load its model: see its log",
    Phase.BAD_AUDIO: "this instance makes bad audio and waits to be restarted: retry (another instance will answer)",
    Phase.READY: "this instance is not ready: retry shortly",
}


class NotReady(RuntimeError):
    """Loading, draining, failed or making bad audio: answered 503, so nginx tries another
    instance."""


class Overloaded(RuntimeError):
    """Every engine slot is busy and the queue is full: answered 503 at once, so nginx
    tries another instance instead of the client waiting here."""


class TimedOut(RuntimeError):
    """The request's time (--request-timeout, counted from its arrival at nginx, retries
    included) ran out: answered 504 with this message."""


class Cancelled(RuntimeError):
    """The client went away: the synthesis stops at its next chunk and frees its slot."""


@dataclass(frozen=True)
class Snapshot:
    """What ``/ping`` reports of admission."""

    phase: Phase
    inflight: int
    waiting: int
    busy_seconds: float  # the longest-running synthesis
    stalled_seconds: tuple[float, ...]  # per synthesis, seconds since its last chunk, longest first
    served: int
    failed: int
    error: str
    sessions: int = 0  # of ``inflight``: streaming sessions (a drain closes them at their sentence's end)

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    @property
    def idle(self) -> bool:
        return self.inflight == 0 and self.waiting == 0


def deadline_for(request_timeout: float, stamp: str | None, wall: float, mono: float) -> float | None:
    """The monotonic time by which a request must be answered (None: no bound).

    nginx stamps ``X-Request-Start`` (epoch seconds) once per client request, so a retry on
    another instance keeps the time already spent; without a plausible stamp the bound
    counts from now (``wall``/``mono``: the two clocks read at the same moment).
    """
    if not request_timeout:
        return None
    started = wall
    try:
        stamped = float(stamp or "")
        if wall - request_timeout - STAMP_SLACK < stamped <= wall + STAMP_AHEAD:
            started = min(stamped, wall)
    except ValueError:
        pass
    return mono + (started + request_timeout - wall)


def is_background(headers: Any) -> bool:
    """Whether a request's headers (lower-case keys, or any case) mark it background work."""
    value = headers.get(BACKGROUND_HEADER.lower()) or headers.get(BACKGROUND_HEADER) or ""
    return str(value).strip() == "1"


class Ticket:
    """One synthesis holding an engine slot. The engine's side calls :meth:`working` when it
    resumes and :meth:`handed_out` when a chunk leaves for the reader (a slow reader is not
    a hang); :meth:`release` exactly once at the end."""

    def __init__(self, admission: Admission, key: str):
        self._admission, self._key = admission, key
        self._released = False

    def working(self) -> None:
        self._admission._mark(self._key, self._admission.clock())

    def handed_out(self) -> None:
        self._admission._mark(self._key, math.inf)

    def release(self, outcome: bool | None) -> None:
        """Free the slot; ``outcome`` True counts a served request, False a failed one,
        None neither (warm-up, a client that went away)."""
        if self._released:
            return
        self._released = True
        self._admission._release(self._key, outcome)


class Lease(Ticket):
    """An engine slot held for a whole streaming session (text in, audio out): its syntheses
    run on it one after another (:meth:`Admission.admit` with ``lease``) and never queue.
    While the session waits for its client's text (:meth:`waiting`) it is not stalled: a
    client thinking is not a hang. :meth:`release` (once, at the session's end) frees it."""

    def __init__(self, admission: Admission, key: str):
        super().__init__(admission, key)
        self.idle = False

    def waiting(self, idle: bool) -> None:
        """The session waits for its client's text (True) or has text to speak (False)."""
        self.idle = idle
        self._admission._mark(self._key, math.inf if idle else self._admission.clock())

    def synthesis(self) -> Ticket:
        return _OnLease(self)

    def release(self, outcome: bool | None) -> None:
        self._admission._sessions.discard(self._key)
        super().release(outcome)


class _OnLease(Ticket):
    """One synthesis of a session, on its lease: counted at its end; the slot stays the session's."""

    def __init__(self, lease: Lease):
        super().__init__(lease._admission, lease._key)
        self._lease = lease

    def working(self) -> None:
        if not self._lease.idle:
            super().working()

    def release(self, outcome: bool | None) -> None:
        if self._released:
            return
        self._released = True
        self._admission._count(self._key, outcome)


class Admission:
    """``on_change`` is called (outside the lock) whenever the work held here or the phase
    changed: the router publishes the instance's load then (see ``routing``)."""

    def __init__(
        self,
        concurrency: int = 1,
        max_queue: int | None = None,
        clock: Clock = time.monotonic,
        background_wait: float = BACKGROUND_WAIT,
        background_queue: int | None = None,
        on_change: Callable[[], None] = lambda: None,
    ):
        self.concurrency = max(1, concurrency)
        self.max_queue = max_queue  # interactive requests allowed to wait when bounded; None: no bound
        self.clock = clock
        self.background_wait = max(0.0, background_wait)
        # background requests allowed to wait (default: one per engine slot)
        self.background_queue = self.concurrency if background_queue is None else max(0, background_queue)
        self.on_change = on_change
        self._lock = threading.Lock()
        self._free = self.concurrency  # engine slots nobody holds (while any is free, nobody waits)
        # key -> [start, last chunk (inf: with the reader), estimated seconds]
        self._inflight: dict[str, list[float]] = {}
        self._line = Line()  # the requests waiting for a slot
        self._reserved: list[tuple[float, float]] = []  # (until, seconds): taken, not queued yet
        self._served = 0
        self._failed = 0
        self._phase = Phase.LOADING
        self._error = ""
        self._sessions: set[str] = set()  # the slots streaming sessions hold (see Lease)
        self._background: set[str] = set()  # the slots background syntheses hold
        self._interactive = 0  # interactive requests taken, ever (what long-form jobs yield to)

    # --- the instance's phase ------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._phase

    def become_ready(self) -> bool:
        """Loaded and warmed up: ready, unless a drain or a failure came first (then it
        stays out, and False says so)."""
        with self._lock:
            if self._phase is not Phase.LOADING:
                return False
            self._phase = Phase.READY
        self._changed()
        return True

    def drain(self) -> bool:
        """Stop taking work for good; False when it was draining already."""
        with self._lock:
            first = self._phase is not Phase.DRAINING
            self._phase = Phase.DRAINING
        self._changed()
        return first

    def bad_audio(self, error: str) -> bool:
        """Its warm-up or a canary made bad audio: out (``/ping`` says ``bad-audio`` with the
        reason) until the health loop restarts it. False when it was draining or failed
        already (it stays so)."""
        with self._lock:
            if self._phase in (Phase.DRAINING, Phase.FAILED):
                return False
            self._phase, self._error = Phase.BAD_AUDIO, error
        self._changed()
        return True

    def fail(self, error: str) -> None:
        with self._lock:
            self._phase, self._error = Phase.FAILED, error
        self._changed()

    def _changed(self) -> None:
        """Tell ``on_change`` (routing's publisher): whatever it raises, admission goes on."""
        try:
            self.on_change()
        except Exception:  # noqa: BLE001  (a slot must never leak for a board that broke)
            pass

    def reserve(self, seconds: float) -> None:
        """A request was taken and will queue shortly (its body is still being read): count
        it as ``seconds`` of work until it does, for at most RESERVATION_SECONDS."""
        with self._lock:
            self._reserved.append((self.clock() + RESERVATION_SECONDS, seconds))
        self._changed()

    def check_ready(self) -> None:
        phase = self._phase
        if phase is not Phase.READY:
            raise NotReady(NOT_READY[phase])

    # --- slots, queue, deadlines ---------------------------------------------------------

    def admit(
        self,
        *,
        bounded: bool = False,
        deadline: float | None = None,
        cost: float = 0.0,
        background: bool = False,
        lease: Lease | None = None,
    ) -> Ticket:
        """Wait for an engine slot. ``bounded``: refuse with :class:`Overloaded` when the
        slots and the queue are full (the API; the UI and the warm-up wait their turn).
        ``deadline`` (on this clock): no slot by then raises :class:`TimedOut`. ``cost``:
        the synthesis' estimated seconds (what it adds to this instance's load).
        ``background``: served after every interactive waiter, refused rather than kept
        waiting long (see the module's docstring). ``lease``: a session's slot, held
        already (see :meth:`lease`): the synthesis runs on it at once."""
        if lease is not None:
            return lease.synthesis()
        waiter = Waiter(cost, background)
        with self._lock:
            self._interactive += not background  # (a refused one too: jobs yield to it all the same)
            self._refuse(waiter, bounded)
            if self._free:  # (a free slot: nobody waits)
                self._take(waiter)
            else:
                self._line.join(waiter)
            if self._reserved:
                self._reserved.pop(0)  # (the oldest reservation: this request's, or one like it)
        self._changed()
        if not waiter.granted:
            self._wait(waiter, deadline)
        return Ticket(self, waiter.key)

    def lease(self, cost: float = 0.0) -> Lease:
        """A slot for a streaming session, now or never: :class:`NotReady` when the instance
        does not take work, :class:`Overloaded` (503: nginx tries another instance) when no
        slot is free or anyone waits for one. A session never queues: its client is a live
        conversation, and another instance may have a slot free."""
        waiter = Waiter(cost)
        with self._lock:
            if self._phase is not Phase.READY:
                raise NotReady(NOT_READY[self._phase])
            if not self._free or self._line:
                raise Overloaded(
                    f"this instance has no engine slot free for a streaming session ({len(self._inflight)} "
                    f"synthesizing, {len(self._line)} waiting): retry, another instance may be free"
                )
            self._take(waiter)
            self._interactive += 1
            self._inflight[waiter.key][1] = math.inf  # (its client's text comes first)
            self._sessions.add(waiter.key)
        self._changed()
        lease = Lease(self, waiter.key)
        lease.idle = True
        return lease

    def _refuse(self, waiter: Waiter, bounded: bool) -> None:
        """Raise :class:`Overloaded` when ``waiter`` may not even wait (under the lock)."""
        if waiter.background:
            if not self._free and len(self._line.background) >= self.background_queue:
                raise Overloaded(
                    f"this instance is busy ({len(self._inflight)} synthesizing, {len(self._line)} waiting, "
                    f"{len(self._line.background)} of them background work): retry later"
                )
            return
        waiting = len(self._line.interactive)
        if (
            bounded
            and self.max_queue is not None
            and len(self._inflight) + waiting >= self.concurrency + self.max_queue
        ):
            raise Overloaded(
                f"this instance is busy ({len(self._inflight)} synthesizing, "
                f"{waiting} waiting): retry, another instance may be free"
            )

    def _take(self, waiter: Waiter) -> None:
        """``waiter`` gets a free slot (under the lock)."""
        self._free -= 1
        now = self.clock()
        self._inflight[waiter.key] = [now, now, waiter.cost]  # busy time counts from here, not from the queue
        if waiter.background:
            self._background.add(waiter.key)
        waiter.granted = True
        waiter.event.set()

    def _wait(self, waiter: Waiter, deadline: float | None) -> None:
        """Until ``waiter`` is granted a slot, or its time to wait is up: then it leaves the
        line with :class:`TimedOut` (interactive) or :class:`Overloaded` (background)."""
        left = None if deadline is None else max(0.0, deadline - self.clock())
        patience = left
        if waiter.background:  # (its synthesis must still fit in the time left)
            patience = self.background_wait if left is None else min(self.background_wait, left / 2)
        try:
            waiter.event.wait(patience)
        finally:
            with self._lock:
                gave_up = not waiter.granted
                if gave_up:
                    self._line.leave(waiter)
            self._changed()
        if not gave_up:
            return
        if waiter.background:
            raise Overloaded(
                f"interactive requests go first here: this background request found no free engine slot "
                f"within {patience:.0f}s; retry later"
            )
        raise TimedOut(
            f"no engine slot came free within the request timeout ({left:.0f}s left "
            "when it arrived here): the cluster is overloaded, retry later"
        )

    def _mark(self, key: str, last: float) -> None:
        with self._lock:
            if key in self._inflight:
                self._inflight[key][1] = last

    def _count(self, key: str, outcome: bool | None) -> None:
        """A session's synthesis ended on its lease: counted, the slot kept, not stalled."""
        with self._lock:
            self._served, self._failed = self._served + (outcome is True), self._failed + (outcome is False)
            if key in self._inflight:
                self._inflight[key][1] = math.inf

    def _release(self, key: str, outcome: bool | None) -> None:
        with self._lock:
            self._inflight.pop(key, None)
            self._background.discard(key)
            if outcome is True:
                self._served += 1
            elif outcome is False:
                self._failed += 1
            self._free += 1
            while self._free:  # the slot goes to the next in line (interactive first)
                waiter = self._line.next()
                if waiter is None:
                    break
                self._take(waiter)
        self._changed()

    def load(self) -> Backlog:
        """The work held here now, for routing (see ``routing.queue_load``): in flight,
        waiting (interactive), and taken but not yet queued; with the interactive requests
        taken so far and those in flight or waiting now."""
        with self._lock:
            now = self.clock()
            self._reserved = [r for r in self._reserved if r[0] > now]
            inflight = [(start, cost) for start, _, cost in self._inflight.values()]
            # (background waiters start only when nobody interactive waits: they delay no one)
            queued = self._line.costs() + [seconds for _, seconds in self._reserved]
            asking = len(self._inflight) - len(self._background) + len(self._line.interactive)
            backlog = queue_load(now, inflight, queued, self.concurrency)
            return replace(backlog, interactive=self._interactive, asking=asking)

    def snapshot(self) -> Snapshot:
        now = self.clock()
        with self._lock:
            busy = max((now - start for start, _, _ in self._inflight.values()), default=0.0)
            # (last is +inf while a chunk waits for its reader: a slow reader is not a hang)
            stalled = sorted((round(max(0.0, now - last), 3) for _, last, _ in self._inflight.values()), reverse=True)
            return Snapshot(
                self._phase,
                len(self._inflight),
                len(self._line),
                round(busy, 3),
                tuple(stalled),
                self._served,
                self._failed,
                self._error,
                len(self._sessions),
            )
