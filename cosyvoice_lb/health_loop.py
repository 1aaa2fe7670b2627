"""The health loop: probe every instance, judge it (``health.judge``), act on the verdict.

A supervisord program of the cluster. Each step probes ``/ping`` of all instances at once,
takes the launcher's drain requests (``protocol``), rewrites nginx's rotation when it
changed (it is the only writer of ``upstreams.conf`` while the cluster runs) and reloads
nginx gracefully, and restarts an instance by signal through supervisord
(``autorestart`` brings it back): a hung process may ignore SIGTERM, and KILL is the
fastest way back to serving.

Everything it works with is passed in: settings and slots, the supervisor adapter, the
prober, the host's process facts, a clock and a random source; tests script them.
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
from typing import Protocol

import psutil

from . import protocol
from .files import write_atomic
from .gpu import process_gpu_memory
from .health import (
    ALIVE,
    Policy,
    Track,
    count_crashes,
    count_restart,
    drain_done,
    judge,
    pick_recycle,
    recycle_due,
    start_drain,
    track_from_dict,
    track_to_dict,
)
from .layout import Layout
from .planner import Slot
from .probe import Probe, Prober
from .processes import orphan_nginx
from .protocol import DrainAction
from .render import read_cluster_json, render_upstreams
from .settings import Settings
from .supervision import ProcessInfo, SupervisionError, Supervisor
from .timeouts import SUPERVISOR_POLL, Timeouts

log = logging.getLogger("cosyvoice_lb.health")


class Supervision(Protocol):
    """What the loop asks of supervisord (``supervision.Supervisor``)."""

    def processes(self) -> dict[str, ProcessInfo]: ...
    def start(self, name: str, wait: bool = False) -> None: ...
    def stop(self, name: str, wait: bool = True) -> None: ...
    def signal(self, name: str, signal: str) -> None: ...
    def tail(self, name: str, length: int = 4000) -> str: ...


class Probing(Protocol):
    def probe(self, port: int, timeout: float) -> Probe: ...


class Host:
    """What the loop asks of the operating system (psutil, NVML): an adapter of its own."""

    def children(self, pid: int) -> list[psutil.Process]:
        try:
            return psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            return []

    def kill(self, procs: list[psutil.Process], sig: int = signal.SIGKILL) -> None:
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass

    def memory(self, pids: dict[str, int]) -> dict[str, int]:
        """Per instance, the larger of its RSS and its GPU memory (per process), bytes."""
        gpu = process_gpu_memory(set(pids.values()))
        found = {}
        for name, pid in pids.items():
            try:
                rss = psutil.Process(pid).memory_info().rss
            except psutil.Error:
                rss = 0
            found[name] = max(rss, gpu.get(pid, 0))
        return found

    def orphan_nginx(self, port: int, master_pid: int) -> list[psutil.Process]:
        return orphan_nginx(port, master_pid)


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
    ):
        self.layout, self.settings, self.slots = layout, settings, slots
        self.policy = Policy.from_settings(settings)
        self.timeouts = Timeouts(settings)
        self.supervisor, self.prober, self.host = supervisor, prober, host or Host()
        self.clock, self.rng = clock, rng or random.Random()
        self.tracks = self._load_tracks()
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(slots)))
        self.published: frozenset[str] | None = None
        self.pids: dict[str, int] = {}
        self.taken: list[str] = []
        self.probe_seconds: dict[str, float] = {}
        self.stopping = False

    def _load_tracks(self) -> dict[str, Track]:
        """Pick up where a previous loop left off (the loop itself may be restarted)."""
        saved = protocol.report_tracks(self.layout)
        return {
            slot.name: track_from_dict(saved[slot.name]) if isinstance(saved.get(slot.name), dict) else Track()
            for slot in self.slots
        }

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
        for slot in self.slots:
            name, before = slot.name, self.tracks[slot.name]
            starts = protocol.starts_count(self.layout, name)
            if before.failed and protocol.drain_pending(self.layout, name):  # `restart NAME` after a crash loop
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
            if track.in_rotation and protocol.drained_by_hand(self.layout, name):
                track = dataclasses.replace(track, in_rotation=False, reason=protocol.DRAINED)
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
            elif before.in_rotation != track.in_rotation:
                log.info(
                    "%s: %s rotation%s",
                    name,
                    "back in" if track.in_rotation else "out of",
                    f" ({track.reason})" if track.reason else "",
                )
            self.tracks[name] = track
        self.take_requests(processes, now, killing=kills)
        self.recycle(processes, probes, now)
        self.publish()  # out of nginx's rotation first, then stop
        for name in kills:
            self._signal(name, DrainAction.KILL)
        self.finish_draining(probes, now)
        self.save(now)
        for name in self.taken:  # the launcher waits for these to go: only after health.json says so
            protocol.answer_drain(self.layout, name)

    def take_requests(self, processes: dict[str, ProcessInfo], now: float, killing: Sequence[str] = ()) -> None:
        """The launcher asks for drained stops with a file per instance (one restarted in this
        step anyway needs no second stop: answered as is)."""
        for slot in self.slots:
            if slot.name in self.taken:
                continue
            if slot.name in killing:
                if protocol.drain_pending(self.layout, slot.name):
                    self.taken.append(slot.name)
                continue
            action = protocol.read_drain(self.layout, slot.name)
            if action is None:
                continue
            track, process = self.tracks[slot.name], processes.get(slot.name)
            if process and process.state in ALIVE and not track.draining_since and not track.signalled_at:
                what = "replaced by the launcher" if action is DrainAction.HOLD else "stopped"
                log.info("%s: restart requested: out of rotation, %s once idle", slot.name, what)
                kind = "replaced" if action is DrainAction.HOLD else "requested"
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
        drained = frozenset(s.name for s in self.slots if protocol.drained_by_hand(self.layout, s.name))
        picked = pick_recycle(candidates, self.tracks, uptimes, drained)
        if picked:
            name, reason = picked
            log.info("%s: recycling (drained restart): %s", name, reason)
            self.tracks[name] = start_drain(self.tracks[name], f"recycling: {reason}", DrainAction.TERM, now, "recycle")

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
                if track.drain_signal is not DrainAction.HOLD:
                    self._signal(slot.name, track.drain_signal or DrainAction.TERM)
                self.tracks[slot.name] = dataclasses.replace(track, signalled_at=now)

    def clear_orphan_nginx(self, nginx: ProcessInfo | None) -> None:
        """Workers of a SIGKILLed nginx master keep the public port, so the master that
        supervisord starts next can never bind it. QUIT is their graceful stop: they close
        the port at once (the new master binds it on its next try) and finish what they
        are serving."""
        if nginx is None or nginx.state == "RUNNING":
            return
        orphans = self.host.orphan_nginx(self.settings.port, nginx.pid)
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

    def _signal(self, name: str, action: DrainAction) -> None:
        """Signal an instance through supervisord. A KILL takes its child processes along
        (they may run in their own sessions, e.g. a stuck espeak-ng or model workers holding
        GPU memory, and would outlive it)."""
        children = self.host.children(self.pids[name]) if action is DrainAction.KILL and self.pids.get(name) else []
        self._call(name, action.value, lambda: self.supervisor.signal(name, action.value))
        self.host.kill(children)

    def publish(self) -> None:
        """Rewrite upstreams.conf and reload nginx when the rotation changed."""
        out = frozenset(name for name, track in self.tracks.items() if not track.in_rotation)
        if out == self.published:
            return
        write_atomic(self.layout.upstreams_conf, render_upstreams(self.slots, out))
        # Published once nginx took it: a reload supervisord refused (busy, or nginx down
        # for a moment) is tried again next step.
        if not self._call("nginx", "reload", lambda: self.supervisor.signal("nginx", "HUP")):
            return
        self.published = out
        log.info("rotation: %s", ", ".join(s.name for s in self.slots if s.name not in out) or "none")

    def save(self, now: float) -> None:
        protocol.write_report(
            self.layout,
            {name: track_to_dict(t) for name, t in self.tracks.items()},
            now,
            probes={name: round(seconds, 6) for name, seconds in self.probe_seconds.items()},
        )

    def timed_probe(self, slot: Slot) -> tuple[Probe, float]:
        """A probe of one instance and the seconds it took (the metrics' probe latency)."""
        started = time.monotonic()
        found = self.prober.probe(slot.port, self.settings.probe_timeout)
        return found, time.monotonic() - started

    def run(self, sleep: Callable[[float], None] = time.sleep) -> None:
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
            started = time.monotonic()
            try:
                self.step()
            except (SupervisionError, OSError) as exc:  # supervisord busy, a file not writable: next step
                log.warning("health step failed (%s); trying again", exc)
            sleep(max(0.0, self.settings.probe_interval - (time.monotonic() - started)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="cosyvoice-lb health loop (run by supervisord)")
    parser.add_argument("--state-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s health %(levelname)s %(message)s")
    layout = Layout(Path(args.state_dir).resolve())
    settings, slots = read_cluster_json(layout.cluster_json.read_text())
    HealthLoop(layout, settings, slots, Supervisor(layout, timeout=SUPERVISOR_POLL), Prober(len(slots))).run()


if __name__ == "__main__":
    main()
