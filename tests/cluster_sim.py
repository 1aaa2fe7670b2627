"""A scripted cluster for the lifecycle's unit tests: supervisord, the health loop and nginx as
plain state that moves one step at each ``sleep``, seen through the real diagnosis.

It stands in for what takes a real cluster minutes (instances loading, the loop's probes), so
the ordering rules of up, restart and roll-outs run in milliseconds. The state dir is real
(drain requests, drains by hand and health.json are files in ``tmp_path``), and so are the
lifecycle, the waits, the roll-outs and the diagnosis under test; what happens when is
recorded in :attr:`World.events`. The real cluster runs the same rules in the integration tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.cluster.context import Cluster, Say
from cosyvoice_lb.launcher.cluster.diagnosis import ClusterStatus, Observation, diagnose
from cosyvoice_lb.launcher.plan.planner import Roles, Slot
from cosyvoice_lb.launcher.render.staging import stage
from cosyvoice_lb.launcher.state.health_report import HealthReport, Track, read_report, write_report
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.markers import (
    DrainAction,
    answer_drain,
    drained_by_hand,
    read_drain,
)
from cosyvoice_lb.launcher.state.supervision import ProcessInfo

LOAD_STEPS = 3  # sleeps from a start until the instance answers ready
BAD_AUDIO = "the warm-up synthesis made bad audio: 16000 of 16000 samples of a chunk are NaN or infinite"
SERVICES = ("nginx", "health", "admin", "jobs")


@dataclass
class Program:
    state: str = "STOPPED"
    pid: int = 0
    ready_in: int = 0  # steps until ready (0: ready, or not running)
    signalled: float = 0.0  # a HOLD drain took it out and let it go idle at this time
    bad_seen: float = 0.0  # the health loop saw its warm-up make bad audio at this time
    starting_for: int = 0  # steps supervisord still calls it STARTING (its startsecs)


@dataclass
class World:
    layout: Layout
    settings: Settings
    slots: tuple[Slot, ...]
    roles: Roles
    programs: dict[str, Program] = field(default_factory=dict)
    rotation: set[str] = field(default_factory=set)
    events: list[tuple] = field(default_factory=list)
    serving_seen: list[int] = field(default_factory=list)  # instances serving after each step
    crashing: set[str] = field(default_factory=set)  # these fail to start (FATAL)
    bad_audio: set[str] = field(default_factory=set)  # these load, then their warm-up makes bad audio
    given_up: dict[str, float] = field(default_factory=dict)  # the health loop gave up on these, when
    reload_answer: tuple[list[str], list[str], list[str]] = ([], [], [])
    room: int = 99  # parked slots there is memory for
    now: float = 1000.0
    next_pid: int = 100

    # --- supervisord ------------------------------------------------------------------------

    @property
    def supervisor(self) -> World:
        return self

    def running(self) -> bool:
        return True

    def start_daemon(self) -> None:
        self.events.append(("supervisord",))

    def processes(self) -> dict[str, ProcessInfo]:
        return {
            name: ProcessInfo(
                name,
                "STARTING" if p.starting_for and p.state == "RUNNING" else p.state,
                p.pid,
                self.now - 10,
                self.now,
                "",
                0,
            )
            for name, p in self.programs.items()
        }

    def start(self, name: str, wait: bool = False) -> None:
        self.events.append(("start", name))
        program = self.programs[name]
        if program.state == "RUNNING":
            return
        if name in self.crashing:
            program.state, program.pid = "FATAL", 0
            return
        self.next_pid += 1
        program.state, program.pid, program.signalled = "RUNNING", self.next_pid, 0.0
        program.ready_in = 0 if name in SERVICES else LOAD_STEPS

    def stop(self, name: str, wait: bool = True) -> None:
        self.events.append(("stop", name))
        program = self.programs[name]
        program.state, program.pid, program.ready_in = "STOPPED", 0, 0
        self.rotation.discard(name)

    def tail(self, name: str, length: int = 4000) -> str:
        return ""

    def reload(self) -> tuple[list[str], list[str], list[str]]:
        self.events.append(("reload",))
        return self.reload_answer

    def add_group(self, name: str) -> None:
        self.events.append(("add_group", name))
        self.programs.setdefault(name, Program())

    def remove_group(self, name: str) -> None:
        self.events.append(("remove_group", name))
        self.stop(name)

    # --- nginx ------------------------------------------------------------------------------

    @property
    def nginx(self) -> World:
        return self

    def apply(self, settings: Settings, say: Say) -> None:
        self.events.append(("nginx", settings.listen_host))

    def replace_program(self, settings: Settings) -> None:
        self.events.append(("nginx", settings.listen_host))

    def restarted(self, settings: Settings) -> None:
        self.events.append(("nginx restarted",))

    def lagging(self, settings: Settings) -> bool:
        return False

    # --- the clock and the health loop ------------------------------------------------------

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        """Time passes: instances load, and the health loop takes one step."""
        self.now += max(seconds, 0.01)
        for program in self.programs.values():
            program.ready_in = max(0, program.ready_in - 1)
            program.starting_for = max(0, program.starting_for - 1)
        if self.programs.get("health", Program()).state == "RUNNING":
            self.health_step()
        self.serving_seen.append(sum(1 for i in self.read_status().instances if i.serving))

    def health_step(self) -> None:
        for slot in self.slots:
            name = slot.name
            action = read_drain(self.layout, name)
            program = self.programs[name]
            if action is not None:
                self.events.append(("drain", name, action.value))
                self.rotation.discard(name)
                if action is DrainAction.TERM:
                    self.stop(name)
                    self.start(name)
                elif action is DrainAction.STOP:
                    self.stop(name)
                else:
                    program.signalled = self.now
                answer_drain(self.layout, name)
            elif self.loaded(name) and name in self.bad_audio:  # (the real loop restarts it, too)
                self.rotation.discard(name)
                program.bad_seen = program.bad_seen or self.now
            elif self.ready(name) and not drained_by_hand(self.layout, name) and not program.signalled:
                self.rotation.add(name)
        write_report(
            self.layout, HealthReport(updated=self.now, tracks=self.tracks(), pool={"wanted": self.roles.serving})
        )

    def tracks(self) -> dict[str, Track]:
        tracks = {}
        for slot in self.slots:
            program = self.programs[slot.name]
            failed = "failed: supervisord gave up" if program.state == "FATAL" else ""
            if slot.name in self.given_up:
                failed = "failed: it was started 2 times without getting ready (--start-retries 0)"
            tracks[slot.name] = Track(
                in_rotation=slot.name in self.rotation,
                pid=program.pid,
                signalled_at=program.signalled,
                failed=failed,
                failed_at=self.given_up.get(slot.name, self.now) if failed else 0.0,
                bad_audio=BAD_AUDIO if program.bad_seen else "",
                bad_audio_at=program.bad_seen,
            )
        return tracks

    def loaded(self, name: str) -> bool:
        program = self.programs[name]
        return program.state == "RUNNING" and program.ready_in == 0

    def ready(self, name: str) -> bool:
        return self.loaded(name) and name not in self.bad_audio

    def ping(self, name: str) -> dict:
        if name in self.bad_audio:
            return {"ready": False, "state": "bad-audio", "error": BAD_AUDIO}
        return {"ready": True}

    # --- what the lifecycle reads -----------------------------------------------------------

    def read_status(self) -> ClusterStatus:
        return diagnose(
            Observation(
                settings=self.settings,
                slots=self.slots,
                roles=self.roles,
                programs=self.processes(),
                health=read_report(self.layout),
                pings={s.name: self.ping(s.name) for s in self.slots if self.loaded(s.name)},
                nginx_answer=200,
                drained=frozenset(s.name for s in self.slots if drained_by_hand(self.layout, s.name)),
                now=self.now,
            )
        )

    def cluster(self, settings: Settings | None = None) -> Cluster:
        return Cluster(
            layout=self.layout,
            settings=settings or self.settings,
            supervisor=self,
            nginx=self,
            read_status=self.read_status,
            room=lambda running, parked: list(parked)[: self.room],
            progress=lambda p: None,
            clock=self.clock,
            wall=self.clock,
            sleep=self.sleep,
        )

    def pid(self, name: str) -> int:
        return self.programs[name].pid

    def index(self, event: tuple) -> int:
        return self.events.index(event)


def world(tmp_path, instances: int = 3, serving: int | None = None, parked: int = 0, **settings) -> World:
    """A cluster of ``instances`` slots, the first ``serving`` started and in rotation (all
    by default), the last ``parked`` stopped; nginx, the health loop and the panel running."""
    layout = Layout(tmp_path)
    layout.run.mkdir(parents=True, exist_ok=True)
    stage(layout.instance_lib)  # (the code it runs: a restart stages nothing new)
    slots = tuple(Slot(index=i, port=7860 + i, gpu=None, memory=1) for i in range(instances))
    started = instances - parked if serving is None else serving
    w = World(layout, Settings(**settings), slots, Roles(serving=started))
    for name in SERVICES:
        w.programs[name] = Program()
        w.start(name)
    for slot in slots:
        w.programs[slot.name] = Program()
        if slot.index < started:
            w.start(slot.name)
            w.programs[slot.name].ready_in = 0
            w.rotation.add(slot.name)
    w.health_step()
    w.events.clear()
    return w
