"""The canary (cosyvoice_lb/instance/speech/canary.py): when an instance checks its own audio,
against a scripted clock, admission snapshot and synthesis (no sleeping), and what bad audio
does to its phase."""

from __future__ import annotations

import itertools

import pytest

from cosyvoice_lb.instance.audio.check import Fault
from cosyvoice_lb.instance.speech.admission import Admission, Phase, Snapshot
from cosyvoice_lb.instance.speech.canary import (
    OWED_POLL_SECONDS,
    POLL_SECONDS,
    AudioWatch,
    CanaryLoop,
    canary_due,
    take_out,
)

NAN = Fault("non_finite", "16000 of 16000 samples of a chunk are NaN or infinite")


def snapshot(phase: Phase = Phase.READY, inflight: int = 0, waiting: int = 0) -> Snapshot:
    return Snapshot(phase, inflight, waiting, 0.0, (), 0, 0, "")


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("inflight, waiting", [(0, 0), (1, 0), (0, 1), (2, 3)])
@pytest.mark.parametrize("owed", [False, True])
@pytest.mark.parametrize("since", [0.0, 299.9, 300.0, 10_000.0])
@pytest.mark.parametrize("interval", [0.0, 300.0])
def test_a_canary_runs_on_a_ready_instance_when_owed_or_idle_and_due(phase, inflight, waiting, owed, since, interval):
    due = canary_due(1000.0 + since, snapshot(phase, inflight, waiting), 1000.0, interval, owed)
    idle = inflight == 0 and waiting == 0
    assert due == (phase is Phase.READY and (owed or (idle and interval > 0 and since >= interval)))


class Rig:
    """A canary loop with a scripted clock, snapshot and synthesis."""

    def __init__(self, interval: float = 300.0, faults=()):
        self.now = 0.0
        self.state = snapshot()
        self.faults = iter(faults)
        self.bad: list[Fault] = []
        self.recorded: list[tuple[str, str]] = []
        self.watch = AudioWatch(self.clock, lambda reason, during: self.recorded.append((reason, during)))
        self.loop = CanaryLoop(
            interval, self.watch, lambda: self.state, self.synthesize, self.bad.append, clock=self.clock
        )

    def clock(self) -> float:
        return self.now

    def synthesize(self):
        fault = next(self.faults, None)
        if isinstance(fault, Exception):
            raise fault
        return fault


def test_the_periodic_canary_runs_every_interval_of_an_idle_instance():
    rig = Rig(interval=300.0)
    for _ in range(1000):  # 1000 s of looking, a second apart
        rig.now += rig.loop.step()
    assert rig.loop.runs == 3  # at 300, 600 and 900 s


def test_audio_that_passed_the_check_meanwhile_puts_the_canary_off():
    rig = Rig(interval=300.0)
    for second in range(1000):
        if second % 200 == 0:
            rig.watch.good()  # a request's audio passed the check: the instance is known sound
        rig.now += rig.loop.step()
    assert rig.loop.runs == 0


def test_a_busy_instance_runs_no_periodic_canary():
    rig = Rig(interval=10.0)
    rig.state = snapshot(inflight=1)
    for _ in range(100):
        rig.now += rig.loop.step()
    assert rig.loop.runs == 0
    rig.state = snapshot()  # idle at last: the one that is due runs once, then every 10 s
    rig.now += rig.loop.step()
    assert rig.loop.runs == 1


@pytest.mark.parametrize("inflight, waiting", [(0, 0), (1, 2)])
def test_a_bad_answer_owes_a_canary_at_once_busy_or_not(inflight, waiting):
    """(A busy instance may never be idle: one that fails every request must still be found out.)"""
    rig = Rig(interval=0.0)  # (no periodic canary: one is still owed after a bad answer)
    rig.state = snapshot(inflight=inflight, waiting=waiting)
    rig.watch.bad(NAN, "request")
    assert rig.recorded == [("non_finite", "request")] and rig.watch.counts() == {"non_finite": 1}
    assert rig.loop.step() == POLL_SECONDS and rig.loop.runs == 1
    assert not rig.watch.owed.is_set() and rig.bad == []  # the canary passed: the request's own fault
    for _ in range(100):
        rig.now += rig.loop.step()
    assert rig.loop.runs == 1  # owed once, run once


def test_an_owed_canary_waits_while_the_instance_is_not_ready():
    rig = Rig(interval=0.0)
    rig.state = snapshot(Phase.DRAINING)
    rig.watch.bad(NAN, "request")
    assert [rig.loop.step() for _ in range(3)] == [OWED_POLL_SECONDS] * 3 and rig.loop.runs == 0


def test_a_canary_that_makes_bad_audio_takes_the_instance_out():
    rig = Rig(interval=0.0, faults=[NAN])
    rig.watch.bad(NAN, "request")
    rig.loop.step()
    assert rig.bad == [NAN]


def test_a_canary_that_fails_otherwise_is_no_bad_audio():
    rig = Rig(interval=0.0, faults=[RuntimeError("CUDA error: an illegal memory access")])
    rig.watch.bad(NAN, "request")
    assert rig.loop.step() == POLL_SECONDS
    assert rig.loop.runs == 1 and rig.bad == []


def test_run_looks_until_told_to_stop():
    rig = Rig(interval=5.0)
    naps: list[float] = []
    rig.loop.sleep = lambda seconds: (naps.append(seconds), setattr(rig, "now", rig.now + seconds))
    counter = itertools.count()
    rig.loop.run(stopping=lambda: next(counter) >= 20)
    assert len(naps) == 20 and rig.loop.runs == 3  # at 5, 10 and 15 s


# --- the phase ------------------------------------------------------------------------------


@pytest.mark.parametrize("during", ["warm_up", "canary"])
def test_bad_audio_of_the_warm_up_or_a_canary_takes_the_instance_out_until_restarted(during):
    admission = Admission()
    if during == "canary":
        assert admission.become_ready()
    watch = AudioWatch(admission.clock)
    take_out(admission, watch, NAN, during)
    seen = admission.snapshot()
    assert seen.phase is Phase.BAD_AUDIO and not seen.ready
    assert (
        seen.error
        == f"{'the warm-up synthesis' if during == 'warm_up' else 'a canary synthesis'} made bad audio: {NAN}"
    )
    assert watch.counts() == {"non_finite": 1} and not watch.owed.is_set()  # (no canary owed: it is out)
    assert admission.become_ready() is False  # never ready again: the health loop restarts it
    with pytest.raises(Exception, match="makes bad audio and waits to be restarted: retry"):
        admission.check_ready()


@pytest.mark.parametrize("first", ["drain", "fail"])
def test_a_draining_or_failed_instance_stays_so(first):
    admission = Admission()
    admission.drain() if first == "drain" else admission.fail("boom")
    take_out(admission, AudioWatch(admission.clock), NAN, "canary")
    assert admission.phase is (Phase.DRAINING if first == "drain" else Phase.FAILED)
