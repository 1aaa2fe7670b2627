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
glue (publishing its backlog, reading the board) is ``router.Router``.
"""

from __future__ import annotations

import hashlib
import heapq
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cosyvoice_lb.common.settings import Settings

DEFAULT_SLACK = Settings.route_slack  # seconds: a decline must gain the request more than this
RATE_WEIGHT = 0.2  # of the newest synthesis in the moving average of seconds per character
LAST_HEADER = "X-Cvlb-Route"  # "last": nginx's last resort, never declined
TRY_HEADER = "X-Cvlb-Try"  # nginx's id of one client request, the same on each of its tries
RESERVATION_SECONDS = 1.0  # a request taken but not yet queued counts this long at most


@dataclass(frozen=True)
class Backlog:
    """What an instance has queued, as it publishes it: ``until`` is when an engine slot is
    expected to come free for a request arriving now (monotonic clock, shared by the
    processes of a box), ``busy`` whether every engine slot is taken; ``interactive`` the
    interactive requests the instance has taken since it started and ``asking`` those in
    flight or waiting now (long-form jobs send fewer segments while they come)."""

    until: float = 0.0
    busy: bool = False
    interactive: int = field(default=0, compare=False)  # (not load: what jobs read, not routing)
    asking: int = field(default=0, compare=False)

    def wait(self, now: float) -> float:
        """Seconds a request arriving now would wait. Past the expected time with every slot
        still taken, a synthesis has overrun its estimate: the longer it overruns, the longer
        it is expected to go on (a hung one never looks free)."""
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


def queue_load(
    now: float, inflight: Sequence[tuple[float, float]], queued: Sequence[float], concurrency: int
) -> Backlog:
    """The backlog of ``inflight`` syntheses ((start, estimated seconds) each) and the
    ``queued`` requests' estimated seconds, in order, on ``concurrency`` engine slots: when
    the next slot comes free for one more request. A synthesis past its estimate is expected
    to run as long again as it has overrun (it never frees its slot early in the estimate,
    and never cancels the work queued behind it)."""
    slots = max(1, concurrency)
    free = [abs(cost - (now - start)) for start, cost in inflight]  # seconds until each busy slot frees
    free += [0.0] * max(0, slots - len(free))
    heapq.heapify(free)
    for cost in queued:  # each waiting request takes the slot that frees first
        heapq.heappush(free, heapq.heappop(free) + cost)
    return Backlog(now + free[0], len(inflight) + len(queued) >= slots)


class Rate:
    """Seconds per character, learned from this instance's own syntheses: a moving average
    of seconds over a moving average of characters (so a long text weighs by its length).
    None until the first synthesis (the warm-up) ends."""

    def __init__(self, weight: float = RATE_WEIGHT):
        self.weight = weight
        self.prior: float | None = None  # the peers' rate, used until this engine has its own
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
        """This engine's own measured rate (None before its first synthesis)."""
        with self._lock:
            return self._seconds / self._chars if self._chars else None

    def estimate(self, chars: int) -> float:
        """The seconds a text of ``chars`` characters is expected to take here: by this
        engine's rate, else its peers' (0: neither is known yet)."""
        per_char = self.per_char if self.per_char is not None else self.prior
        return per_char * max(0, chars) if per_char is not None else 0.0

    def typical(self) -> float:
        """A typical synthesis here, in seconds (the moving average): what a request taken
        but not yet read is counted as."""
        with self._lock:
            if self._chars:
                return self._seconds
        return 0.0
