"""Jobs that yield: how many segments of jobs may be out at once now (``--job-slots auto``).

A segment holds an engine slot while it is made, and a synthesis that runs is not
interrupted: an interactive request that comes meanwhile waits for it, or crowds onto the
instances left free. So jobs take every serving synthesis slot while no interactive request
comes, and fall to a small share the moment one does:

- an interactive request taken by any instance since the last look, or one in flight or
  waiting now: the share falls to ``floor`` at once. Segments already out are not called
  back (nothing is lost or made twice): the runner sends no more until fewer are out.
- no interactive request for ``quiet`` seconds: the share grows again, doubling every
  ``step`` seconds, up to ``ceiling``.

What the instances take is read from the routing board, where each publishes its
interactive requests (``Admission.load``); without a board (none yet, or unreadable) the
share is ``fallback``, a fixed share that keeps one instance's worth free.

:class:`Share` is the rule (pure: the time and what the board said are passed in);
:class:`BoardDemand` reads the board and :class:`Yielding` joins the two for the runner.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cosyvoice_lb.instance.routing.board import Opener
from cosyvoice_lb.instance.routing.router import BOARD_ERRORS

QUIET = 1.0  # seconds without an interactive request before jobs take more slots again
STEP = 0.25  # seconds between two doublings of the jobs' share while it stays quiet


@dataclass(frozen=True)
class Demand:
    """Interactive requests, summed over the instances: ``taken`` since each started (it
    changes whenever one comes) and ``asking``, in flight or waiting now."""

    taken: int
    asking: int


class Share:
    """The segments jobs may have out at once: see the module's docstring."""

    def __init__(self, floor: int, ceiling: int, fallback: int, quiet: float = QUIET, step: float = STEP) -> None:
        if not 1 <= floor <= ceiling:
            raise ValueError(f"the jobs' share: 1 <= floor <= ceiling, not {floor} and {ceiling}")
        if quiet < 0 or step < 0:
            raise ValueError(f"quiet and step: seconds, not {quiet} and {step}")
        self.floor, self.ceiling = floor, ceiling
        self.fallback = min(max(fallback, floor), ceiling)
        self.quiet, self.step = quiet, step
        self.limit = floor  # (until the board says the cluster is quiet)
        self.taken: int | None = None  # the sum seen last (None: nothing seen yet)
        self.last_busy = -math.inf  # when an interactive request was seen last
        self.last_change = -math.inf  # when the share changed last
        self.yields = 0  # times the share fell to the floor

    def update(self, now: float, demand: Demand | None) -> int:
        """The share at ``now``, given what the board says (None: no board)."""
        if demand is None:
            self.taken = None
            self.limit = self.fallback
            return self.limit
        came = self.taken is not None and demand.taken != self.taken
        self.taken = demand.taken
        if came or demand.asking > 0:
            self.last_busy = now
            if self.limit != self.floor:
                self.limit, self.last_change = self.floor, now
                self.yields += 1
        elif self.limit < self.ceiling and now - self.last_busy >= self.quiet and now - self.last_change >= self.step:
            self.limit, self.last_change = min(self.ceiling, self.limit * 2), now
        return self.limit


def share_for(total: int, one: int) -> Share:
    """The share of ``--job-slots auto`` on ``total`` serving synthesis slots, ``one`` an
    instance's: a quarter of them (at least 1) while interactive requests come, all of them
    while none does, all but one instance's worth while the board cannot be read."""
    total = max(1, total)
    return Share(max(1, total // 4), total, max(1, total - one))


class BoardDemand:
    """The interactive requests on the routing board at ``path`` (:class:`Demand`), or None
    while there is no board to read."""

    def __init__(self, path: Path | str) -> None:
        self.opener = Opener(str(path))

    def __call__(self) -> Demand | None:
        board = self.opener()
        if board is None:
            return None
        try:
            taken, asking = board.interactive()
        except BOARD_ERRORS:  # (a board replaced under us: the next look opens the new one)
            return None
        return Demand(taken, asking)


class Yielding:
    """The runner's share now: ``share`` over what ``demand`` reads, at ``clock``'s time."""

    def __init__(
        self, share: Share, demand: Callable[[], Demand | None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.share, self.demand, self.clock = share, demand, clock

    def __call__(self) -> int:
        return self.share.update(self.clock(), self.demand())
