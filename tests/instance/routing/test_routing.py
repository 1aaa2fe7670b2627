"""Routing by work (cosyvoice_lb/instance/routing/rule.py, router.py): what an instance's backlog makes a
request wait, when it declines, the measured seconds per character, and the router's glue
on a real board file."""

from __future__ import annotations

import os

import pytest

from cosyvoice_lb.instance.routing.board import Board
from cosyvoice_lb.instance.routing.router import Router
from cosyvoice_lb.instance.routing.rule import (
    Backlog,
    Peer,
    Rate,
    decide,
    queue_load,
    request_key,
)
from cosyvoice_lb.instance.speech.admission import Admission

NOW = 1000.0


# --- what a backlog makes a request wait ----------------------------------------------------


def test_a_backlog_waits_until_its_end_and_nothing_once_it_ended_idle():
    assert Backlog(NOW + 0.4, busy=True).wait(NOW) == pytest.approx(0.4)
    assert Backlog(NOW - 5, busy=False).wait(NOW) == 0.0
    assert Backlog().wait(NOW) == 0.0


def test_an_overrun_synthesis_looks_busier_the_longer_it_overruns():
    # Expected to end 2 s ago and still running: a hung instance never looks free.
    assert Backlog(NOW - 2, busy=True).wait(NOW) == pytest.approx(2.0)
    assert Backlog(NOW - 2, busy=True).wait(NOW + 3) == pytest.approx(5.0)


def test_queue_load_is_when_the_next_engine_slot_comes_free():
    # one synthesis of 0.4 s started 0.1 s ago, then 0.5 s of work waiting: one slot
    assert queue_load(NOW, [(NOW - 0.1, 0.4)], [0.5], 1) == Backlog(NOW + 0.8, True)
    assert queue_load(NOW, [], [], 1) == Backlog(NOW, False)
    # two slots: one free already, so a request arriving now starts at once
    assert queue_load(NOW, [(NOW, 10.0)], [], 2) == Backlog(NOW, False)
    # both taken (4 s and 1 s left), 2 s waiting: the waiting one takes the slot free in 1 s,
    # the next request the one free in 3 s
    assert queue_load(NOW, [(NOW - 6, 10.0), (NOW, 1.0)], [2.0], 2).until == pytest.approx(NOW + 3)


def test_an_overrun_never_cancels_the_work_queued_behind_it():
    overrun = queue_load(NOW, [(NOW - 1.0, 0.4)], [], 1)  # 0.6 s past its estimate
    assert overrun.wait(NOW) == pytest.approx(0.6) and overrun.busy
    # a 2 s estimate that has run 12 s, 10 s waiting behind it: never "idle"
    assert queue_load(NOW, [(NOW - 12, 2.0)], [10.0], 1).wait(NOW) == pytest.approx(20.0)


# --- the decision ---------------------------------------------------------------------------


def peer(slot: int, wait: float, declined: bool = False) -> Peer:
    return Peer(slot, Backlog(NOW + wait, wait > 0), declined)


def test_declines_for_an_untried_peer_that_starts_it_sooner_by_more_than_the_slack():
    decision = decide(Backlog(NOW + 0.4, True), [peer(1, 0.3), peer(2, 0.04)], NOW, slack=0.05)
    assert decision.decline and decision.better == 2
    assert decision.wait == pytest.approx(0.4) and decision.better_wait == pytest.approx(0.04)
    assert "slot 2" in decision.message() and "0.40s" in decision.message()


def test_takes_it_when_no_untried_peer_is_better_by_more_than_the_slack():
    own = Backlog(NOW + 0.4, True)
    assert not decide(own, [peer(1, 0.36)], NOW, slack=0.05).decline  # 40 ms sooner: not worth a hop
    assert not decide(own, [peer(1, 0.5), peer(2, 0.9)], NOW, slack=0.05).decline
    assert not decide(own, [], NOW, slack=0.05).decline  # alone in rotation
    # The better one declined it already: nginx will not try it again for this request.
    assert not decide(own, [peer(1, 0.0, declined=True), peer(2, 0.6)], NOW, slack=0.05).decline
    assert decide(own, [peer(1, 0.0, declined=True), peer(2, 0.1)], NOW, slack=0.05).better == 2


def test_a_short_wait_and_the_last_resort_are_always_taken():
    assert not decide(Backlog(NOW + 0.04, True), [peer(1, 0.0)], NOW, slack=0.05).decline
    assert not decide(Backlog(NOW + 9, True), [peer(1, 0.0)], NOW, slack=0.05, last=True).decline


def test_request_keys_are_stable_distinct_and_never_zero():
    assert request_key("abc") == request_key("abc") != request_key("abd")
    assert all(request_key(str(i)) != 0 for i in range(2000))


# --- seconds per character ------------------------------------------------------------------


def test_the_rate_is_unknown_until_a_synthesis_ends_then_a_moving_average():
    rate = Rate(weight=0.5)
    assert rate.per_char is None and rate.estimate(100) == 0.0
    rate.observe(100, 0.4)
    assert rate.per_char == pytest.approx(0.004) and rate.estimate(50) == pytest.approx(0.2)
    rate.observe(100, 0.8)  # slower now: half way there with weight 0.5
    assert rate.per_char == pytest.approx(0.006)


def test_the_rate_weighs_a_long_text_by_its_length():
    rate = Rate(weight=0.5)
    rate.observe(10, 0.1)  # 10 ms per character (a fixed cost shows on a short text)
    rate.observe(1000, 2.0)  # 2 ms per character
    assert rate.per_char == pytest.approx(2.1 / 1010)  # ratio of the averages, not average of ratios


def test_the_rate_ignores_what_cannot_be_a_measurement():
    rate = Rate()
    rate.observe(0, 1.0)
    rate.observe(10, -1.0)
    assert rate.per_char is None and rate.typical() == 0.0


def test_until_its_own_the_rate_is_its_peers_and_typical_is_the_average_synthesis():
    rate = Rate(weight=0.5)
    rate.prior = 0.01
    assert rate.estimate(10) == pytest.approx(0.1)  # the peers' rate
    rate.observe(100, 0.4)
    assert rate.estimate(10) == pytest.approx(0.04)  # its own, once it has one
    rate.observe(300, 1.2)
    assert rate.typical() == pytest.approx(0.8)  # (0.4 + 1.2) / 2


# --- the router on a real board -------------------------------------------------------------


@pytest.fixture
def board(tmp_path):
    made = Board.create(tmp_path / "routing.board")
    made.configure(True, 0.05)
    yield made
    made.close()


def router_on(board: Board, slot: int, backlog: list[Backlog], clock=lambda: NOW, reserved=None) -> Router:
    rate = Rate()
    rate.observe(100, 0.4)
    reserve = reserved.append if reserved is not None else (lambda seconds: None)
    return Router(slot, os.getpid(), lambda: backlog[0], lambda: True, rate, clock, lambda: board, reserve)


def test_the_router_publishes_its_backlog_and_declines_for_a_freer_peer(board):
    busy, free = [Backlog(NOW + 0.4, True)], [Backlog(NOW, False)]
    taken: list[float] = []
    first, second = router_on(board, 0, busy), router_on(board, 1, free, reserved=taken)
    first.publish()
    second.publish()
    board.set_rotation([0, 1])
    pid, backlog, per_char, ready, rotation = board.row(0)
    assert (pid, backlog, ready, rotation) == (os.getpid(), busy[0], True, True)
    assert per_char == pytest.approx(0.004)

    decision = first.check("request-1", last=False)
    assert decision.decline and decision.better == 1 and first.declined == 1
    assert board.declined(0, request_key("request-1"))  # (the others see it was tried here)
    assert not second.check("request-1", last=False).decline  # the free one takes it
    # ...and counts it as a typical synthesis until its body is read and it queues
    assert taken == [pytest.approx(0.4)]


def test_the_router_never_declines_without_a_board_routing_by_work_or_nginxs_mark(board):
    busy = [Backlog(NOW + 0.4, True)]
    free = router_on(board, 1, [Backlog(NOW, False)])
    free.publish()
    board.set_rotation([0, 1])
    alone = Router(0, os.getpid(), lambda: busy[0], lambda: True, Rate(), lambda: NOW, lambda: None)
    assert not alone.check("request-1", last=False).decline
    on_board = router_on(board, 0, busy)
    assert not on_board.check("", last=False).decline  # straight at its port: answered, never declined
    board.configure(False, 0.05)  # --routing least-conn, switched live
    assert not on_board.check("request-2", last=False).decline
    board.configure(True, 0.05)
    assert on_board.check("request-3", last=False).decline


def test_the_last_resort_is_counted_and_taken(board):
    busy = router_on(board, 0, [Backlog(NOW + 5, True)])
    router_on(board, 1, [Backlog(NOW, False)]).publish()
    board.set_rotation([0, 1])
    assert not busy.check("request-1", last=True).decline
    assert (busy.last_resort, busy.declined) == (1, 0)


def test_a_new_instance_estimates_with_its_peers_rate(board):
    peer = router_on(board, 1, [Backlog(NOW, False)])
    peer.publish()
    board.set_rotation([0, 1])
    rate = Rate()
    new = Router(0, os.getpid(), lambda: Backlog(NOW, False), lambda: True, rate, lambda: NOW, lambda: board)
    new.check("request-1", last=False)
    assert rate.per_char is None and rate.estimate(100) == pytest.approx(0.4)


def test_a_board_that_breaks_turns_the_router_to_least_connections(board, caplog):
    router = router_on(board, 0, [Backlog(NOW + 5, True)])
    router_on(board, 1, [Backlog(NOW, False)]).publish()
    board.set_rotation([0, 1])
    board.close()  # (what a replaced or vanished file looks like to a map)
    router.publish()  # no exception: admission must go on
    assert not router.check("request-1", last=False).decline
    assert "routing board unusable" in caplog.text


# --- an instance of N engine slots (--instance-concurrency N) -----------------------------------


def test_with_eight_slots_a_request_waits_only_once_all_eight_are_taken():
    running = [(NOW - i, 10.0) for i in range(7)]  # 7 syntheses of 10 s, started 0..6 s ago
    assert queue_load(NOW, running, [], 8) == Backlog(NOW, False)  # one slot free: no wait
    full = queue_load(NOW, [*running, (NOW, 10.0)], [], 8)
    assert full.busy and full.until == pytest.approx(NOW + 4)  # the oldest frees first, in 4 s
    # queued work takes the slots that free first, one each: 3 s behind the first two to free
    queued = queue_load(NOW, [*running, (NOW, 10.0)], [3.0, 3.0], 8)
    assert queued.until == pytest.approx(NOW + 6)  # (4 s + 3 s on one, 5 s + 3 s on another; next: 6 s)


def test_an_eight_slot_instance_holding_seven_takes_what_a_one_slot_peer_holding_one_would_delay():
    wide = Admission(8, clock=lambda: NOW)
    tickets = [wide.admit(cost=10.0) for _ in range(7)]
    assert wide.load() == Backlog(NOW, False)  # room for the eighth at once
    narrow = Admission(1, clock=lambda: NOW)
    held = narrow.admit(cost=2.0)
    assert not decide(wide.load(), [Peer(1, narrow.load())], NOW, slack=0.05).decline
    # with all eight taken it declines for the peer that frees sooner
    tickets.append(wide.admit(cost=10.0))
    decision = decide(wide.load(), [Peer(1, narrow.load())], NOW, slack=0.05)
    assert decision.decline and decision.better == 1 and decision.wait == pytest.approx(10.0)
    for ticket in [*tickets, held]:
        ticket.release(None)
    assert wide.load() == Backlog(NOW, False) and wide.concurrency == 8
