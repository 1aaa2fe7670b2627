"""The health loop (cosyvoice_lb/launcher/health/loop.py) with every collaborator scripted:
the state files in memory (``health.adapters.StateFiles``), a fake routing board, scripted
clocks and sleep. Nothing here touches the disk: the state dir the loop is given does not
exist, and stays so.
"""

from __future__ import annotations

import random
import re
import signal
from pathlib import Path

import pytest
from test_health_loop import HUP, REFUSED, SLOTS, A, B, Clock, FakeHost, FakeProber, FakeSupervisor

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.health.loop import HealthLoop
from cosyvoice_lb.launcher.state.canary import Canary
from cosyvoice_lb.launcher.state.health_report import HealthReport, OnPurpose, Track
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.markers import DrainAction

NOWHERE = Layout(Path("/nonexistent/cosyvoice-lb-state"))


class MemoryFiles:
    """The state dir's files as the loop uses them, in memory."""

    def __init__(self, report: HealthReport | None = None) -> None:
        self.report = report or HealthReport()
        self.reports: list[HealthReport] = []
        self.upstreams: list[str] = []
        self.starts = {A: 1, B: 1}  # each instance started once
        self.drains: dict[str, DrainAction] = {}
        self.answered: list[tuple[str, Track]] = []  # (name, its track in the report when answered)
        self.drained: set[str] = set()
        self.surge = 0
        self.fail_report: OSError | None = None

    def read_report(self) -> HealthReport:
        return self.report

    def write_report(self, report: HealthReport) -> None:
        if self.fail_report is not None:
            raise self.fail_report
        self.report = report
        self.reports.append(report)

    def read_canary(self) -> Canary | None:
        return None

    def starts_count(self, name: str) -> int:
        return self.starts.get(name, 0)

    def drain_pending(self, name: str) -> bool:
        return name in self.drains

    def read_drain(self, name: str) -> DrainAction | None:
        return self.drains.get(name)

    def answer_drain(self, name: str) -> None:
        del self.drains[name]
        self.answered.append((name, self.report.track(name)))

    def drained_by_hand(self, name: str) -> bool:
        return name in self.drained

    def rollout_surge(self) -> int:
        return self.surge

    def write_upstreams(self, text: str) -> None:
        self.upstreams.append(text)

    def down(self) -> set[str]:
        """The instances the last upstreams written marks down (in the API's pool)."""
        api = self.upstreams[-1].split("upstream cvlb_ui")[0]
        return {name for mark, name in re.findall(r"server \S+ max_fails=0( down)?;\s+# (\S+)", api) if mark}


class FakeBoard:
    def __init__(self) -> None:
        self.slots: set[int] = set()
        self.configured: list[tuple[bool, float]] = []

    def configure(self, work: bool, slack: float) -> None:
        self.configured.append((work, slack))

    def set_rotation(self, slots) -> None:
        self.slots = set(slots)

    def rotation(self) -> set[int]:
        return set(self.slots)


class Rig:
    def __init__(self, files: MemoryFiles | None = None, board: FakeBoard | None = None, **changes) -> None:
        self.files, self.board = files or MemoryFiles(), board
        self.clock, self.monotonic = Clock(), Clock(50.0)
        self.sup, self.prober = FakeSupervisor(self.clock), FakeProber()
        self.boards_asked: list[Path] = []
        self.settings = Settings(
            **{"probe_interval": 1.0, "fail_threshold": 2, "recover_threshold": 2, "start_retries": 2, **changes}
        )
        self.loop = HealthLoop(
            NOWHERE,
            self.settings,
            SLOTS,
            self.sup,
            self.prober,
            FakeHost(),
            clock=self.clock,
            rng=random.Random(0),
            files=self.files,
            open_board=self.open_board,
            monotonic=self.monotonic,
        )

    def open_board(self, path: Path) -> FakeBoard:
        self.boards_asked.append(path)
        if self.board is None:
            raise OSError("no room for a board")
        return self.board

    def step(self, times: int = 1) -> None:
        for _ in range(times):
            self.clock.now += self.settings.probe_interval
            self.loop.step()


@pytest.fixture
def rigs():
    made: list[Rig] = []

    def make(*args, **kwargs) -> Rig:
        made.append(Rig(*args, **kwargs))
        return made[-1]

    yield make
    for rig in made:
        rig.loop.pool.shutdown()
    assert not NOWHERE.root.exists()


def test_a_pass_that_takes_an_instance_out_writes_the_report_and_the_rotation_through_the_files(rigs):
    rig = rigs(board=FakeBoard())
    assert rig.boards_asked == [NOWHERE.routing_board]
    rig.step(2)  # two good probes each: both in rotation
    assert rig.files.down() == set() and rig.board.rotation() == set()
    rig.step()  # the board takes them in a step after nginx did
    assert rig.board.rotation() == {0, 1} and rig.board.configured == [(True, 0.05)]
    rig.sup.calls.clear()
    rig.prober.set(A, REFUSED)
    rig.step(2)  # two failures: out
    saved = rig.files.report
    assert saved.updated == rig.clock.now and not saved.tracks[A].in_rotation and saved.tracks[B].in_rotation
    assert saved.probe_seconds == {A: 0.0, B: 0.0}  # (the scripted monotonic clock stood still)
    assert saved.pool["wanted"] == 2
    assert rig.files.down() == {A}
    assert rig.board.rotation() == {1}  # off the board before nginx's reload
    assert rig.sup.calls == [HUP, ("signal", A, "KILL")]  # out of nginx's rotation first, then restarted
    assert len(rig.files.reports) == 5  # one report a step


def test_a_drain_request_is_answered_once_the_report_records_it(rigs):
    rig = rigs(board=FakeBoard())
    rig.step(2)
    rig.files.drains[A] = DrainAction.HOLD  # the launcher replaces it
    rig.step()
    assert [name for name, _ in rig.files.answered] == [A] and A not in rig.files.drains
    answered = rig.files.answered[0][1]
    assert (answered.in_rotation, answered.drain_signal) == (False, DrainAction.HOLD)
    assert rig.files.down() == {A}


def test_an_instance_drained_by_hand_stays_out_while_it_would_serve(rigs):
    rig = rigs(board=FakeBoard())
    rig.step(2)
    rig.files.drained.add(A)
    rig.step()
    assert rig.files.report.tracks[A].on_purpose is OnPurpose.DRAINED and rig.files.down() == {A}
    rig.files.drained.discard(A)
    rig.step(2)
    assert rig.files.down() == set()


def test_the_loop_picks_up_the_report_a_previous_loop_left(rigs):
    before = HealthReport(updated=1.0, tracks={A: Track(in_rotation=True, ever_ready=True, restarts=3)})
    rig = rigs(MemoryFiles(before), board=FakeBoard())
    assert rig.loop.tracks[A].restarts == 3 and rig.loop.serving_before == frozenset({A})


def test_without_a_board_the_loop_publishes_to_nginx_alone(rigs):
    rig = rigs(board=None)
    assert rig.loop.board is None
    rig.step(2)
    assert rig.files.down() == set() and rig.sup.calls[-1] == HUP


def test_run_sleeps_out_the_rest_of_each_interval_and_survives_a_failed_step(rigs):
    rig = rigs(board=FakeBoard())
    sleeps: list[float] = []

    def write_report(report: HealthReport) -> None:  # the step took a quarter of a second
        rig.monotonic.now += 0.25
        MemoryFiles.write_report(rig.files, report)

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        rig.files.fail_report = None  # (the disk has room again)
        rig.loop.stopping = len(sleeps) == 2

    rig.files.write_report = write_report  # type: ignore[method-assign]
    rig.files.fail_report = OSError("No space left on device")
    handler = signal.getsignal(signal.SIGTERM)
    try:
        rig.loop.run(sleep=sleep)
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert sleeps == [0.75, 0.75]  # the first step failed (its report not written): tried again
    assert len(rig.files.reports) == 1
