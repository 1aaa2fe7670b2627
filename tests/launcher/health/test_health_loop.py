"""The health loop (cosyvoice_lb/launcher/health/loop.py) driven step by step against scripted fakes.

supervisord, the probes, the host's process facts and the clock are fakes that the test
changes between steps; the state dir is real, since its files are the protocol (drain
requests, starts files, health.json) and upstreams.conf is what nginx reads. Nothing
sleeps and no process is started: a test plays supervisord's autorestart itself by giving
an instance a new pid.
"""

from __future__ import annotations

import dataclasses
import random
import re
import signal
from dataclasses import dataclass

import pytest

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.health.adapters import StateDir, create_board
from cosyvoice_lb.launcher.health.loop import HealthLoop, Host
from cosyvoice_lb.launcher.health.probe import Probe
from cosyvoice_lb.launcher.health.rules import RESTART_REASONS, pick_recycle, restarts_by_reason
from cosyvoice_lb.launcher.plan.planner import Slot
from cosyvoice_lb.launcher.state import markers
from cosyvoice_lb.launcher.state.health_report import OnPurpose, Track, read_report
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.markers import DrainAction
from cosyvoice_lb.launcher.state.supervision import ProcessInfo, SupervisionError

T0 = 1_700_000_000.0
SLOTS = (Slot(0, 7860, None, 0), Slot(1, 7861, None, 0))
A, B = (slot.name for slot in SLOTS)
PORTS = {slot.name: slot.port for slot in SLOTS}
READY = Probe("ready", busy_seconds=0.1)
LOADING = Probe("loading")
REFUSED = Probe("failed", detail="/ping: ConnectionError")
HUP = ("signal", "nginx", "HUP")  # nginx reloads upstreams.conf


class Clock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeSupervisor:
    """supervisord as the test says it is. Every call is recorded and changes nothing; the
    calls named in ``refuse`` raise SupervisionError (after being recorded)."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.procs: dict[str, ProcessInfo] = {}
        self.calls: list[tuple] = []
        self.refuse: set[str] = set()
        for name, pid in ((A, 100), (B, 101), ("nginx", 50), ("health", 51)):
            self.set(name, "RUNNING", pid)

    def set(self, name: str, state: str, pid: int = 0, uptime: float = 600.0) -> None:
        start = self.clock.now - uptime if pid else 0.0
        self.procs[name] = ProcessInfo(name, state, pid, start=start, now=start, description="", exitstatus=0)

    def processes(self) -> dict[str, ProcessInfo]:
        return {name: dataclasses.replace(p, now=self.clock.now) for name, p in self.procs.items()}

    def _record(self, *call) -> None:
        self.calls.append(call)
        if call[0] in self.refuse:
            raise SupervisionError(f"supervisord refused {call}")

    def signal(self, name: str, signal: str) -> None:
        self._record("signal", name, signal)

    def start(self, name: str, wait: bool = False) -> None:
        self._record("start", name, wait)

    def stop(self, name: str, wait: bool = True) -> None:
        self._record("stop", name, wait)

    def tail(self, name: str, length: int = 4000) -> str:
        self._record("tail", name, length)
        return "RuntimeError: CUDA out of memory\n"


class FakeProber:
    def __init__(self):
        self.answers = {port: READY for port in PORTS.values()}

    def set(self, name: str, probe: Probe) -> None:
        self.answers[PORTS[name]] = probe

    def probe(self, port: int, timeout: float) -> Probe:
        return self.answers[port]


@dataclass(frozen=True)
class FakeProcess:
    """Stands in for a psutil.Process: the loop only hands it back to the host (and logs its pid)."""

    pid: int


class FakeHost(Host):
    """The host's process facts, scripted (no psutil)."""

    def __init__(self):
        self.children_of: dict[int, list] = {}
        self.children_asked: list[int] = []
        self.killed: list[tuple[list, int]] = []  # (processes, signal), empty kills left out
        self.orphans: list = []
        self.orphans_asked: list[tuple[int, int]] = []

    def children(self, pid):
        self.children_asked.append(pid)
        return self.children_of.get(pid, [])

    def kill(self, procs, sig=signal.SIGKILL):
        if procs:
            self.killed.append((list(procs), sig))

    def memory(self, pids):
        return {name: 0 for name in pids}

    def orphan_nginx(self, port, master_pid):
        self.orphans_asked.append((port, master_pid))
        return self.orphans


@dataclass
class Rig:
    loop: HealthLoop
    layout: Layout
    sup: FakeSupervisor
    prober: FakeProber
    host: FakeHost
    clock: Clock

    def step(self, times: int = 1) -> None:
        """The loop's next steps, a probe interval apart."""
        for _ in range(times):
            self.clock.now += self.loop.settings.probe_interval
            self.loop.step()

    def track(self, name: str):
        return self.loop.tracks[name]

    def report(self, name: str) -> Track:
        return read_report(self.layout).tracks[name]

    def down(self) -> set[str]:
        """The instances upstreams.conf marks down (in every upstream alike: API, UI, segments,
        the last resort's)."""
        found = re.findall(r"server \S+ max_fails=0( down)?;\s+# (\S+)", self.layout.upstreams_conf.read_text())
        assert len(found) == 4 * len(SLOTS)
        pools = [found[i * len(SLOTS) : (i + 1) * len(SLOTS)] for i in range(4)]
        assert all(pool == pools[0] for pool in pools)
        return {name for mark, name in pools[0] if mark}

    def restarted(self, name: str, pid: int, state: str = "RUNNING") -> None:
        """supervisord started ``name`` again: a new pid, and its line in the starts file."""
        with self.layout.starts(name).open("a") as starts:
            starts.write(f"{pid}\n")
        self.sup.set(name, state, pid, uptime=1.0)


@pytest.fixture
def make_rig(tmp_path):
    """A loop over two instances that both serve already (unless ``serving=False``); the
    calls made to get there are forgotten."""
    loops = []

    def make(serving: bool = True, **changes) -> Rig:
        layout = Layout(tmp_path)
        layout.run.mkdir(exist_ok=True)
        layout.nginx_dir.mkdir(exist_ok=True)
        settings = Settings(
            **{
                "probe_interval": 1.0,
                "fail_threshold": 2,
                "recover_threshold": 2,
                "hang_timeout": 10.0,
                "drain_timeout": 30.0,
                "start_retries": 2,
                **changes,
            }
        )
        clock, prober, host = Clock(), FakeProber(), FakeHost()
        sup = FakeSupervisor(clock)
        loop = HealthLoop(
            layout,
            settings,
            SLOTS,
            sup,
            prober,
            host,
            clock=clock,
            rng=random.Random(0),
            files=StateDir(layout),  # (the real state files: they are the protocol tested here)
            open_board=create_board,
        )
        loops.append(loop)
        rig = Rig(loop, layout, sup, prober, host, clock)
        if serving:
            for slot in SLOTS:
                layout.starts(slot.name).write_text(f"{sup.procs[slot.name].pid}\n")
            rig.step(settings.recover_threshold)
            assert rig.down() == set() and all(rig.track(s.name).in_rotation for s in SLOTS)
            sup.calls.clear()
        return rig

    yield make
    for loop in loops:
        loop.pool.shutdown()


def test_a_hung_instance_goes_out_then_is_killed_with_its_children_and_comes_back(make_rig):
    rig = make_rig()
    rig.host.children_of[100] = [FakeProcess(300)]  # e.g. a stuck espeak-ng
    # one synthesis stalled past --hang-timeout, another still yielding audio
    rig.prober.set(A, Probe("ready", inflight=2, stalled=(15.0, 3.0)))
    rig.step()
    track = rig.track(A)
    assert (track.in_rotation, track.drain_signal, track.restarts) == (False, DrainAction.KILL, 1)
    assert track.draining_since == rig.clock.now and track.signalled_at == 0.0
    assert rig.down() == {A}
    assert rig.sup.calls == [HUP]  # out of nginx's rotation, not killed in the same step

    rig.step()  # the other synthesis still makes progress: it may finish
    assert rig.sup.calls == [HUP] and rig.track(A).signalled_at == 0.0

    rig.prober.set(A, Probe("ready", inflight=1, stalled=(17.0,)))
    rig.step()
    assert rig.sup.calls == [HUP, ("signal", A, "KILL")]
    assert rig.host.children_asked == [100]
    assert rig.host.killed == [([FakeProcess(300)], signal.SIGKILL)]
    assert rig.track(A).signalled_at == rig.clock.now == rig.report(A).signalled_at

    rig.restarted(A, pid=200)
    rig.prober.set(A, READY)
    rig.step()  # a new process earns its place like any other
    assert rig.down() == {A} and rig.track(A).pid == 200
    rig.step()
    assert rig.down() == set()
    track = rig.track(A)
    assert (track.in_rotation, track.restarts, track.draining_since, track.signalled_at) == (True, 1, 0.0, 0.0)
    assert rig.report(A).in_rotation and rig.report(A).restarts == 1
    assert rig.sup.calls == [HUP, ("signal", A, "KILL"), HUP]
    assert rig.track(B).in_rotation


def test_a_crash_loop_is_given_up_and_stays_stopped_while_the_other_serves(make_rig):
    rig = make_rig(start_retries=2)
    rig.prober.set(A, REFUSED)
    rig.sup.set(A, "EXITED")  # it was ready once: this exit is not a failed start
    rig.step()
    assert rig.down() == {A} and rig.track(A).reason == "process exited"
    for pid in (200, 201, 202):  # supervisord starts it again and again; it never gets ready
        assert not rig.track(A).failed
        rig.restarted(A, pid, state="STARTING")
        rig.step()
        rig.sup.set(A, "BACKOFF")
        rig.step()
    track = rig.track(A)
    assert track.failed == "failed: it exited 3 times in a row without getting ready (--start-retries 2)"
    assert track.failed_at == rig.clock.now and rig.report(A).failed == track.failed
    assert rig.sup.calls == [HUP, ("tail", A, 2000), ("stop", A, False)]

    rig.sup.set(A, "STOPPED")
    rig.step(3)
    assert rig.sup.calls == [HUP, ("tail", A, 2000), ("stop", A, False)]  # nothing more to do
    rig.restarted(A, 300)  # started behind the loop's back, and even ready: stopped again
    rig.prober.set(A, READY)
    rig.step()
    assert rig.sup.calls[-1] == ("stop", A, False) and ("tail", A, 2000) not in rig.sup.calls[3:]
    assert rig.track(A).failed == track.failed and not rig.track(A).in_rotation
    assert rig.down() == {A} and rig.track(B).in_rotation
    assert all(call[1] != B for call in rig.sup.calls)


def test_recycling_drains_one_instance_at_a_time_and_terms_it_once_idle(make_rig):
    rig = make_rig(max_requests=5)
    assert rig.track(A).recycle_at == rig.track(B).recycle_at == 5  # no jitter asked
    rig.prober.set(A, Probe("ready", served=5))
    rig.prober.set(B, Probe("ready", served=4))
    rig.step()
    track = rig.track(A)
    assert (track.drain_signal, track.restarts) == (DrainAction.TERM, 1)
    assert track.reason == "recycling: served 5 requests (--max-requests 5)"
    assert rig.down() == {A}
    assert rig.sup.calls == [HUP]  # idle, but that probe predates nginx's reload

    rig.prober.set(B, Probe("ready", served=9))  # due as well: waits for its turn
    for busy in (Probe("ready", served=6, waiting=1), Probe("ready", served=7, inflight=1)):
        rig.prober.set(A, busy)
        rig.step()
        assert rig.sup.calls == [HUP]
        assert rig.down() == {A} and not rig.track(B).draining_since

    rig.prober.set(A, Probe("ready", served=7))
    rig.step()
    assert rig.sup.calls == [HUP, ("signal", A, "TERM")]
    assert rig.host.children_asked == []  # a TERMed instance takes its children down itself
    assert rig.track(A).signalled_at == rig.clock.now
    rig.step()  # still exiting
    assert rig.sup.calls == [HUP, ("signal", A, "TERM")] and rig.down() == {A}

    rig.restarted(A, 200)
    rig.prober.set(A, READY)
    rig.step()
    assert rig.down() == {A} and not rig.track(B).draining_since  # A does not serve yet
    rig.step()  # A back in rotation: now B's turn
    assert rig.down() == {B}
    assert rig.track(A).in_rotation and rig.track(A).restarts == 1 and rig.track(A).recycle_at == 5
    assert rig.track(B).drain_signal is DrainAction.TERM
    assert rig.sup.calls == [HUP, ("signal", A, "TERM"), HUP]


def test_restart_by_hand_starts_a_given_up_instance_afresh(make_rig, monkeypatch):
    rig = make_rig(start_retries=2)
    rig.layout.starts(A).write_text("100\n201\n202\n203\n")  # three failed starts, then supervisord gave up
    rig.sup.set(A, "FATAL")
    rig.step()
    assert rig.track(A).failed.startswith("failed: supervisord gave up starting it")
    rig.sup.calls.clear()

    answered = []  # what health.json said when the request was answered
    real_answer = markers.answer_drain

    def answer(layout, name):
        answered.append((name, read_report(layout).tracks[name]))
        real_answer(layout, name)

    monkeypatch.setattr(markers, "answer_drain", answer)
    markers.ask_drain(rig.layout, A, DrainAction.TERM)  # what `cosyvoice-lb restart instance-0` writes
    rig.step()  # supervisord still says FATAL
    assert rig.sup.calls == [("start", A, False)]
    track = rig.track(A)
    assert (track.failed, track.reason, track.in_rotation) == ("", "restarted by hand", False)
    assert [(name, saved.failed, saved.reason) for name, saved in answered] == [(A, "", "restarted by hand")]
    assert not rig.layout.drain_request(A).exists()

    rig.restarted(A, 300, state="STARTING")  # the crash count starts afresh: loading, not given up
    rig.prober.set(A, LOADING)
    rig.step()
    assert rig.track(A).reason == "loading" and not rig.track(A).failed
    rig.sup.set(A, "RUNNING", 300, uptime=20.0)
    rig.prober.set(A, READY)
    rig.step(2)
    assert rig.down() == set() and rig.track(A).in_rotation
    assert rig.sup.calls == [("start", A, False), HUP]


def test_hold_takes_an_instance_out_and_marks_it_idle_without_signalling_it(make_rig):
    rig = make_rig()
    rig.prober.set(A, Probe("ready", inflight=1))
    markers.ask_drain(rig.layout, A, DrainAction.HOLD)  # the launcher is about to replace it
    rig.step()
    assert not rig.layout.drain_request(A).exists()  # answered in the step that took it
    track = rig.track(A)
    assert (track.in_rotation, track.drain_signal, track.draining_since) == (False, DrainAction.HOLD, rig.clock.now)
    assert rig.report(A).drain_signal is DrainAction.HOLD and rig.report(A).signalled_at == 0.0
    assert rig.down() == {A}

    rig.step()  # its request is still running
    assert rig.track(A).signalled_at == 0.0
    rig.prober.set(A, READY)
    rig.step()
    assert rig.track(A).signalled_at == rig.clock.now == rig.report(A).signalled_at  # the launcher's cue
    assert rig.sup.calls == [HUP]  # no signal to it: the launcher replaces it
    assert rig.host.children_asked == [] and rig.host.killed == []
    assert rig.down() == {A} and rig.track(B).in_rotation


def test_a_refused_supervisord_call_does_not_stop_the_step(make_rig):
    rig = make_rig()
    rig.sup.refuse.add("signal")
    rig.prober.set(A, REFUSED)
    rig.step(2)  # fail_threshold 2: restarted without a drain (it does not answer)
    assert rig.sup.calls == [HUP, ("signal", A, "KILL")]  # both refused
    track = rig.track(A)
    assert track.reason == "2 probes failed in a row: /ping: ConnectionError"
    assert (track.in_rotation, track.restarts) == (False, 1)
    assert rig.report(A).restarts == 1 and not rig.report(A).in_rotation
    assert rig.down() == {A}


def test_orphaned_nginx_workers_get_a_graceful_quit_while_nginx_is_down(make_rig):
    rig = make_rig()
    rig.host.orphans_asked.clear()
    rig.step()
    assert rig.host.orphans_asked == []  # the same nginx RUNNING, checked before: nothing to look for
    rig.host.orphans = [FakeProcess(61)]
    rig.sup.set("nginx", "BACKOFF", 0)
    rig.step()
    assert rig.host.orphans_asked == [(8080, 0)]
    assert rig.host.killed == [([FakeProcess(61)], signal.SIGQUIT)]


def test_orphans_beside_a_new_running_master_are_found_once(make_rig):
    """With reuseport a new master binds beside the old one's workers and may be RUNNING
    before a step sees it STARTING: it is still looked at, once."""
    rig = make_rig()
    rig.host.orphans = [FakeProcess(61)]
    rig.sup.set("nginx", "RUNNING", 4242)
    rig.host.orphans_asked.clear()
    rig.step()
    assert rig.host.orphans_asked == [(8080, 4242)]
    assert rig.host.killed == [([FakeProcess(61)], signal.SIGQUIT)]
    rig.host.orphans = []
    rig.step()
    rig.step()
    assert rig.host.orphans_asked == [(8080, 4242)] * 2  # (gone: not looked for again)


def test_a_restarted_loop_picks_up_its_tracks_from_health_json(make_rig):
    rig = make_rig(max_requests=5)
    markers.ask_drain(rig.layout, A, DrainAction.TERM)
    rig.step()
    again = HealthLoop(rig.layout, rig.loop.settings, SLOTS, rig.sup, rig.prober, rig.host, clock=rig.clock)
    try:
        assert again.tracks == rig.loop.tracks
        assert again.tracks[A].drain_signal is DrainAction.TERM and again.tracks[A].draining_since
    finally:
        again.pool.shutdown()


def test_a_reload_supervisord_refused_is_tried_again_next_step(make_rig):
    """Otherwise nginx kept the old rotation (sending requests to an instance being killed)
    until the rotation changed again."""
    rig = make_rig()
    rig.sup.refuse.add("signal")
    rig.prober.set(A, REFUSED)
    rig.step(2)  # --fail-threshold 2: out, and killed at once
    assert rig.down() == {A} and rig.sup.calls.count(HUP) == 1
    rig.sup.refuse.clear()
    rig.step()
    assert rig.sup.calls.count(HUP) == 2  # the reload again, now taken
    rig.step()
    assert rig.sup.calls.count(HUP) == 2  # and only until it was taken


def test_a_drain_asked_in_the_step_that_restarts_it_anyway_counts_one_restart(make_rig):
    rig = make_rig()
    rig.prober.set(A, REFUSED)
    rig.step()  # one failed probe
    markers.ask_drain(rig.layout, A, DrainAction.TERM)  # `cosyvoice-lb restart instance-0`
    rig.step()  # the second: restarted now
    assert rig.track(A).restarts == 1
    assert [c for c in rig.sup.calls if c[0] == "signal" and c[1] == A] == [("signal", A, "KILL")]
    assert not markers.drain_pending(rig.layout, A)  # answered: it is being restarted


def restarts(rig: Rig, name: str) -> dict[str, int]:
    """Restarts by reason as the metrics read them: from health.json."""
    return {k: v for k, v in restarts_by_reason(rig.report(name)).items() if v}


def test_restarts_are_counted_by_reason_across_the_new_process(make_rig):
    rig = make_rig(max_requests=5)
    rig.prober.set(A, Probe("ready", inflight=1, stalled=(15.0,)))  # hung
    rig.step(2)
    rig.restarted(A, pid=200)  # the KILL brought it back: not a crash
    rig.prober.set(A, READY)
    rig.step(2)
    assert restarts(rig, A) == {"hang": 1}
    rig.sup.set(A, "EXITED")  # it died on its own: supervisord brings it back
    rig.prober.set(A, REFUSED)
    rig.step()
    rig.restarted(A, pid=201)
    rig.prober.set(A, READY)
    rig.step(2)
    assert restarts(rig, A) == {"hang": 1, "crash": 1}
    markers.ask_drain(rig.layout, A, DrainAction.TERM)  # `cosyvoice-lb restart` / the panel
    rig.step(3)
    rig.restarted(A, pid=202)
    rig.step(2)
    rig.prober.set(B, Probe("ready", served=5))  # its share served: recycled
    rig.step(3)
    rig.restarted(B, pid=300)
    rig.prober.set(B, READY)
    rig.step(2)
    assert restarts(rig, A) == {"hang": 1, "crash": 1, "requested": 1}
    assert restarts(rig, B) == {"recycle": 1}
    assert rig.track(A).restarts == 2 and rig.track(B).restarts == 1  # (the loop's own count: those it ordered)


def test_every_reason_is_there_from_the_start():
    assert restarts_by_reason(Track()) == {reason: 0 for reason in RESTART_REASONS}


def test_the_crash_count_never_dips_while_an_ordered_restart_comes(make_rig):
    """Counted at the order, started later: a count from starts alone would read one crash
    less meanwhile, which Prometheus takes for a counter reset (and then a burst)."""
    rig = make_rig(max_requests=5)
    rig.sup.set(A, "EXITED")  # a crash
    rig.prober.set(A, REFUSED)
    rig.step()
    rig.restarted(A, pid=200)
    rig.prober.set(A, READY)
    rig.step(2)
    seen = [restarts(rig, A).get("crash", 0)]
    rig.prober.set(A, Probe("ready", served=5))  # recycled: ordered now, started seconds later
    for _ in range(4):
        rig.step()
        seen.append(restarts(rig, A).get("crash", 0))
    rig.restarted(A, pid=201)
    rig.prober.set(A, READY)
    for _ in range(3):
        rig.step()
        seen.append(restarts(rig, A).get("crash", 0))
    assert seen == [1] * len(seen) and restarts(rig, A) == {"crash": 1, "recycle": 1}


def test_a_drained_instance_does_not_hold_up_recycling_unless_nothing_else_would_serve(make_rig):
    rig = make_rig(max_requests=5)
    markers.drain_by_hand(rig.layout, B)
    rig.step()
    rig.prober.set(A, Probe("ready", served=5))
    rig.step()  # A due, but B is drained: recycling A would leave nothing serving
    assert not rig.track(A).draining_since
    assert pick_recycle({A: "due", B: ""}, rig.loop.tracks, {}, frozenset({B})) is None
    three = {**rig.loop.tracks, "instance-2": rig.track(A)}  # a third, serving: A may go
    assert pick_recycle({A: "due"}, three, {}, frozenset({B})) == (A, "due")


def test_an_instance_drained_by_hand_stays_out_with_its_process_until_undrained(make_rig):
    rig = make_rig()
    markers.drain_by_hand(rig.layout, A)
    rig.step()
    assert rig.down() == {A} and rig.track(A).on_purpose is OnPurpose.DRAINED and rig.track(A).reason == ""
    rig.step(5)  # still ready, still out: nothing signalled, nothing restarted
    assert rig.down() == {A} and rig.sup.calls == [HUP]
    assert rig.track(A).restarts == 0 and rig.track(B).in_rotation
    assert markers.undrain(rig.layout, A) and not markers.undrain(rig.layout, A)
    rig.step()
    assert rig.down() == set() and rig.track(A).in_rotation and rig.track(A).reason_words == ""


def test_a_drained_instance_that_fails_is_restarted_like_any_other(make_rig):
    rig = make_rig()
    markers.drain_by_hand(rig.layout, A)
    rig.step()
    rig.prober.set(A, REFUSED)
    rig.step(2)
    assert ("signal", A, "KILL") in rig.sup.calls and restarts(rig, A) == {"probe_failures": 1}


def test_the_report_has_each_probes_latency(make_rig):
    rig = make_rig()
    seconds = read_report(rig.layout).probe_seconds
    assert set(seconds) == {A, B} and all(0 <= s < 1 for s in seconds.values())


# --- the routing board ----------------------------------------------------------------------


def board_of(rig: Rig):
    from cosyvoice_lb.instance.routing.board import Board

    board = Board.open(rig.layout.routing_board)
    assert board is not None
    return board


def test_the_board_leaves_an_instance_out_before_nginx_and_takes_it_in_a_step_after(make_rig):
    rig = make_rig()
    board = board_of(rig)
    rig.step()  # (the step after the last reload: nginx has it)
    assert board.rotation() == {0, 1} and board.work() == (True, 0.05)

    # out: off the board in the step that takes it out of nginx (before the reload)
    rig.prober.set(A, REFUSED)
    rig.step(2)
    assert rig.down() == {A} and board.rotation() == {1}

    # in: nginx first; the board a step later, once the reload has taken effect
    rig.prober.set(A, READY)
    rig.step(2)
    assert rig.down() == set() and board.rotation() == {1}
    rig.step()
    assert board.rotation() == {0, 1}


def test_routing_by_work_turns_on_only_once_nginx_has_the_last_resort(make_rig):
    rig = make_rig(serving=False)
    board = board_of(rig)
    assert board.work() == (False, 0.0)  # a fresh board: nobody declines yet
    for slot in SLOTS:
        rig.layout.starts(slot.name).write_text(f"{rig.sup.procs[slot.name].pid}\n")
    rig.step(2)
    assert "backup" in rig.layout.upstreams_conf.read_text() and board.work() == (False, 0.0)
    rig.step()
    assert board.work() == (True, 0.05)


def test_least_connections_is_set_at_once(make_rig):
    rig = make_rig()
    board_of(rig).configure(True, 0.05)  # the last loop's routing by work
    make_rig(serving=False, routing="least-conn", route_slack=0.2)
    assert board_of(rig).work() == (False, 0.2)  # before any step: declines stop at once


# --- bad audio ------------------------------------------------------------------------------

BAD = Probe("bad_audio", detail="a canary synthesis made bad audio: 16000 of 16000 samples are NaN or infinite")


def test_an_instance_that_says_it_makes_bad_audio_goes_out_and_is_killed_in_the_same_step(make_rig):
    """No --fail-threshold to wait for: the instance says so itself."""
    rig = make_rig(fail_threshold=5)
    rig.prober.set(A, BAD)
    rig.step()
    assert rig.down() == {A}
    assert rig.sup.calls == [HUP, ("signal", A, "KILL")]  # out of nginx's rotation first, then killed
    report = rig.report(A)
    assert report.bad_audio == BAD.detail and report.bad_audio_at == rig.clock.now
    assert report.reason == f"it made bad audio: {BAD.detail}" and report.ordered == {"bad_audio": 1}
    assert restarts_by_reason(report)["bad_audio"] == 1
    rig.restarted(A, pid=200)
    rig.prober.set(A, READY)
    rig.step(2)  # a sound new process comes back; the record of what took the last one out stays
    assert rig.down() == set() and rig.report(A).bad_audio == BAD.detail
    assert rig.track(B).in_rotation


def test_a_new_instance_whose_warm_up_keeps_making_bad_audio_is_given_up_on(make_rig):
    rig = make_rig(start_retries=2)
    rig.prober.set(A, BAD)
    kills = 0
    for pid in (200, 201, 202, 203, 204):  # killed for bad audio, started again by supervisord
        rig.step()
        if rig.track(A).failed:
            break
        kills += 1
        rig.restarted(A, pid)
    track = rig.track(A)
    assert kills == 3 + 1  # the first process (ready once) and --start-retries 2 + 1 new ones
    assert track.failed == (
        f"failed: it was started 4 times without getting ready (--start-retries 2); it made bad audio: {BAD.detail}"
    )
    assert ("stop", A, False) in rig.sup.calls and rig.track(B).in_rotation
