"""The health loop: probe every instance, judge it (``health.judge``), act on the verdict.

A supervisord program of the cluster. Each step probes ``/ping`` of all instances at once,
takes the launcher's drain requests (``markers``), rewrites nginx's rotation when it
changed (it is the only writer of ``upstreams.conf`` while the cluster runs) and reloads
nginx gracefully, and restarts an instance by signal through supervisord
(``autorestart`` brings it back): a hung process may ignore SIGTERM, and KILL is the
fastest way back to serving.

Everything it works with is passed in: settings and slots, the supervisor adapter, the
prober, the host's process facts, the state dir's files and the routing board
(``health.adapters``), clocks, a sleep and a random source; tests script them, and
:func:`main` wires the real ones. An elastic pool's following of the load is ``health.elastic``'s job, which
the loop calls each step.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.timeouts import SUPERVISOR_POLL, Timeouts
from cosyvoice_lb.launcher.health.adapters import (
    Host,
    Probing,
    RoutingBoard,
    StateDir,
    StateFiles,
    Supervision,
    create_board,
)
from cosyvoice_lb.launcher.health.elastic import Room, Seen, follow_load
from cosyvoice_lb.launcher.health.probe import Probe, Prober
from cosyvoice_lb.launcher.health.rotation import is_parked, rotation, spares_of
from cosyvoice_lb.launcher.health.rules import (
    ALIVE,
    Policy,
    count_crashes,
    count_restart,
    drain_done,
    judge,
    pick_recycle,
    recycle_due,
    start_drain,
)
from cosyvoice_lb.launcher.health.scaling import Bounds, Scale, schedule_notes
from cosyvoice_lb.launcher.plan.footprint import room_to_start
from cosyvoice_lb.launcher.plan.planner import Roles, Slot
from cosyvoice_lb.launcher.render.cluster import overflow_of, render_upstreams
from cosyvoice_lb.launcher.state import record
from cosyvoice_lb.launcher.state.health_report import HealthReport, OnPurpose, Track
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.markers import DrainAction
from cosyvoice_lb.launcher.state.supervision import ProcessInfo, ProgramState, SupervisionError, Supervisor

log = logging.getLogger("cosyvoice_lb.health")


class HealthLoop:
    def __init__(
        self,
        layout: Layout,
        settings: Settings,
        slots: tuple[Slot, ...],
        supervisor: Supervision,
        prober: Probing,
        host: Host | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        pool: Roles | None = None,
        room: Room | None = None,
        *,
        files: StateFiles | None = None,
        open_board: Callable[[Path], RoutingBoard] = create_board,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        """``files``: the state dir's (:class:`StateDir` over ``layout`` when None);
        ``open_board``: makes the routing board at a path; ``clock``: epoch seconds (the
        report's), ``monotonic``: the probes' and the steps' durations."""
        self.layout, self.settings, self.slots = layout, settings, slots
        self.files: StateFiles = files if files is not None else StateDir(layout)
        self.monotonic = monotonic
        self.nginx_checked = 0  # (the nginx master last found RUNNING with no orphan beside it)
        # A model roll-out's canary (read at start: `canary start` and `abort` restart the
        # loop): probed like any instance, never in the serving rotation, in pools of its own.
        self.canary = self.files.read_canary()
        self.canary_slots = frozenset(self.canary.slots) if self.canary else frozenset()
        self.roles = pool or Roles(serving=len(slots))
        self.room: Room = room or (lambda running, parked: room_to_start(settings, running, parked))
        self.bounds = Bounds.of(self.roles, settings) if self.roles.elastic else None
        for note in schedule_notes(settings, self.roles):  # (said once, at the start)
            log.warning("%s", note)
        self.policy = Policy.from_settings(settings)
        self.timeouts = Timeouts(settings)
        self.supervisor, self.prober, self.host = supervisor, prober, host or Host()
        self.clock, self.rng = clock, rng or random.Random()
        saved = self.files.read_report()  # pick up where a previous loop left off (the loop may be restarted)
        self.tracks = {slot.name: saved.track(slot.name) for slot in self.slots}
        self.scale = Scale.from_dict(saved.pool.get("scale"), self.bounds) if self.bounds else None
        self.wanted = self.roles.serving
        self.surge = 0
        self.short_of_room = False  # a scale-out found no memory (said once, until one starts)
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(slots)))
        self.published: frozenset[str] | None = None
        self.serving_before = frozenset(name for name, t in self.tracks.items() if t.in_rotation)
        self.board = self._open_board(open_board)
        self.board_current = False  # the board shows the published rotation
        self.pids: dict[str, int] = {}
        self.taken: list[str] = []
        self.probe_seconds: dict[str, float] = {}
        self.stopping = False

    def _open_board(self, open_board: Callable[[Path], RoutingBoard]) -> RoutingBoard | None:
        """The routing board (instances read it at each request). Routing by least
        connections is set at once; routing by work only once nginx has the last resort (see
        :meth:`mark_board`)."""
        try:
            board = open_board(self.layout.routing_board)
        except OSError as exc:
            log.warning("no routing board (%s): nginx balances by least connections alone", exc)
            return None
        if self.settings.routing != "work":
            board.configure(False, self.settings.route_slack)
        return board

    def _serving(self, out: frozenset[str]) -> set[int]:
        """The slots in rotation when ``out`` are out of it."""
        return {slot.index for slot in self.slots if slot.name not in out and slot.name not in self.canary_slots}

    def mark_board(self) -> None:
        """A step after nginx's reload (which takes effect a moment after the signal): the
        board takes in what nginx now serves, and routing by work turns on once nginx has
        the last resort that serves what every instance declines."""
        if self.board is None or self.published is None or self.board_current:
            return
        self.board.set_rotation(self._serving(self.published))
        self.board.configure(self.settings.routing == "work", self.settings.route_slack)
        self.board_current = True

    def step(self) -> None:
        processes = self.supervisor.processes()
        self.pids = {name: p.pid for name, p in processes.items() if p.pid}
        self.clear_orphan_nginx(processes.get("nginx"))
        timed = dict(zip([s.name for s in self.slots], self.pool.map(self.timed_probe, self.slots)))
        probes = {name: probe for name, (probe, _) in timed.items()}
        self.probe_seconds = {name: seconds for name, (_, seconds) in timed.items()}
        now = self.clock()
        kills: list[str] = []
        self.taken = []  # drain requests handled this step (answered once saved)
        before_step = dict(self.tracks)
        for slot in self.slots:
            name, before = slot.name, self.tracks[slot.name]
            starts = self.files.starts_count(name)
            if before.failed and self.files.drain_pending(name):  # `restart NAME` after a crash loop
                # Start it here: the snapshot above still says FATAL or STOPPED, and judging
                # that would give it up again. Its crash count starts afresh.
                log.info("%s: restarted by hand after it was given up on", name)
                self.tracks[name] = Track(
                    reason="restarted by hand",
                    ready_starts=starts,
                    restarts=before.restarts,
                    ordered=count_restart(before, "requested").ordered,
                    crashes=before.crashes,
                )
                self.taken.append(name)
                self._call(name, "start", lambda: self.supervisor.start(name))
                continue
            verdict = judge(before, processes.get(name), probes[name], self.policy, starts, now)
            track = count_crashes(verdict.track, starts)
            # Drained by hand (the panel, `drain`): kept out while it would serve, process and all.
            if track.in_rotation and self.files.drained_by_hand(name):
                track = dataclasses.replace(track, in_rotation=False, on_purpose=OnPurpose.DRAINED, reason="")
            if verdict.give_up:
                if not before.failed:
                    log.error(
                        "%s: given up, stopped until restarted by hand: %s; last log lines:\n%s",
                        name,
                        verdict.give_up,
                        self.supervisor.tail(name, 2000).strip()[-1500:],
                    )
                # (exited meanwhile: stopped on a later step)
                self._call(name, "stop", lambda: self.supervisor.stop(name, wait=False))
            elif verdict.restart and verdict.drain:
                log.warning(
                    "%s: out of rotation; restarting once nothing in flight makes progress (at most %gs): %s",
                    name,
                    self.policy.drain_timeout,
                    verdict.restart,
                )
                track = start_drain(
                    dataclasses.replace(track, restarts=before.restarts, ordered=before.ordered),
                    verdict.restart,
                    DrainAction.KILL,
                    now,
                    verdict.kind,
                )
            elif verdict.restart:
                log.warning("%s: out of rotation and restarting: %s", name, verdict.restart)
                kills.append(name)
            self.tracks[name] = track
        self.take_requests(processes, now, killing=kills)
        self.recycle(processes, probes, now)
        self.balance(processes, probes, now)
        self.log_rotation(before_step)
        self.publish()  # out of nginx's rotation first, then stop
        for name in kills:
            self._signal(name, DrainAction.KILL)
        self.finish_draining(probes, now)
        self.save(now)
        for name in self.taken:  # the launcher waits for these to go: only after health.json says so
            self.files.answer_drain(name)

    def take_requests(self, processes: dict[str, ProcessInfo], now: float, killing: Sequence[str] = ()) -> None:
        """The launcher asks for drained stops with a file per instance (one restarted in this
        step anyway needs no second stop: answered as is)."""
        for slot in self.slots:
            if slot.name in self.taken:
                continue
            if slot.name in killing:
                if self.files.drain_pending(slot.name):
                    self.taken.append(slot.name)
                continue
            action = self.files.read_drain(slot.name)
            if action is None:
                continue
            track, process = self.tracks[slot.name], processes.get(slot.name)
            if process and process.state in ALIVE and not track.draining_since and not track.signalled_at:
                what = {DrainAction.HOLD: "replaced by the launcher", DrainAction.STOP: "stopped (parked)"}.get(
                    action, "stopped"
                )
                log.info("%s: restart requested: out of rotation, %s once idle", slot.name, what)
                kind = "replaced" if action in (DrainAction.HOLD, DrainAction.STOP) else "requested"
                self.tracks[slot.name] = start_drain(track, "restart requested", action, now, kind)
            self.taken.append(slot.name)  # not running, or already on its way: nothing more to do

    def recycle(self, processes: dict[str, ProcessInfo], probes: dict[str, Probe], now: float) -> None:
        """Start a drained restart of one instance that served its share or grew too big."""
        policy = self.policy
        if not (policy.max_requests or policy.max_memory):
            return
        memory: dict[str, int] = {}
        if policy.max_memory:
            memory = self.host.memory(
                {s.name: processes[s.name].pid for s in self.slots if s.name in processes and processes[s.name].pid}
            )
        candidates = {}
        for slot in self.slots:
            track = self.tracks[slot.name]
            if track.ever_ready and not track.recycle_at and policy.max_requests:
                jitter = self.rng.randint(0, policy.max_requests_jitter) if policy.max_requests_jitter else 0
                track = self.tracks[slot.name] = dataclasses.replace(track, recycle_at=policy.max_requests + jitter)
            candidates[slot.name] = recycle_due(track, probes[slot.name], memory.get(slot.name, 0), policy)
        uptimes = {name: p.uptime for name, p in processes.items()}
        drained = frozenset(s.name for s in self.slots if self.files.drained_by_hand(s.name))
        standing_by = frozenset(
            name
            for name, t in self.tracks.items()
            if t.on_purpose is OnPurpose.SPARE
            or (name in processes and is_parked(processes[name].state, bool(t.failed)))
        )
        picked = pick_recycle(candidates, self.tracks, uptimes, drained, standing_by)
        if picked:
            name, reason = picked
            log.info("%s: recycling (drained restart): %s", name, reason)
            self.tracks[name] = start_drain(self.tracks[name], f"recycling: {reason}", DrainAction.TERM, now, "recycle")

    def balance(self, processes: dict[str, ProcessInfo], probes: dict[str, Probe], now: float) -> None:
        """How many serve: the plan's number (elastic: the scaler's), plus a surge roll-out's
        extra ones; the other ready instances wait out of rotation as warm spares."""
        self.surge = self.files.rollout_surge()
        if self.bounds is not None and self.scale is not None:
            serving_slots = tuple(s for s in self.slots if s.name not in self.canary_slots)
            seen = Seen(
                serving_slots, processes, probes, self.tracks, self.serving_before, self.surge, self.roles.spares
            )
            followed = follow_load(
                seen,
                self.scale,
                self.bounds,
                room=self.room,
                drained_by_hand=self.files.drained_by_hand,
                start=self._start,
                short_of_room=self.short_of_room,
                now=now,
            )
            self.scale, self.short_of_room = followed.scale, followed.short_of_room
            self.tracks.update(followed.drains)
            self.wanted = self.scale.target
        else:
            self.wanted = self.roles.serving
        eligible = [s.name for s in self.slots if self.tracks[s.name].in_rotation and s.name not in self.canary_slots]
        # (in rotation at the end of the last step: self.published may lag a refused reload)
        before = [name for name in eligible if name in self.serving_before]
        chosen = rotation(eligible, before, self.wanted + self.surge)
        for name in spares_of(eligible, chosen):
            self.tracks[name] = dataclasses.replace(
                self.tracks[name], in_rotation=False, on_purpose=OnPurpose.SPARE, reason=""
            )
        self.serving_before = frozenset(chosen)

    def log_rotation(self, before: dict[str, Track]) -> None:
        for slot in self.slots:
            was, now = before[slot.name], self.tracks[slot.name]
            if was.in_rotation != now.in_rotation:
                log.info(
                    "%s: %s rotation%s",
                    slot.name,
                    "back in" if now.in_rotation else "out of",
                    f" ({now.reason_words})" if now.reason_words and not now.in_rotation else "",
                )

    def finish_draining(self, probes: dict[str, Probe], now: float) -> None:
        """Act on instances whose planned stop may happen now. TERM: the instance drains
        itself too, exits, and supervisord starts it again; KILL: it is hung; HOLD: the
        launcher replaces it. One that outlives its TERM by far is KILLed."""
        for slot in self.slots:
            track = self.tracks[slot.name]
            if track.signalled_at and now - track.signalled_at > self.timeouts.kill_after_term:
                log.warning("%s: still running %.0fs after TERM: KILL", slot.name, now - track.signalled_at)
                self._signal(slot.name, DrainAction.KILL)
                self.tracks[slot.name] = dataclasses.replace(track, signalled_at=now)
            # (Not in the step that took it out: that probe predates nginx's reload, and
            # requests may still have been sent to it since.)
            elif (
                track.draining_since
                and track.draining_since < now
                and not track.signalled_at
                and drain_done(track, probes[slot.name], self.policy, now)
            ):
                if track.drain_signal is DrainAction.STOP:  # scaled in: supervisord leaves it stopped
                    self._stop(slot.name)
                elif track.drain_signal is not DrainAction.HOLD:
                    self._signal(slot.name, track.drain_signal or DrainAction.TERM)
                self.tracks[slot.name] = dataclasses.replace(track, signalled_at=now)

    def clear_orphan_nginx(self, nginx: ProcessInfo | None) -> None:
        """Workers of a SIGKILLed nginx master keep the public port, so the master that
        supervisord starts next can never bind it -- or, with ``reuseport``, binds beside
        them, and they serve on with the old config. QUIT is their graceful stop: they close
        the port at once and finish what they are serving. Looked for while nginx is not
        RUNNING, and once for each new master that is (the few seconds it is STARTING may
        fall between two steps)."""
        if nginx is None or (nginx.state == ProgramState.RUNNING and nginx.pid == self.nginx_checked):
            return
        orphans = self.host.orphan_nginx(self.settings.port, nginx.pid)
        if nginx.state == ProgramState.RUNNING and not orphans:
            self.nginx_checked = nginx.pid
        if orphans:
            log.warning(
                "nginx: gracefully stopping %d orphaned worker(s) holding port %d (pids %s)",
                len(orphans),
                self.settings.port,
                ", ".join(str(p.pid) for p in orphans),
            )
            self.host.kill(orphans, signal.SIGQUIT)

    def _call(self, name: str, what: str, call: Callable[[], None]) -> bool:
        try:
            call()
        except SupervisionError as exc:  # it may have changed state on its own meanwhile
            log.warning("%s: %s failed: %s", name, what, exc)
            return False
        return True

    def _start(self, name: str) -> None:
        self._call(name, "start", lambda: self.supervisor.start(name))

    def _stop(self, name: str) -> None:
        self._call(name, "stop", lambda: self.supervisor.stop(name, wait=False))

    def _signal(self, name: str, action: DrainAction) -> None:
        """Signal an instance through supervisord. A KILL takes its child processes along
        (they may run in their own sessions, e.g. a stuck espeak-ng or model workers holding
        GPU memory, and would outlive it)."""
        children = self.host.children(self.pids[name]) if action is DrainAction.KILL and self.pids.get(name) else []
        self._call(name, action.value, lambda: self.supervisor.signal(name, action.value))
        self.host.kill(children)

    def publish(self) -> None:
        """Rewrite upstreams.conf and reload nginx when the rotation changed. The board
        leaves an instance out before nginx does and takes one in a step after nginx did: no
        instance declines a request for one nginx would not send it to."""
        out = frozenset(name for name, track in self.tracks.items() if not track.in_rotation)
        if out == self.published:
            self.mark_board()
            return
        if self.board is not None:  # the leaving leave the board now
            self.board.set_rotation(self.board.rotation() & self._serving(out))
        self.board_current = False
        self.files.write_upstreams(
            render_upstreams(self.slots, out, overflow_of(self.settings, self.layout), self.canary)
        )
        # Published once nginx took it: a reload supervisord refused (busy, or nginx down
        # for a moment) is tried again next step.
        if not self._call("nginx", "reload", lambda: self.supervisor.signal("nginx", "HUP")):
            return
        self.published = out
        serving = [s.name for s in self.slots if s.name not in out and s.name not in self.canary_slots]
        canary = [name for name in sorted(self.canary_slots) if name not in out]
        log.info("rotation: %s%s", ", ".join(serving) or "none", f"; canary: {', '.join(canary)}" if canary else "")

    def save(self, now: float) -> None:
        report = HealthReport(
            updated=now,
            tracks=dict(self.tracks),
            probe_seconds={name: round(seconds, 6) for name, seconds in self.probe_seconds.items()},
            pool={
                "wanted": self.wanted,
                **self.roles.as_dict(),
                "surge": self.surge,
                **({"scale": self.scale.as_dict()} if self.scale is not None else {}),
            },
        )
        self.files.write_report(report)

    def timed_probe(self, slot: Slot) -> tuple[Probe, float]:
        """A probe of one instance and the seconds it took (the metrics' probe latency)."""
        started = self.monotonic()
        found = self.prober.probe(slot.port, self.settings.probe_timeout)
        return found, self.monotonic() - started

    def run(self, sleep: Callable[[float], None] = time.sleep) -> None:
        """Steps a probe interval apart (``sleep`` waits out the rest of one) until SIGTERM."""
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        log.info(
            "health loop: %d instances, probe every %gs (timeout %gs), out after %d failures, "
            "back after %d good probes, hang timeout %gs",
            len(self.slots),
            self.settings.probe_interval,
            self.settings.probe_timeout,
            self.policy.fail_threshold,
            self.policy.recover_threshold,
            self.policy.hang_timeout,
        )
        while not self.stopping:
            started = self.monotonic()
            try:
                self.step()
            except (SupervisionError, OSError) as exc:  # supervisord busy, a file not writable: next step
                log.warning("health step failed (%s); trying again", exc)
            sleep(max(0.0, self.settings.probe_interval - (self.monotonic() - started)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="cosyvoice-lb health loop (run by supervisord)")
    parser.add_argument("--state-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s health %(levelname)s %(message)s")
    layout = Layout(Path(args.state_dir).resolve())
    found = record.parse(layout.cluster_json.read_text())
    supervisor = Supervisor(layout, timeout=SUPERVISOR_POLL)
    loop = HealthLoop(
        layout,
        found.settings,
        found.slots,
        supervisor,
        Prober(len(found.slots)),
        Host(),
        clock=time.time,
        pool=found.roles,
        files=StateDir(layout),
        open_board=create_board,
        monotonic=time.monotonic,
    )
    loop.run(sleep=time.sleep)


if __name__ == "__main__":
    main()
