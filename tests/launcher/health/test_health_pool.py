"""The health loop with a pool (cosyvoice_lb/launcher/health/loop.py, its elastic job in
health/elastic.py): warm spares take an empty place in the step that empties it, a surge
roll-out lets more into rotation, and elastic instances start parked slots and drain and
stop one when idle.

Driven step by step against the scripted fakes of test_health_loop (supervisord, probes,
host, clock); the state dir is real.
"""

from __future__ import annotations

import logging
import random
import re

import pytest
from test_health_loop import READY, Clock, FakeHost, FakeSupervisor

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.health.elastic import Seen, follow_load, hold_reason, running_slots
from cosyvoice_lb.launcher.health.loop import HealthLoop
from cosyvoice_lb.launcher.health.probe import Probe
from cosyvoice_lb.launcher.health.rules import pick_recycle
from cosyvoice_lb.launcher.health.scaling import Bounds, Scale
from cosyvoice_lb.launcher.plan.planner import Roles, Slot
from cosyvoice_lb.launcher.state import markers
from cosyvoice_lb.launcher.state.health_report import OnPurpose, Track, read_report
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.markers import DrainAction
from cosyvoice_lb.launcher.state.supervision import ProcessInfo

SLOTS = tuple(Slot(i, 7860 + i, None, 0) for i in range(4))
NAMES = [s.name for s in SLOTS]
I0, I1, I2, I3 = NAMES
BUSY = Probe("ready", inflight=1, waiting=2, busy_seconds=0.1)


class Prober:
    def __init__(self):
        self.answers = {s.port: READY for s in SLOTS}

    def set(self, name: str, probe: Probe) -> None:
        self.answers[SLOTS[NAMES.index(name)].port] = probe

    def probe(self, port: int, timeout: float) -> Probe:
        return self.answers[port]


class Rig:
    def __init__(self, tmp_path, pool: Roles, running: int, room=None, **changes):
        self.layout = Layout(tmp_path)
        self.layout.run.mkdir(exist_ok=True)
        self.layout.nginx_dir.mkdir(exist_ok=True)
        self.clock, self.prober = Clock(), Prober()
        self.sup = FakeSupervisor(self.clock)
        del self.sup.procs["instance-0"], self.sup.procs["instance-1"]
        self.settings = Settings(probe_interval=1.0, fail_threshold=2, recover_threshold=2, start_retries=2, **changes)
        self.room_asked: list[tuple[list[str], list[str]]] = []

        def every_parked(running, parked):
            self.room_asked.append(([s.name for s in running], [s.name for s in parked]))
            return list(parked)

        for i, slot in enumerate(SLOTS):
            if i < running:
                self.start(slot.name, 100 + i)
            else:
                self.sup.set(slot.name, "STOPPED")
        self.loop = HealthLoop(
            self.layout,
            self.settings,
            SLOTS,
            self.sup,
            self.prober,
            FakeHost(),
            clock=self.clock,
            rng=random.Random(0),
            pool=pool,
            room=room or every_parked,
        )

    def start(self, name: str, pid: int) -> None:
        with self.layout.starts(name).open("a") as starts:
            starts.write(f"{pid}\n")
        self.sup.set(name, "RUNNING", pid, uptime=1.0)

    def step(self, times: int = 1) -> None:
        for _ in range(times):
            self.clock.now += self.settings.probe_interval
            self.loop.step()

    def serving(self) -> list[str]:
        """In nginx's rotation, as upstreams.conf says (cvlb_api)."""
        api = self.layout.upstreams_conf.read_text().split("upstream cvlb_ui")[0]
        return [name for mark, name in re.findall(r"max_fails=0( down)?;\s+# (\S+)", api) if not mark]

    def on_purpose(self, name: str) -> OnPurpose | None:
        return self.loop.tracks[name].on_purpose


@pytest.fixture
def rigs():
    made = []

    def make(*args, **kwargs) -> Rig:
        rig = Rig(*args, **kwargs)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.loop.pool.shutdown()


def test_a_warm_spare_takes_a_crashed_instances_place_in_the_same_step(tmp_path, rigs):
    rig = rigs(tmp_path, Roles(serving=2, spares=1), running=3)
    rig.step(2)
    assert rig.serving() == [I0, I1]
    assert rig.on_purpose(I2) is OnPurpose.SPARE and rig.on_purpose(I3) is OnPurpose.PARKED
    assert read_report(rig.layout).pool["wanted"] == 2

    rig.sup.set(I0, "BACKOFF")  # it crashed; supervisord brings it back
    rig.step()
    assert rig.serving() == [I1, I2]  # never fewer than 2 in the rotation nginx reads

    rig.start(I0, 200)
    rig.step(2)  # loaded again and ready: it is the spare now
    assert rig.serving() == [I1, I2]
    assert rig.on_purpose(I0) is OnPurpose.SPARE
    assert not rig.loop.tracks[I0].in_rotation


def test_a_spare_is_not_recycled_away_nor_holds_up_recycling(tmp_path, rigs):
    rig = rigs(tmp_path, Roles(serving=2, spares=1), running=3, max_requests=10)
    rig.step(2)
    rig.prober.set(I0, Probe("ready", served=11))
    rig.step()
    track = rig.loop.tracks[I0]
    assert track.drain_signal is DrainAction.TERM and track.reason.startswith("recycling")
    assert rig.serving() == [I1, I2]


def test_a_surge_roll_out_lets_more_serve_and_its_end_gives_the_last_one_back(tmp_path, rigs):
    rig = rigs(tmp_path, Roles(serving=2), running=2)
    rig.step(2)
    markers.start_rollout(rig.layout, 1)
    rig.start(I2, 300)  # the launcher starts the replacement on a parked slot
    rig.step(2)
    assert rig.serving() == [I0, I1, I2]
    assert read_report(rig.layout).pool["surge"] == 1
    markers.ask_drain(rig.layout, I0, DrainAction.HOLD)  # the old one goes
    rig.step()
    assert rig.serving() == [I1, I2]
    markers.end_rollout(rig.layout)
    rig.step()
    assert rig.serving() == [I1, I2]


def test_elastic_starts_a_parked_slot_after_a_busy_period_and_stops_one_when_idle(tmp_path, rigs, caplog):
    caplog.set_level(logging.INFO, logger="cosyvoice_lb.health")
    rig = rigs(tmp_path, Roles(serving=3, min_serving=1), running=1, scale_up_after=3, idle_release=5)
    rig.step(2)
    assert rig.serving() == [I0] and rig.loop.scale.target == 1
    rig.prober.set(I0, BUSY)
    rig.step(3)
    assert ("start", I1, False) not in rig.sup.calls
    rig.step()
    assert rig.loop.scale.target == 2
    assert ("start", I1, False) in rig.sup.calls and ("start", I2, False) not in rig.sup.calls
    assert rig.room_asked[-1] == ([I0], [I1, I2, I3])
    assert "elastic: scale out: all 1 instance(s) in rotation had a queue" in caplog.text
    decisions = read_report(rig.layout).pool["scale"]["decisions"]
    assert decisions[-1]["target"] == 2 and decisions[-1]["reason"].startswith("scale out")

    rig.start(I1, 301)  # loading: no second decision meanwhile, however busy
    rig.prober.set(I1, Probe("loading"))
    rig.step(6)
    assert rig.loop.scale.target == 2
    rig.prober.set(I1, READY)
    rig.step(2)
    assert rig.serving() == [I0, I1]

    rig.prober.set(I0, READY)  # idle from now
    rig.step(5)
    assert rig.loop.scale.target == 2
    rig.step()
    assert rig.loop.scale.target == 1
    track = rig.loop.tracks[I1]  # the last in rotation goes, drained first
    assert track.drain_signal is DrainAction.STOP and not track.in_rotation
    assert rig.serving() == [I0]
    rig.step()
    assert ("stop", I1, False) in rig.sup.calls
    rig.sup.set(I1, "STOPPED")
    rig.step()
    assert rig.on_purpose(I1) is OnPurpose.PARKED and rig.loop.tracks[I1].ordered == {"scaled_in": 1}
    assert rig.loop.tracks[I1].crashes == 0


def test_elastic_without_memory_for_a_parked_slot_says_so_once(tmp_path, rigs, caplog):
    caplog.set_level(logging.INFO, logger="cosyvoice_lb.health")
    rig = rigs(
        tmp_path,
        Roles(serving=3, min_serving=1),
        running=1,
        room=lambda running, parked: [],
        scale_up_after=2,
        idle_release=600,
    )
    rig.step(2)
    rig.prober.set(I0, BUSY)
    rig.step(6)
    assert not [c for c in rig.sup.calls if c[0] == "start"]
    assert caplog.text.count("no parked slot has memory for one now") == 1


def test_no_scaling_during_a_roll_out(tmp_path, rigs):
    rig = rigs(tmp_path, Roles(serving=3, min_serving=1), running=1, scale_up_after=2)
    rig.step(2)
    markers.start_rollout(rig.layout, 1)
    rig.prober.set(I0, BUSY)
    rig.step(6)
    assert rig.loop.scale.target == 1 and not [c for c in rig.sup.calls if c[0] == "start"]


def test_pick_recycle_counts_spares_and_parked_slots_aside():
    tracks = {
        I0: Track(in_rotation=True),
        I1: Track(in_rotation=True),
        I2: Track(on_purpose=OnPurpose.SPARE),
        I3: Track(),
    }
    due = {I0: "served 11 requests", I1: "", I2: "", I3: ""}
    assert pick_recycle(due, tracks, {}) is None  # without knowing, a spare looks like a missing instance
    assert pick_recycle(due, tracks, {}, standing_by=frozenset({I2, I3})) == (I0, "served 11 requests")


def test_elastic_with_a_spare_judges_the_load_by_the_serving_ones_only(tmp_path, rigs):
    rig = rigs(tmp_path, Roles(serving=3, spares=1, min_serving=1), running=2, scale_up_after=3, idle_release=600)
    rig.step(2)
    assert rig.serving() == [I0] and rig.on_purpose(I1) is OnPurpose.SPARE
    rig.prober.set(I0, BUSY)  # the spare is idle, as spares are: it does not make the load look light
    rig.step(4)
    assert rig.loop.scale.target == 2
    assert rig.serving() == [I0, I1]  # the spare serves at once
    assert ("start", I2, False) in rig.sup.calls  # and a new spare loads


def test_a_roll_out_marker_left_by_a_launcher_that_is_gone_is_dropped(tmp_path, rigs):
    import json
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    rig = rigs(tmp_path, Roles(serving=2, spares=1), running=3)
    rig.layout.rollout.write_text(json.dumps({"surge": 1, "since": 0, "pid": int(gone.stdout)}))
    rig.step(2)
    assert rig.serving() == [I0, I1] and rig.on_purpose(I2) is OnPurpose.SPARE  # the spare stays a spare
    assert not rig.layout.rollout.exists()
    markers.start_rollout(rig.layout, 1)  # this process: alive
    rig.step()
    assert rig.serving() == [I0, I1, I2] and markers.rollout_surge(rig.layout) == 1


# --- the elastic job on its own: what a step saw in, what to keep out ---------------------------


def seen(states: dict[str, str], tracks: dict[str, Track], probes: dict[str, Probe], surge: int = 0) -> Seen:
    processes = {n: ProcessInfo(n, state, 100 + i, 0.0, 1.0, "", 0) for i, (n, state) in enumerate(states.items())}
    return Seen(SLOTS, processes, probes, tracks, frozenset({I0}), surge, spares=0)


def test_follow_load_starts_what_the_room_allows_and_takes_back_the_rest():
    tracks = {I0: Track(in_rotation=True, ever_ready=True), I1: Track(), I2: Track(), I3: Track()}
    saw = seen({I0: "RUNNING", I1: "STOPPED", I2: "STOPPED", I3: "STOPPED"}, tracks, {I0: BUSY})
    bounds = Bounds(low=1, high=4, scale_up_after=2.0, idle_release=600.0)
    busy = Scale(target=2, busy_since=100.0)  # two wanted already, one more due now
    started: list[str] = []
    offered: list[list[str]] = []  # the parked slots the room was asked about

    def room(running, parked):
        offered.append([s.name for s in parked])
        return list(parked[:1])

    followed = follow_load(
        saw,
        busy,
        bounds,
        room=room,
        drained_by_hand=lambda name: name == I2,  # (a drained one is never started)
        start=started.append,
        short_of_room=False,
        now=110.0,
    )
    assert started == [I1] and offered == [[I1, I3]]
    assert followed.scale.target == 2 and followed.short_of_room  # 3 decided, 1 had no memory
    assert followed.drains == {}


def test_follow_load_drains_the_last_one_when_fewer_are_wanted():
    tracks = {name: Track(in_rotation=True, ever_ready=True) for name in (I0, I1)} | {I2: Track(), I3: Track()}
    saw = seen({I0: "RUNNING", I1: "RUNNING", I2: "STOPPED", I3: "STOPPED"}, tracks, {I0: READY, I1: READY})
    bounds = Bounds(low=1, high=4, scale_up_after=2.0, idle_release=5.0)
    followed = follow_load(
        saw,
        Scale(target=2, idle_since=100.0),
        bounds,
        room=lambda running, parked: pytest.fail("no slot to start"),
        drained_by_hand=lambda name: False,
        start=lambda name: pytest.fail(f"{name} started"),
        short_of_room=True,
        now=110.0,
    )
    assert followed.scale.target == 1 and followed.short_of_room  # (said until one starts)
    assert list(followed.drains) == [I1]  # out of the published rotation first
    assert followed.drains[I1].drain_signal is DrainAction.STOP


def test_the_target_holds_during_a_roll_out_and_while_one_loads_or_stops():
    ready = Track(in_rotation=True, ever_ready=True)
    states = {I0: "RUNNING", I1: "RUNNING"}
    assert hold_reason(seen(states, {I0: ready, I1: ready, I2: Track(), I3: Track()}, {}, surge=1), []) == (
        "a roll-out is under way"
    )
    loading = {I0: ready, I1: Track(), I2: Track(), I3: Track()}
    saw = seen(states, loading, {})
    assert [s.name for s in running_slots(saw)] == [I0, I1]
    assert hold_reason(saw, running_slots(saw)) == f"{I1} loading"
    stopping = {I0: ready, I1: Track(ever_ready=True), I2: Track(draining_since=5.0), I3: Track()}
    saw = seen(states, stopping, {})
    assert hold_reason(saw, running_slots(saw)) == f"{I2} stopping"
    scaled_in = {I0: ready, I1: Track(ever_ready=True, drain_signal=DrainAction.STOP), I2: Track(), I3: Track()}
    assert [s.name for s in running_slots(seen(states, scaled_in, {}))] == [I0]
