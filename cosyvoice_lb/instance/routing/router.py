"""An instance's side of routing by work (``routing``): it publishes the instance's
backlog on the board whenever it changes, and decides per request whether to take it.

Whatever goes wrong with the board (gone, replaced, unreadable) makes the instance route
as if it had none: it never declines then, and a request is never failed for it.

Instance side: standard library only.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections.abc import Callable
from typing import Protocol

from cosyvoice_lb.instance.routing.rule import Backlog, Decision, Peer, Rate, decide, request_key

log = logging.getLogger("cosyvoice_lb.instance")
BOARD_ERRORS = (OSError, ValueError, TypeError, BufferError, IndexError)  # (what a closed map raises)


class SharedBoard(Protocol):
    """What the router needs of the routing board (``board.Board``)."""

    def work(self) -> tuple[bool, float]: ...
    def publish(self, slot: int, pid: int, ready: bool, load: Backlog, per_char: float) -> None: ...
    def peers(self, slot: int, key: int) -> list[Peer]: ...
    def rates(self, slot: int) -> list[float]: ...
    def mark_declined(self, slot: int, key: int) -> None: ...


class Router:
    """``backlog``: the instance's backlog now (its admission's); ``ready``: whether it takes
    work; ``reserve``: count a taken request as ``seconds`` of queued work until it is queued
    for real; ``board``: the board, or None while there is none."""

    def __init__(
        self,
        slot: int,
        pid: int,
        backlog: Callable[[], Backlog],
        ready: Callable[[], bool],
        rate: Rate,
        clock: Callable[[], float],
        board: Callable[[], SharedBoard | None],
        reserve: Callable[[float], None] = lambda seconds: None,
    ):
        self.slot, self.pid = slot, pid
        self.backlog, self.ready, self.rate, self.clock = backlog, ready, rate, clock
        self.board, self.reserve = board, reserve
        self.declined = 0  # requests this instance declined
        self.last_resort = 0  # requests it took as nginx's last resort
        self._lock = threading.Lock()  # one publish at a time: a stale backlog never overwrites a newer one
        self._warned = False

    def _broken(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("routing board unusable (%s): routing by least connections here", exc)

    def publish(self) -> None:
        board = self.board()
        if board is None:
            return
        with self._lock:
            try:
                board.publish(self.slot, self.pid, self.ready(), self.backlog(), self.rate.per_char or 0.0)
            except BOARD_ERRORS as exc:
                self._broken(exc)

    def check(self, try_id: str, last: bool) -> Decision:
        """Whether to take a request: ``try_id`` is nginx's id of the client request (the same
        on each try; "" when it did not come through nginx), ``last`` marks nginx's last resort.
        An instance whose every slot background work holds (a job's segments) declines for any
        peer that would start the request sooner, slack or not: a segment is not interrupted."""
        now = self.clock()
        if last:
            with self._lock:
                self.last_resort += 1
        board = self.board() if try_id else None
        try:
            work, slack = board.work() if board is not None else (False, 0.0)
            if board is None or not work:
                return self._take(Decision(False, self.backlog().wait(now)))
            if self.rate.per_char is None:  # a new instance starts from what its peers measured
                rates = [r for r in board.rates(self.slot) if r > 0]
                self.rate.prior = statistics.median(rates) if rates else None
            key = request_key(try_id)

            def peers():  # read only if decide weighs them (not when this instance is free enough)
                yield from board.peers(self.slot, key)

            own = self.backlog()
            if own.busy and not own.asking:  # (background work alone holds it: a sooner peer is worth a hop)
                slack = 0.0
            decision = decide(own, peers(), now, slack, last)
            if decision.decline:
                board.mark_declined(self.slot, key)
                with self._lock:
                    self.declined += 1
                return decision
        except BOARD_ERRORS as exc:
            self._broken(exc)
            decision = Decision(False, self.backlog().wait(now))
        return self._take(decision)

    def _take(self, decision: Decision) -> Decision:
        """A request taken: it counts as a typical synthesis from now on, so the next request
        (maybe a millisecond later, at another instance) sees it before its body is read."""
        typical = self.rate.typical()
        if typical > 0:
            self.reserve(typical)
        return decision
