"""Admission to the engine (cosyvoice_lb/instance/speech/admission.py): phase, slots, queue bound, deadlines,
the stall clock and the counters, with a scripted clock (no sleeping but where a thread
must really wait for a slot)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from cosyvoice_lb.instance.speech.admission import (
    Admission,
    NotReady,
    Overloaded,
    Phase,
    TimedOut,
    deadline_for,
)


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def ready(**kwargs) -> Admission:
    admission = Admission(**kwargs)
    assert admission.become_ready()
    return admission


# --- phase ----------------------------------------------------------------------------------


def test_only_a_ready_instance_takes_work():
    admission = Admission()
    for phase_word in ("still loading",):
        with pytest.raises(NotReady, match=phase_word):
            admission.check_ready()
    assert admission.become_ready() and admission.phase is Phase.READY
    admission.check_ready()
    assert admission.drain() is True
    with pytest.raises(NotReady, match="shutting down"):
        admission.check_ready()
    assert admission.drain() is False  # the second signal: the caller stops at once


def test_a_drained_or_failed_instance_never_turns_ready():
    drained = Admission()
    drained.drain()
    assert drained.become_ready() is False and drained.phase is Phase.DRAINING
    failed = Admission()
    failed.fail("ImportError: no torch")
    assert failed.become_ready() is False and failed.snapshot().error == "ImportError: no torch"
    with pytest.raises(NotReady, match="failed to load"):
        failed.check_ready()


def test_drain_and_ready_racing_never_end_ready_while_draining():
    """A drain that lands while the warm-up finishes must win, however the threads interleave."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        for _ in range(300):
            admission = Admission()
            go = threading.Barrier(2)

            def warm_up_done() -> None:
                go.wait()
                admission.become_ready()

            thread = threading.Thread(target=warm_up_done)
            thread.start()
            go.wait()
            admission.drain()
            thread.join()
            assert admission.phase is Phase.DRAINING and not admission.snapshot().ready
    finally:
        sys.setswitchinterval(old)


# --- slots and the queue ------------------------------------------------------------------------


def test_a_full_queue_is_refused_and_the_unbounded_wait_their_turn():
    admission = ready(concurrency=1, max_queue=1)
    first = admission.admit(bounded=True)
    waiter_got = []
    waiter = threading.Thread(target=lambda: waiter_got.append(admission.admit(bounded=True)))
    waiter.start()
    deadline = time.monotonic() + 5
    while admission.snapshot().waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    snap = admission.snapshot()
    assert (snap.inflight, snap.waiting) == (1, 1)
    with pytest.raises(Overloaded, match="1 synthesizing, 1 waiting"):
        admission.admit(bounded=True)
    first.release(True)
    waiter.join(5)
    assert len(waiter_got) == 1 and admission.snapshot().inflight == 1 and admission.snapshot().waiting == 0
    waiter_got[0].release(True)
    assert admission.snapshot().idle


def test_no_slot_by_the_deadline_is_a_timeout():
    clock = Clock()
    admission = ready(concurrency=1, clock=clock)
    held = admission.admit()
    with pytest.raises(TimedOut, match="no engine slot came free"):
        admission.admit(deadline=clock.now + 0.05)
    assert admission.snapshot().waiting == 0
    held.release(None)
    admission.admit(deadline=clock.now + 1).release(None)  # free again: admitted at once


def test_concurrency_gives_that_many_slots():
    admission = ready(concurrency=3, max_queue=0)
    tickets = [admission.admit(bounded=True) for _ in range(3)]
    with pytest.raises(Overloaded):
        admission.admit(bounded=True)
    for t in tickets:
        t.release(True)
    assert admission.snapshot().served == 3


def test_release_is_counted_once():
    admission = ready()
    ticket = admission.admit()
    ticket.release(True)
    ticket.release(False)  # a second release (e.g. from a finally) changes nothing
    snap = admission.snapshot()
    assert (snap.served, snap.failed, snap.inflight) == (1, 0, 0)
    admission.admit().release(None)  # warm-up or a client gone: neither served nor failed
    assert (admission.snapshot().served, admission.snapshot().failed) == (1, 0)


def test_the_counters_are_exact_under_concurrency():
    """--max-requests recycles by the served count: no increment may be lost."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        admission = ready(concurrency=8)
        per_thread, threads = 500, 8

        def work(ok: bool) -> None:
            for _ in range(per_thread):
                admission.admit().release(ok)

        workers = [threading.Thread(target=work, args=(i % 2 == 0,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
    finally:
        sys.setswitchinterval(old)
    snap = admission.snapshot()
    assert (snap.served, snap.failed) == (per_thread * threads // 2, per_thread * threads // 2)
    assert snap.idle


# --- the stall clock ----------------------------------------------------------------------------


def test_busy_and_stalled_seconds_follow_the_clock():
    clock = Clock(1000.0)
    admission = ready(concurrency=2, clock=clock)
    ticket = admission.admit()
    clock.now += 5
    snap = admission.snapshot()
    assert (snap.busy_seconds, snap.stalled_seconds) == (5.0, (5.0,))
    ticket.handed_out()  # a chunk waits for its reader: a slow reader is not a hang
    clock.now += 30
    assert admission.snapshot().stalled_seconds == (0.0,) and admission.snapshot().busy_seconds == 35.0
    ticket.working()  # back in the engine: the stall clock runs from here
    clock.now += 2
    other = admission.admit()
    clock.now += 1
    assert admission.snapshot().stalled_seconds == (3.0, 1.0)  # longest first
    ticket.release(True)
    other.release(True)
    assert admission.snapshot().stalled_seconds == () and admission.snapshot().busy_seconds == 0.0


# --- deadlines ----------------------------------------------------------------------------------


def test_the_deadline_counts_from_nginx_stamp():
    wall, mono = 1_700_000_000.0, 500.0
    assert deadline_for(10.0, None, wall, mono) == mono + 10
    assert deadline_for(10.0, f"{wall - 4:.3f}", wall, mono) == pytest.approx(mono + 6)  # 4 s spent (a retry)
    assert deadline_for(10.0, f"{wall + 0.5:.3f}", wall, mono) == mono + 10  # clock skew: never later than now
    for odd in ("soon", "", f"{wall + 100:.3f}", f"{wall - 10**6:.3f}"):
        assert deadline_for(10.0, odd, wall, mono) == mono + 10
    assert deadline_for(0.0, f"{wall:.3f}", wall, mono) is None  # no --request-timeout: no bound


# --- the backlog routing weighs ------------------------------------------------------------


def test_the_backlog_counts_estimated_work_in_flight_and_waiting():
    clock = Clock()
    changes = []
    admission = ready(clock=clock, on_change=lambda: changes.append(admission.load()))
    ticket = admission.admit(cost=0.4)
    assert admission.load().until == pytest.approx(100.4) and admission.load().busy
    clock.now += 0.1
    assert admission.load().wait(clock.now) == pytest.approx(0.3)
    waiter = threading.Thread(target=lambda: admission.admit(cost=0.5).release(True))
    waiter.start()
    for _ in range(200):  # the waiter is queued (and published) before it blocks
        if admission.snapshot().waiting:
            break
        time.sleep(0.005)
    assert admission.load().wait(clock.now) == pytest.approx(0.8)
    ticket.release(True)
    waiter.join(5)
    assert not waiter.is_alive()
    assert admission.load() == type(admission.load())(clock.now, False)  # nothing left
    # every change was published: queued, admitted, released (for each of the two)
    assert len(changes) >= 5 and changes[-1].busy is False


def test_a_timed_out_waiter_takes_its_estimate_out_of_the_backlog():
    clock = Clock()
    admission = ready(clock=clock)
    held = admission.admit(cost=1.0)
    with pytest.raises(TimedOut):
        admission.admit(cost=5.0, deadline=clock.now)  # no slot by now
    assert admission.load().until == pytest.approx(101.0)
    held.release(True)


def test_a_taken_request_counts_until_it_queues_or_for_a_second_at_most():
    clock = Clock()
    admission = ready(clock=clock)
    admission.reserve(0.3)  # taken: its body is being read
    admission.reserve(0.3)
    assert admission.load().wait(clock.now) == pytest.approx(0.6)  # (one engine slot: both ahead)
    ticket = admission.admit(cost=0.5)  # one queues for real: its reservation goes
    assert admission.load().wait(clock.now) == pytest.approx(0.8)  # 0.5 in flight, then the other's 0.3
    clock.now += 1.0  # the other never queued (refused, say): it no longer counts
    assert admission.load().wait(clock.now) == pytest.approx(0.5)  # only the overrun of the one in flight
    ticket.release(True)
    assert admission.load() == type(admission.load())(clock.now, False)


def test_a_failing_publisher_never_costs_an_engine_slot():
    def broken() -> None:
        raise ValueError("mmap closed or invalid")

    admission = ready(on_change=broken)
    for _ in range(3):  # (one slot: a leaked ticket would block the second admit for good)
        admission.admit(cost=0.1).release(True)
    admission.reserve(0.1)
    assert admission.snapshot().inflight == 0 and admission.snapshot().served == 3


def test_phase_changes_are_published():
    seen = []
    admission = Admission(on_change=lambda: seen.append(admission.phase))
    admission.become_ready()
    admission.drain()
    admission.fail("boom")
    assert seen == [Phase.READY, Phase.DRAINING, Phase.FAILED]
