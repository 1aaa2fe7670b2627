"""Routing by work: whether an instance takes a request, or declines it because another
instance would start it sooner.

nginx balances ``/v1/`` by least connections, which counts requests, not their cost: a
short text can land behind a long one while another instance is nearly idle. Each
instance knows the cost of what it holds (the texts' lengths, times its own measured
seconds per character) and, through the routing board (``board``), what the others hold.
An instance whose queue would make the request wait longer than another's by more than
``slack`` declines it with a fast 503; nginx then tries an instance it has not tried yet
(least connections again). A request every instance declines, or one that reaches its
last try, is served: nginx's last resort (a ``backup`` server) sends it once more, marked
so that it is never declined.

Pure: the clock and what the other instances published are passed in. The instance's
glue (publishing its load, reading the board) is :class:`Router`.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

DEFAULT_SLACK = 0.05  # seconds: a decline must gain the request more than this
RATE_WEIGHT = 0.2  # of the newest synthesis in the moving average of seconds per character
LAST_HEADER = "X-Cvlb-Route"  # "last": nginx's last resort, never declined


@dataclass(frozen=True)
class Backlog:
    """What an instance has queued, as it publishes it: ``until`` is when its queued work
    is expected to end (monotonic clock, shared by the processes of a box), ``busy`` whether
    a synthesis is in flight."""

    until: float = 0.0
    busy: bool = False

    def wait(self, now: float) -> float:
        """Seconds a request arriving now would wait. Past the expected end with a synthesis
        still running, the synthesis has overrun its estimate: the longer it overruns, the
        longer it is expected to go on (a hung one never looks free)."""
        if self.until >= now:
            return self.until - now
        return now - self.until if self.busy else 0.0


@dataclass(frozen=True)
class Peer:
    """Another instance in rotation, ready, alive; ``declined``: it declined this request
    already (nginx never tries it again for this request)."""

    slot: int
    load: Backlog
    declined: bool = False


@dataclass(frozen=True)
class Decision:
    decline: bool
    wait: float  # seconds this request would wait here
    better: int | None = None  # the slot that would start it sooner
    better_wait: float = 0.0

    def message(self) -> str:
        return (
            f"declined: this instance's queue would hold the request {self.wait:.2f}s, instance slot {self.better} "
            f"would start it in {self.better_wait:.2f}s; nginx tries another instance"
        )


def decide(
    own: Backlog, peers: Iterable[Peer], now: float, slack: float = DEFAULT_SLACK, last: bool = False
) -> Decision:
    """Take the request, or decline it for a peer nginx may still try that would start it
    more than ``slack`` seconds sooner. ``last``: nginx's last resort, always taken."""
    wait = own.wait(now)
    if last or wait <= slack:
        return Decision(False, wait)
    untried = [(peer.load.wait(now), peer.slot) for peer in peers if not peer.declined]
    if not untried:
        return Decision(False, wait)
    best_wait, best = min(untried)
    if best_wait + slack < wait:
        return Decision(True, wait, best, best_wait)
    return Decision(False, wait)


def request_key(request_id: str) -> int:
    """A request's id (nginx's, the same on every try) as the 8 bytes the board keeps; never 0."""
    key = int.from_bytes(hashlib.blake2b(request_id.encode("utf-8", "replace"), digest_size=8).digest(), "little")
    return key or 1


def queue_load(now: float, inflight: Sequence[tuple[float, float]], queued: float, concurrency: int) -> Backlog:
    """The load of ``inflight`` syntheses ((start, estimated seconds) each) and ``queued``
    seconds of waiting work on ``concurrency`` engine slots. An overrun synthesis counts
    negative, which moves ``until`` into the past (see :meth:`Backlog.wait`)."""
    left = sum(cost - (now - start) for start, cost in inflight) + queued
    return Backlog(now + left / max(1, concurrency), bool(inflight))


class Rate:
    """Seconds per character, learned from this instance's own syntheses: a moving average
    of seconds over a moving average of characters (so a long text weighs by its length).
    None until the first synthesis (the warm-up) ends."""

    def __init__(self, weight: float = RATE_WEIGHT):
        self.weight = weight
        self._chars = 0.0
        self._seconds = 0.0
        self._lock = threading.Lock()

    def observe(self, chars: int, seconds: float) -> None:
        if chars <= 0 or seconds < 0:
            return
        with self._lock:
            if self._chars == 0:
                self._chars, self._seconds = float(chars), seconds
            else:
                w = self.weight
                self._chars = (1 - w) * self._chars + w * chars
                self._seconds = (1 - w) * self._seconds + w * seconds

    @property
    def per_char(self) -> float | None:
        with self._lock:
            return self._seconds / self._chars if self._chars else None

    def estimate(self, chars: int) -> float:
        """The seconds a text of ``chars`` characters is expected to take here (0: not known yet)."""
        per_char = self.per_char
        return per_char * max(0, chars) if per_char is not None else 0.0


class Board(Protocol):
    """What :class:`Router` needs of the routing board (``board.Board``)."""

    def work(self) -> tuple[bool, float]: ...
    def publish(self, slot: int, pid: int, ready: bool, load: Backlog, per_char: float) -> None: ...
    def peers(self, slot: int, key: int) -> list[Peer]: ...
    def mark_declined(self, slot: int, key: int) -> None: ...


class Router:
    """One instance's side: publishes its load whenever it changes, and decides per
    request. Without a board (none given, or not there yet) it never declines.

    ``load``: the instance's load now (its admission's); ``ready``: whether it takes work.
    """

    def __init__(
        self,
        slot: int,
        pid: int,
        load: Callable[[], Backlog],
        ready: Callable[[], bool],
        rate: Rate,
        clock: Callable[[], float],
        board: Callable[[], Board | None],
    ):
        self.slot, self.pid = slot, pid
        self.load, self.ready, self.rate, self.clock = load, ready, rate, clock
        self.board = board
        self.declined = 0  # requests this instance declined
        self.last_resort = 0  # requests it took as nginx's last resort
        self._lock = threading.Lock()

    def publish(self) -> None:
        board = self.board()
        if board is not None:
            board.publish(self.slot, self.pid, self.ready(), self.load(), self.rate.per_char or 0.0)

    def check(self, request_id: str, last: bool) -> Decision:
        """Whether to take this request (``request_id``: nginx's; ``last``: its last resort)."""
        board = self.board()
        now = self.clock()
        if last:
            with self._lock:
                self.last_resort += 1
        work, slack = board.work() if board is not None else (False, 0.0)
        if board is None or not work or not request_id:
            return Decision(False, self.load().wait(now))
        key = request_key(request_id)
        decision = decide(self.load(), board.peers(self.slot, key), now, slack, last)
        if decision.decline:
            board.mark_declined(self.slot, key)
            with self._lock:
                self.declined += 1
        return decision
