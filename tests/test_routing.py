"""Routing by work (cosyvoice_lb/routing.py): what an instance's backlog makes a request
wait, when it declines, the measured seconds per character, and the Router's glue on a
real board file."""

from __future__ import annotations

import os

import pytest

from cosyvoice_lb.board import Board
from cosyvoice_lb.routing import (
    Backlog,
    Peer,
    Rate,
    Router,
    decide,
    queue_load,
    request_key,
)

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


def test_queue_load_sums_what_is_left_of_each_synthesis_and_the_queue_per_slot():
    # one synthesis of 0.4 s started 0.1 s ago, 0.5 s of work waiting
    assert queue_load(NOW, [(NOW - 0.1, 0.4)], 0.5, 1) == Backlog(NOW + 0.8, True)
    assert queue_load(NOW, [(NOW - 0.1, 0.4)], 0.5, 2) == Backlog(NOW + 0.4, True)  # two engine slots
    assert queue_load(NOW, [], 0.0, 1) == Backlog(NOW, False)
    overrun = queue_load(NOW, [(NOW - 1.0, 0.4)], 0.0, 1)  # 0.6 s past its estimate
    assert overrun.until == pytest.approx(NOW - 0.6) and overrun.wait(NOW) == pytest.approx(0.6)


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
    assert rate.per_char is None


# --- the router on a real board -------------------------------------------------------------


@pytest.fixture
def board(tmp_path):
    made = Board.create(tmp_path / "routing.board")
    made.configure(True, 0.05)
    yield made
    made.close()


def router_on(board: Board, slot: int, backlog: list[Backlog], clock=lambda: NOW) -> Router:
    rate = Rate()
    rate.observe(100, 0.4)
    return Router(slot, os.getpid(), lambda: backlog[0], lambda: True, rate, clock, lambda: board)


def test_the_router_publishes_its_backlog_and_declines_for_a_freer_peer(board):
    busy, free = [Backlog(NOW + 0.4, True)], [Backlog(NOW, False)]
    first, second = router_on(board, 0, busy), router_on(board, 1, free)
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


def test_the_router_never_declines_without_a_board_routing_by_work_or_an_id(board):
    busy = [Backlog(NOW + 0.4, True)]
    free = router_on(board, 1, [Backlog(NOW, False)])
    free.publish()
    board.set_rotation([0, 1])
    alone = Router(0, os.getpid(), lambda: busy[0], lambda: True, Rate(), lambda: NOW, lambda: None)
    assert not alone.check("request-1", last=False).decline
    on_board = router_on(board, 0, busy)
    assert not on_board.check("", last=False).decline  # (no id: no way to know its tries)
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
