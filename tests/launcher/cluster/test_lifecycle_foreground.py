"""`up --foreground` (foreground.foreground, foreground.StopSignals) with its collaborators
faked: a scripted stop event and clock, a scripted supervisord liveness, a recording down."""

from __future__ import annotations

import os
import signal

import pytest
from click.testing import CliRunner

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.cli import main
from cosyvoice_lb.launcher.cluster import foreground
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.state.layout import Layout


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ScriptedStop:
    """``wait`` lets ``poll`` seconds pass on the fake clock; it is set after ``after`` waits
    (never when None), or by ``set()`` (as a signal handler would, e.g. during a check)."""

    def __init__(self, clock: Clock, after: int | None):
        self.clock, self.after, self.waits, self.flag = clock, after, 0, False

    def set(self) -> None:
        self.flag = True

    def is_set(self) -> bool:
        return self.flag

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        if self.after is not None and self.waits > self.after:
            self.flag = True
        if not self.flag:
            self.clock.now += timeout or 0
        return self.flag


class Harness:
    def __init__(self, tmp_path, liveness, after: int | None, poll: float = 3.0, silent: float = 20.0):
        self.layout = Layout(tmp_path)
        self.clock = Clock()
        self.stop = ScriptedStop(self.clock, after)
        self.said: list[str] = []
        self.downs: list[Layout] = []
        self.reaped = 0
        self.checks = 0
        self.liveness = liveness
        self.poll, self.silent = poll, silent

    def check(self):
        self.checks += 1
        return self.liveness(self)

    def down(self, layout: Layout) -> list[int]:
        self.downs.append(layout)
        return [11, 12, 13]

    def reap(self) -> None:
        self.reaped += 1

    def run(self) -> foreground.Stopped:
        return foreground.stay(
            self.layout,
            Settings(drain_timeout=30),
            self.stop,
            liveness=self.check,
            stop_cluster=self.down,
            reap=self.reap,
            poll=self.poll,
            silent=self.silent,
            clock=self.clock,
            say=self.said.append,
        )


def test_it_waits_until_the_stop_then_drains_with_down_and_exits_0(tmp_path):
    h = Harness(tmp_path, lambda h: "answers", after=5)
    stopped = h.run()
    assert stopped == foreground.Stopped(0, [11, 12, 13], "")
    assert h.downs == [h.layout]  # down, once
    assert h.checks == 5 and h.reaped >= 5  # one check per poll while waiting
    assert h.said == [
        "running in the foreground: SIGTERM drains and stops it",
        "drained and stopped 3 process(es)",
    ]


def test_a_supervisord_that_goes_away_ends_it_with_1_after_sweeping(tmp_path):
    h = Harness(tmp_path, lambda h: "answers" if h.checks < 3 else "gone", after=None)
    stopped = h.run()
    assert stopped.code == 1 and "supervisord went away" in stopped.reason
    assert "stopped what was left of the cluster (3 process(es))" in stopped.reason
    assert h.downs == [h.layout] and h.checks == 3
    assert h.said == ["running in the foreground: SIGTERM drains and stops it"]  # no "drained and stopped"


def test_a_silent_supervisord_is_given_the_bound_then_it_ends_with_1(tmp_path):
    h = Harness(tmp_path, lambda h: "answers" if h.checks < 2 else "silent", after=None, poll=3.0, silent=20.0)
    stopped = h.run()
    assert stopped.code == 1 and "supervisord has not answered for" in stopped.reason
    # it answers at t=103 (the first check), not from 106 on: tolerated up to 123, given up at 124
    assert h.clock.now == 124.0 and h.checks == 8 and h.downs == [h.layout]


def test_a_supervisord_silent_for_a_while_that_answers_again_is_fine(tmp_path):
    script = ["answers", "silent", "silent", "silent", "answers", "silent", "silent", "answers"]
    h = Harness(tmp_path, lambda h: script[h.checks - 1], after=len(script))
    assert h.run().code == 0 and h.downs == [h.layout]


def test_a_down_from_outside_is_waited_for_then_reported(tmp_path):
    h = Harness(tmp_path, lambda h: ["answers", "stopping", "stopping", "gone"][min(h.checks, 4) - 1], after=None)
    stopped = h.run()
    assert stopped.code == 1 and "shut down from outside (cosyvoice-lb down?)" in stopped.reason


def test_a_shutdown_that_never_ends_is_bounded(tmp_path):
    h = Harness(tmp_path, lambda h: "stopping", after=None, poll=10.0)
    stopped = h.run()
    assert stopped.code == 1 and "has been shutting down for" in stopped.reason
    # drain 30 s: a down takes up to 90 s, plus 20 s of slack
    assert 110 < h.clock.now - 100 <= 130


def test_a_stop_during_a_check_wins_over_what_the_check_saw(tmp_path):
    def liveness(h):
        h.stop.set()  # SIGTERM arrives while supervisord is asked (it went away meanwhile: down's sweep)
        return "gone"

    h = Harness(tmp_path, liveness, after=None)
    stopped = h.run()
    assert stopped.code == 0 and h.downs == [h.layout] and h.said[-1] == "drained and stopped 3 process(es)"


def test_liveness_of_a_state_dir_without_supervisord_is_gone(tmp_path):
    layout = Layout(tmp_path)
    assert foreground.supervisord_liveness(layout) == "gone"
    layout.run.mkdir(parents=True)
    layout.supervisord_pid.write_text(str(os.getpid()))  # a live pid, but not this cluster's supervisord
    assert foreground.supervisord_liveness(layout) == "gone"


# --- the signals ------------------------------------------------------------------------


def test_a_signal_while_starting_interrupts_the_start():
    written: list[str] = []
    signals = foreground.StopSignals(write=written.append)
    with pytest.raises(KeyboardInterrupt):
        signals(signal.SIGTERM)
    assert signals.event.is_set()
    signals(signal.SIGTERM)  # a second one while `up` stops what it started: logged, never raised
    assert written == ["SIGTERM again: still draining (the drain is not interrupted)"]


def test_once_serving_the_first_signal_stops_and_later_ones_are_only_logged():
    written: list[str] = []
    signals = foreground.StopSignals(write=written.append)
    signals.starting = False
    signals(signal.SIGTERM)
    assert signals.event.is_set()
    signals(signal.SIGINT)
    signals(signal.SIGTERM)
    assert written == [
        "SIGTERM: draining and stopping the cluster",
        "SIGINT again: still draining (the drain is not interrupted)",
        "SIGTERM again: still draining (the drain is not interrupted)",
    ]


def test_installed_handlers_take_real_signals():
    before = {n: signal.getsignal(n) for n in (signal.SIGTERM, signal.SIGINT)}
    written: list[str] = []
    try:
        signals = foreground.StopSignals(write=written.append).install()
        signals.starting = False
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.event.wait(5)
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt
        assert signals.event.wait(5)
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)
    assert written[-1] == "SIGINT again: still draining (the drain is not interrupted)"


def test_a_signal_while_starting_stops_the_cluster_as_asked_and_a_failure_still_raises(tmp_path, monkeypatch):
    downs: list[Layout] = []
    monkeypatch.setattr(foreground, "down", lambda layout, timeout=None: downs.append(layout) or [])
    layout = Layout(tmp_path)
    signals = foreground.StopSignals(write=lambda line: None)
    with signals.while_starting(layout):  # a pod deleted while it loads: not an error
        signals(signal.SIGTERM)
    assert signals.stopped_starting and downs == [layout]
    signals = foreground.StopSignals(write=lambda line: None)
    with signals.while_starting(layout):  # what `up` raises once the signal interrupted it
        signals.event.set()
        raise ClusterError("interrupted\nThe cluster was stopped")
    assert signals.stopped_starting and downs == [layout, layout]
    failed = foreground.StopSignals(write=lambda line: None)
    with pytest.raises(ClusterError, match="instance-0 failed"):
        with failed.while_starting(layout):  # no signal: a start that fails is an error
            raise ClusterError("instance-0 failed to start")
    assert not failed.stopped_starting and downs == [layout, layout]
    fine = foreground.StopSignals(write=lambda line: None)
    with fine.while_starting(layout):
        pass
    assert fine.starting is False and not fine.stopped_starting


def test_up_help_offers_foreground_and_its_variable():
    done = CliRunner().invoke(main, ["up", "--help"], terminal_width=200)
    assert done.exit_code == 0
    assert "--foreground" in done.output and "COSYVOICE_LB_FOREGROUND" in done.output
    assert "cosyvoice-lb logs NAME" in done.output
