"""The health loop: probe every instance, judge it, and act on the verdict.

:func:`judge` is pure (one instance's memory, supervisord's view and a probe in; the new
memory and whether to restart out), so every rule is tested without sleeping. The loop
around it (a supervisord program of the cluster) probes ``/ping`` of all instances at
once, rewrites nginx's upstreams when rotation changes and reloads nginx gracefully, and
restarts an instance by SIGKILL through supervisord (``autorestart`` brings it back): a
hung process may ignore SIGTERM, and KILL is the fastest way back to serving.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests

from .files import write_atomic
from .gpu import process_gpu_memory
from .processes import orphan_nginx
from .render import Layout, read_cluster_json, render_upstreams
from .settings import Settings
from .supervision import ProcessInfo, Supervisor

log = logging.getLogger("cosyvoice_lb.health")

ALIVE = ("RUNNING", "STARTING")


@dataclass(frozen=True)
class Probe:
    """One ``/ping``: ``ready``, ``loading`` (503 while the model loads) or ``failed``."""

    status: str
    busy_seconds: float = 0.0
    detail: str = ""
    served: int = 0
    inflight: int = 0
    waiting: int = 0
    stalled: tuple[float, ...] = ()  # per synthesis in flight: seconds since its last chunk

    @property
    def stalled_seconds(self) -> float:
        return max(self.stalled, default=0.0)

    def progressing(self, hang_timeout: float) -> int:
        """Syntheses in flight that are still making progress (not hung)."""
        return sum(1 for s in self.stalled if s <= hang_timeout)


@dataclass(frozen=True)
class Track:
    """What the loop remembers about one instance between probes."""

    in_rotation: bool = False
    fails: int = 0
    goods: int = 0
    pid: int = 0
    ever_ready: bool = False  # this pid has answered ready at least once
    reason: str = ""  # why it is out of rotation, or why it was last restarted
    restarts: int = 0  # restarts the loop ordered
    recycle_at: int = 0  # requests after which this process is recycled (0: not set yet)
    # A planned stop: out of rotation since (epoch s; 0: none), then this signal once the
    # requests in flight are done (TERM: it drains and exits; KILL: hung, nothing to wait for;
    # HOLD: none, the launcher replaces it), sent at signalled_at.
    draining_since: float = 0.0
    drain_signal: str = ""
    signalled_at: float = 0.0
    ready_starts: int = 0  # the starts count when it was last ready: crash loops count from here
    failed: str = ""  # given up on (crash loop): why; it stays stopped until restarted by hand
    failed_at: float = 0.0  # when (epoch s)


@dataclass(frozen=True)
class Verdict:
    track: Track
    restart: str = ""  # non-empty: restart now, for this reason
    drain: bool = False  # the restart may wait for syntheses still making progress
    give_up: str = ""  # non-empty: a crash loop; stop it and leave it stopped


@dataclass(frozen=True)
class Policy:
    fail_threshold: int = 3
    recover_threshold: int = 2
    hang_timeout: float = 60.0
    startup_timeout: float = 300.0
    max_requests: int = 0  # recycle after this many requests (0: never)
    max_requests_jitter: int = 0
    max_memory: int = 0  # recycle past this RSS or GPU memory per process, bytes (0: never)
    drain_timeout: float = 30.0
    start_retries: int = 3

    @classmethod
    def from_settings(cls, settings: Settings) -> "Policy":
        from .planner import parse_size

        return cls(settings.fail_threshold, settings.recover_threshold, settings.hang_timeout,
                   settings.startup_timeout, settings.max_requests, settings.max_requests_jitter,
                   parse_size(settings.max_memory) if settings.max_memory else 0, settings.drain_timeout,
                   settings.start_retries)


def failed_starts(starts: int, since_ready: int, alive: bool) -> int:
    """Starts in a row that ended without the instance getting ready (the one running now,
    still loading, is not counted)."""
    return max(0, starts - since_ready - (1 if alive else 0))


def judge(track: Track, process: ProcessInfo | None, probe: Probe, policy: Policy, starts: int = 0) -> Verdict:
    """The next :class:`Track` of one instance, and whether to restart it.

    ``starts``: how often the instance has been started (its starts file), for crash loops.
    """
    alive = process is not None and process.state in ALIVE and process.pid != 0
    if not alive:
        state = process.state if process else "missing"
        track = dataclasses.replace(track, in_rotation=False, fails=0, goods=0, pid=0, ever_ready=False,
                                    draining_since=0.0, drain_signal="", signalled_at=0.0)
        if track.failed:
            return Verdict(track)
        crashes = failed_starts(starts, track.ready_starts, alive=False)
        if state == "FATAL" or crashes > policy.start_retries:
            if state == "FATAL":
                why = "supervisord gave up starting it" + (f" after {crashes} exits in a row" if crashes else "")
            else:
                why = (f"it exited {crashes} times in a row without getting ready "
                       f"(--start-retries {policy.start_retries})")
            return _give_up(track, why)
        return Verdict(dataclasses.replace(track, reason=f"process {state.lower()}"))
    if track.failed:  # given up on, yet running (supervisord restarted it meanwhile): stop it again
        return Verdict(dataclasses.replace(track, in_rotation=False, pid=process.pid), give_up=track.failed)
    if process.pid != track.pid:  # a new process: earns its place like any newcomer
        # After a planned stop (restart, recycling, new settings) the start that follows is
        # not a failure, even of an instance that was still loading.
        since = max(track.ready_starts, starts - 1) if track.signalled_at else track.ready_starts
        track = Track(pid=process.pid, restarts=track.restarts, reason="started", ready_starts=since)
    if track.signalled_at:  # stopping after a planned stop: wait for it to go
        return Verdict(dataclasses.replace(track, in_rotation=False))

    loading = not track.ever_ready and process.uptime < policy.startup_timeout
    if probe.status == "ready":
        if probe.stalled_seconds > policy.hang_timeout:
            if track.drain_signal == "KILL":  # already on its way out
                return Verdict(track)
            return _restart(track, f"a synthesis has made no progress for {probe.stalled_seconds:.0f}s "
                                   f"(hang timeout {policy.hang_timeout:.0f}s)", drain=True)
        goods = track.goods + 1
        back = not track.draining_since and (track.in_rotation or goods >= policy.recover_threshold)
        return Verdict(dataclasses.replace(track, fails=0, goods=goods, ever_ready=True, in_rotation=back,
                                           ready_starts=starts or track.ready_starts,
                                           reason="" if back else track.reason))
    crashes = failed_starts(starts, track.ready_starts, alive=True)
    if not track.ever_ready and crashes > policy.start_retries:
        return _give_up(track, f"it was started {crashes + 1} times without getting ready "
                               f"(--start-retries {policy.start_retries})")
    if loading:  # still loading its model (or not listening yet): never killed for being slow
        return Verdict(dataclasses.replace(track, in_rotation=False, fails=0, goods=0, reason="loading"))
    if probe.status == "loading":
        detail = ("not ready after the startup timeout "
                  f"({policy.startup_timeout:.0f}s)" if not track.ever_ready else "reports loading again")
        return _restart(track, detail, drain=True)
    fails = track.fails + 1
    if fails >= policy.fail_threshold:
        return _restart(track, f"{fails} probes failed in a row: {probe.detail}")
    return Verdict(dataclasses.replace(track, fails=fails, goods=0))


def recycle_due(track: Track, probe: Probe, memory: int, policy: Policy) -> str:
    """Why this healthy instance should get a drained restart now ("" when it should not):
    it served its share of requests, or its memory (RSS or GPU, per process) grew too big."""
    if not track.ever_ready or not track.in_rotation or track.draining_since or probe.status != "ready":
        return ""
    if policy.max_requests and track.recycle_at and probe.served >= track.recycle_at:
        return f"served {probe.served} requests (--max-requests {policy.max_requests})"
    if policy.max_memory and memory > policy.max_memory:
        return f"uses {memory / 2**30:.1f} GiB (--max-memory {policy.max_memory / 2**30:.1f} GiB)"
    return ""


def pick_recycle(candidates: dict[str, str], tracks: dict[str, Track],
                 uptimes: dict[str, float]) -> tuple[str, str] | None:
    """At most one drained restart at a time, and only while every other instance serves;
    of those due, the oldest process first (so a busy cluster recycles every instance in
    turn, not the first names over and over)."""
    if any(t.draining_since or t.signalled_at for t in tracks.values()):
        return None
    due = [(name, reason) for name, reason in candidates.items() if reason
           and all(t.in_rotation for other, t in tracks.items() if other != name)]
    return max(due, key=lambda item: (uptimes.get(item[0], 0.0), item[0]), default=None)


def drain_done(track: Track, probe: Probe, policy: Policy, now: float) -> bool:
    """Whether a planned stop may signal the instance now: nothing it could still finish
    (a hung one: nothing still making progress), it stopped answering, or --drain-timeout."""
    if now - track.draining_since > policy.drain_timeout or probe.status != "ready":
        return True
    if track.drain_signal == "KILL":
        return probe.progressing(policy.hang_timeout) == 0
    return probe.inflight == 0 and probe.waiting == 0


def start_drain(track: Track, reason: str, signal_name: str, now: float) -> Track:
    """Out of rotation now; signalled by :func:`drain_done`'s say."""
    return dataclasses.replace(track, in_rotation=False, goods=0, reason=reason, drain_signal=signal_name,
                               draining_since=track.draining_since or now,
                               restarts=track.restarts + (0 if track.draining_since else 1))


def _restart(track: Track, reason: str, drain: bool = False) -> Verdict:
    return Verdict(dataclasses.replace(track, in_rotation=False, fails=0, goods=0, reason=reason,
                                       restarts=track.restarts + 1), restart=reason, drain=drain)


def _give_up(track: Track, why: str) -> Verdict:
    reason = f"failed: {why}"
    return Verdict(dataclasses.replace(track, in_rotation=False, fails=0, goods=0, reason=reason, failed=reason,
                                       failed_at=time.time(), draining_since=0.0, drain_signal="",
                                       signalled_at=0.0), give_up=reason)


def loopback_session() -> requests.Session:
    """HTTP to 127.0.0.1 only: no proxies from the environment (they would see no instance)."""
    session = requests.Session()
    session.trust_env = False
    return session


LOOPBACK = loopback_session()


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def probe(port: int, timeout: float) -> Probe:
    """GET /ping on one instance. Any answer other than a well-formed one counts as failed."""
    try:
        response = LOOPBACK.get(f"http://127.0.0.1:{port}/ping", timeout=timeout)
    except requests.Timeout:
        return Probe("failed", detail=f"/ping did not answer within {timeout:g}s")
    except requests.RequestException as exc:
        return Probe("failed", detail=f"/ping: {type(exc).__name__}")
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return Probe("failed", detail=f"/ping answered {response.status_code}")
    if response.status_code == 200 and body.get("ready") is True:
        busy, stalled = body.get("busy_seconds", 0.0), body.get("stalled_seconds", [])
        if not _number(busy):
            return Probe("failed", detail=f"/ping answered busy_seconds={busy!r}, not a number")
        if not isinstance(stalled, list) or not all(_number(s) for s in stalled):
            return Probe("failed", detail=f"/ping answered stalled_seconds={stalled!r}, not a list of numbers")
        counts = [body.get(k, 0) for k in ("served", "inflight", "waiting")]
        served, inflight, waiting = (int(c) if isinstance(c, int) and not isinstance(c, bool) else 0
                                     for c in counts)
        return Probe("ready", busy_seconds=float(busy), served=served, inflight=inflight, waiting=waiting,
                     stalled=tuple(float(s) for s in stalled))
    if response.status_code == 503 and body.get("state") == "loading":
        return Probe("loading")
    return Probe("failed", detail=f"/ping answered {response.status_code}")


class HealthLoop:
    def __init__(self, layout: Layout):
        self.layout = layout
        self.settings, self.slots = read_cluster_json(layout.cluster_json.read_text())
        self.policy = Policy.from_settings(self.settings)
        self.supervisor = Supervisor(layout, timeout=5.0)
        self.tracks = self._load_tracks()
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(self.slots)))
        self.published: frozenset[str] | None = None
        self.pids: dict[str, int] = {}
        self.taken: list[str] = []
        self.stopping = False

    def _load_tracks(self) -> dict[str, Track]:
        """Pick up where a previous loop left off (the loop itself may be restarted)."""
        tracks = {slot.name: Track() for slot in self.slots}
        try:
            saved = json.loads(self.layout.health_json.read_text())["instances"]
        except (OSError, ValueError, KeyError):
            return tracks
        fields = {f.name for f in dataclasses.fields(Track)}
        for name in tracks:
            if name in saved:
                tracks[name] = Track(**{k: v for k, v in saved[name].items() if k in fields})
        return tracks

    def step(self) -> None:
        processes = self.supervisor.processes()
        self.pids = {name: p.pid for name, p in processes.items() if p.pid}
        self.clear_orphan_nginx(processes.get("nginx"))
        probes = dict(zip(
            [s.name for s in self.slots],
            self.pool.map(lambda s: probe(s.port, self.settings.probe_timeout), self.slots),
        ))
        now = time.time()
        kills: list[str] = []
        self.taken = []  # restart requests handled this step (removed once saved)
        for slot in self.slots:
            name, before = slot.name, self.tracks[slot.name]
            starts = self.layout.starts_count(name)
            if before.failed and self.layout.restart_request(name).exists():  # `restart NAME` after a crash loop
                # Start it here: the snapshot above still says FATAL or STOPPED, and judging
                # that would give it up again. Its crash count starts afresh.
                log.info("%s: restarted by hand after it was given up on", name)
                self.tracks[name] = Track(reason="restarted by hand", ready_starts=starts, restarts=before.restarts)
                self.taken.append(name)
                try:
                    self.supervisor.start(name)
                except Exception as exc:
                    log.warning("%s: start failed: %s", name, exc)
                continue
            verdict = judge(before, processes.get(name), probes[name], self.policy, starts)
            track = verdict.track
            if verdict.give_up:
                if not before.failed:
                    log.error("%s: given up, stopped until restarted by hand: %s; last log lines:\n%s", name,
                              verdict.give_up, self.supervisor.tail(name, 2000).strip()[-1500:])
                try:
                    self.supervisor.stop(name, wait=False)
                except Exception as exc:  # exited meanwhile: stopped on a later step
                    log.warning("%s: stop failed: %s", name, exc)
            elif verdict.restart and verdict.drain:
                log.warning("%s: out of rotation; restarting once nothing in flight makes progress "
                            "(at most %gs): %s", name, self.policy.drain_timeout, verdict.restart)
                track = start_drain(dataclasses.replace(track, restarts=before.restarts), verdict.restart,
                                    "KILL", now)
            elif verdict.restart:
                log.warning("%s: out of rotation and restarting: %s", name, verdict.restart)
                kills.append(name)
            elif before.in_rotation != track.in_rotation:
                log.info("%s: %s rotation%s", name, "back in" if track.in_rotation else "out of",
                         f" ({track.reason})" if track.reason else "")
            self.tracks[name] = track
        self.take_requests(processes, now)
        self.recycle(processes, probes, now)
        self.publish()  # out of nginx's rotation first, then stop
        for name in kills:
            self._signal(name, "KILL")
        self.finish_draining(probes, now)
        self.save()
        for name in self.taken:  # the CLI waits for these to go: only after health.json says so
            self.layout.restart_request(name).unlink(missing_ok=True)

    def take_requests(self, processes: dict[str, ProcessInfo], now: float) -> None:
        """`cosyvoice-lb restart` asks for drained restarts with a file per instance."""
        for slot in self.slots:
            request = self.layout.restart_request(slot.name)
            if slot.name in self.taken or not request.exists():
                continue
            try:
                action = request.read_text().strip() or "TERM"
            except OSError:
                continue
            track, process = self.tracks[slot.name], processes.get(slot.name)
            if process and process.state in ALIVE and not track.draining_since and not track.signalled_at:
                what = "stopped" if action == "TERM" else "replaced by the launcher"
                log.info("%s: restart requested: out of rotation, %s once idle", slot.name, what)
                self.tracks[slot.name] = start_drain(track, "restart requested", action, now)
            self.taken.append(slot.name)  # not running, or already on its way: nothing more to do

    def recycle(self, processes: dict[str, ProcessInfo], probes: dict[str, Probe], now: float) -> None:
        """Start a drained restart of one instance that served its share or grew too big."""
        policy = self.policy
        if not (policy.max_requests or policy.max_memory):
            return
        memory: dict[str, int] = {}
        if policy.max_memory:
            pids = {s.name: processes[s.name].pid for s in self.slots
                    if s.name in processes and processes[s.name].pid}
            gpu = process_gpu_memory(set(pids.values()))
            for name, pid in pids.items():
                try:
                    rss = psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    rss = 0
                memory[name] = max(rss, gpu.get(pid, 0))
        candidates = {}
        for slot in self.slots:
            track = self.tracks[slot.name]
            if track.ever_ready and not track.recycle_at and policy.max_requests:
                jitter = random.randint(0, policy.max_requests_jitter) if policy.max_requests_jitter else 0
                track = self.tracks[slot.name] = dataclasses.replace(track, recycle_at=policy.max_requests + jitter)
            candidates[slot.name] = recycle_due(track, probes[slot.name], memory.get(slot.name, 0), policy)
        uptimes = {name: p.uptime for name, p in processes.items()}
        picked = pick_recycle(candidates, self.tracks, uptimes)
        if picked:
            name, reason = picked
            log.info("%s: recycling (drained restart): %s", name, reason)
            self.tracks[name] = start_drain(self.tracks[name], f"recycling: {reason}", "TERM", now)

    def finish_draining(self, probes: dict[str, Probe], now: float) -> None:
        """Signal instances whose planned stop may happen now. TERM: the instance drains
        itself too, exits, and supervisord starts it again; KILL: it is hung. One that
        outlives its TERM by far is KILLed."""
        for slot in self.slots:
            track = self.tracks[slot.name]
            if track.signalled_at and now - track.signalled_at > self.policy.drain_timeout + 10:
                log.warning("%s: still running %.0fs after TERM: KILL", slot.name, now - track.signalled_at)
                self._signal(slot.name, "KILL")
                self.tracks[slot.name] = dataclasses.replace(track, signalled_at=now)
            # (Not in the step that took it out: that probe predates nginx's reload, and
            # requests may still have been sent to it since.)
            elif (track.draining_since and track.draining_since < now and not track.signalled_at
                  and drain_done(track, probes[slot.name], self.policy, now)):
                if track.drain_signal != "HOLD":  # HOLD: the launcher stops it (its config changed)
                    self._signal(slot.name, track.drain_signal or "TERM")
                self.tracks[slot.name] = dataclasses.replace(track, signalled_at=now)

    def clear_orphan_nginx(self, nginx: ProcessInfo | None) -> None:
        """Workers of a SIGKILLed nginx master keep the public port, so the master that
        supervisord starts next can never bind it. QUIT is their graceful stop: they close
        the port at once (the new master binds it on its next try) and finish what they
        are serving."""
        if nginx is None or nginx.state == "RUNNING":
            return
        orphans = orphan_nginx(self.settings.port, nginx.pid)
        if orphans:
            log.warning("nginx: gracefully stopping %d orphaned worker(s) holding port %d (pids %s)",
                        len(orphans), self.settings.port, ", ".join(str(p.pid) for p in orphans))
            for proc in orphans:
                try:
                    proc.send_signal(signal.SIGQUIT)
                except psutil.NoSuchProcess:
                    pass

    def _signal(self, name: str, signal_name: str) -> None:
        """Signal an instance through supervisord. A KILL takes its child processes along
        (they may run in their own sessions, e.g. a stuck espeak-ng or model workers holding
        GPU memory, and would outlive it)."""
        children = []
        if signal_name == "KILL" and self.pids.get(name):
            try:
                children = psutil.Process(self.pids[name]).children(recursive=True)
            except psutil.Error:
                pass
        try:
            self.supervisor.signal(name, signal_name)
        except Exception as exc:  # it may have died on its own meanwhile
            log.warning("%s: %s failed: %s", name, signal_name, exc)
        for child in children:
            try:
                child.kill()
            except psutil.Error:
                pass

    def publish(self) -> None:
        """Rewrite upstreams.conf and reload nginx when the rotation changed."""
        out = frozenset(name for name, track in self.tracks.items() if not track.in_rotation)
        if out == self.published:
            return
        write_atomic(self.layout.upstreams_conf, render_upstreams(self.slots, out))
        try:
            self.supervisor.signal("nginx", "HUP")
        except Exception as exc:  # nginx down: supervisord restarts it with the new file
            log.warning("nginx reload failed: %s", exc)
        self.published = out
        log.info("rotation: %s", ", ".join(s.name for s in self.slots if s.name not in out) or "none")

    def save(self) -> None:
        write_atomic(self.layout.health_json, json.dumps({
            "updated": time.time(),
            "instances": {name: dataclasses.asdict(t) for name, t in self.tracks.items()},
        }, indent=2) + "\n")

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        log.info("health loop: %d instances, probe every %gs (timeout %gs), out after %d failures, "
                 "back after %d good probes, hang timeout %gs", len(self.slots), self.settings.probe_interval,
                 self.settings.probe_timeout, self.policy.fail_threshold, self.policy.recover_threshold,
                 self.policy.hang_timeout)
        while not self.stopping:
            started = time.monotonic()
            try:
                self.step()
            except Exception:
                log.exception("health step failed; trying again")
            time.sleep(max(0.0, self.settings.probe_interval - (time.monotonic() - started)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="cosyvoice-lb health loop (run by supervisord)")
    parser.add_argument("--state-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s health %(levelname)s %(message)s")
    HealthLoop(Layout(Path(args.state_dir).resolve())).run()


if __name__ == "__main__":
    main()
