"""A streaming session's engine slot (admission.Lease): taken now or refused, its syntheses
run on it without queueing, waiting for the client's text is not a stall, released once."""

from __future__ import annotations

import math
import threading

import pytest
from test_admission import Clock, ready

from cosyvoice_lb.instance.speech.admission import Admission, NotReady, Overloaded


def test_a_lease_takes_a_free_slot_or_is_refused_at_once():
    admission = ready(concurrency=2, max_queue=10)
    first, second = admission.lease(), admission.lease()
    assert admission.snapshot().inflight == 2 and admission.snapshot().sessions == 2
    with pytest.raises(Overloaded, match="no engine slot free for a streaming session"):
        admission.lease()  # (never queued: another instance may have a slot)
    first.release(None)
    third = admission.lease()
    assert admission.snapshot().inflight == 2
    for lease in (second, third):
        lease.release(None)
    assert admission.snapshot().idle and admission.snapshot().served == 0 and admission.snapshot().sessions == 0


def test_a_lease_is_refused_while_anyone_waits_or_the_instance_takes_no_work():
    admission = Admission(1, 4)
    with pytest.raises(NotReady, match="still loading"):
        admission.lease()
    admission.become_ready()
    held = admission.admit()
    waiter = threading.Thread(target=lambda: admission.admit().release(True))
    waiter.start()
    while not admission.snapshot().waiting:
        threading.Event().wait(0.01)
    held.release(True)
    waiter.join(5)
    admission.drain()
    with pytest.raises(NotReady, match="shutting down"):
        admission.lease()


def test_syntheses_on_a_lease_count_but_keep_the_slot():
    clock = Clock()
    admission = ready(concurrency=1, clock=clock)
    lease = admission.lease()
    for outcome in (True, False, True):
        ticket = admission.admit(bounded=True, lease=lease)  # (never waits, never refused)
        ticket.working()
        ticket.release(outcome)
        ticket.release(outcome)  # (once only)
        assert admission.snapshot().inflight == 1
    snapshot = admission.snapshot()
    assert (snapshot.served, snapshot.failed) == (2, 1)
    lease.release(None)
    lease.release(None)
    assert admission.snapshot().inflight == 0 and admission.lease()


def test_waiting_for_the_clients_text_is_not_a_stall():
    clock = Clock()
    admission = ready(concurrency=1, clock=clock)
    lease = admission.lease()
    clock.now += 100
    assert admission.snapshot().stalled_seconds == (0.0,)  # (the client writes first)
    ticket = admission.admit(lease=lease)
    lease.waiting(False)
    ticket.working()
    clock.now += 7
    assert admission.snapshot().stalled_seconds == (7.0,)  # the engine itself: judged
    lease.waiting(True)  # the engine waits for text
    ticket.working()  # (the reader's mark between chunks does not start the clock again)
    clock.now += 50
    assert admission.snapshot().stalled_seconds == (0.0,)
    lease.waiting(False)
    clock.now += 2
    assert admission.snapshot().stalled_seconds == (2.0,)
    ticket.release(True)
    assert admission._inflight[lease._key][1] == math.inf  # between syntheses: the client's turn
