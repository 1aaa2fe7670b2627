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
from .processes import orphan_nginx, stop
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
    recycling_since: float = 0.0  # out of rotation for a drained restart since (epoch s); 0: no


@dataclass(frozen=True)
class Verdict:
    track: Track
    restart: str = ""  # non-empty: restart now, for this reason


@dataclass(frozen=True)
class Policy:
    fail_threshold: int = 3
    recover_threshold: int = 2
    hang_timeout: float = 120.0
    startup_timeout: float = 300.0
    max_requests: int = 0  # recycle after this many requests (0: never)
    max_requests_jitter: int = 0
    max_memory: int = 0  # recycle past this RSS or GPU memory per process, bytes (0: never)
    drain_timeout: float = 30.0

    @classmethod
    def from_settings(cls, settings: Settings) -> "Policy":
        from .planner import parse_size

        return cls(settings.fail_threshold, settings.recover_threshold, settings.hang_timeout,
                   settings.startup_timeout, settings.max_requests, settings.max_requests_jitter,
                   parse_size(settings.max_memory) if settings.max_memory else 0, settings.drain_timeout)


def judge(track: Track, process: ProcessInfo | None, probe: Probe, policy: Policy) -> Verdict:
    """The next :class:`Track` of one instance, and whether to restart it."""
    if process is None or process.state not in ALIVE or process.pid == 0:
        state = process.state if process else "missing"
        return Verdict(dataclasses.replace(track, in_rotation=False, fails=0, goods=0, pid=0,
                                           ever_ready=False, reason=f"process {state.lower()}"))
    if process.pid != track.pid:  # a new process: earns its place like any newcomer
        track = Track(pid=process.pid, restarts=track.restarts, reason="started")

    loading = not track.ever_ready and process.uptime < policy.startup_timeout
    if probe.status == "ready":
        if probe.busy_seconds > policy.hang_timeout:
            return _restart(track, f"a synthesis has run {probe.busy_seconds:.0f}s "
                                   f"(hang timeout {policy.hang_timeout:.0f}s)")
        goods = track.goods + 1
        back = not track.recycling_since and (track.in_rotation or goods >= policy.recover_threshold)
        return Verdict(dataclasses.replace(track, fails=0, goods=goods, ever_ready=True, in_rotation=back,
                                           reason="" if back else track.reason))
    if loading:  # still loading its model (or not listening yet): never killed for being slow
        return Verdict(dataclasses.replace(track, in_rotation=False, fails=0, goods=0, reason="loading"))
    if probe.status == "loading":
        detail = ("not ready after the startup timeout "
                  f"({policy.startup_timeout:.0f}s)" if not track.ever_ready else "reports loading again")
        return _restart(track, detail)
    fails = track.fails + 1
    if fails >= policy.fail_threshold:
        return _restart(track, f"{fails} probes failed in a row: {probe.detail}")
    return Verdict(dataclasses.replace(track, fails=fails, goods=0))


def recycle_due(track: Track, probe: Probe, memory: int, policy: Policy) -> str:
    """Why this healthy instance should get a drained restart now ("" when it should not):
    it served its share of requests, or its memory (RSS or GPU, per process) grew too big."""
    if not track.ever_ready or not track.in_rotation or track.recycling_since or probe.status != "ready":
        return ""
    if policy.max_requests and track.recycle_at and probe.served >= track.recycle_at:
        return f"served {probe.served} requests (--max-requests {policy.max_requests})"
    if policy.max_memory and memory > policy.max_memory:
        return f"uses {memory / 2**30:.1f} GiB (--max-memory {policy.max_memory / 2**30:.1f} GiB)"
    return ""


def pick_recycle(candidates: dict[str, str], tracks: dict[str, Track]) -> tuple[str, str] | None:
    """At most one drained restart at a time, and only while every other instance serves."""
    if any(t.recycling_since for t in tracks.values()):
        return None
    for name, reason in sorted(candidates.items()):
        if reason and all(t.in_rotation for other, t in tracks.items() if other != name):
            return name, reason
    return None


def _restart(track: Track, reason: str) -> Verdict:
    return Verdict(dataclasses.replace(track, in_rotation=False, fails=0, goods=0, reason=reason,
                                       restarts=track.restarts + 1), restart=reason)


def loopback_session() -> requests.Session:
    """HTTP to 127.0.0.1 only: no proxies from the environment (they would see no instance)."""
    session = requests.Session()
    session.trust_env = False
    return session


LOOPBACK = loopback_session()


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
        busy = body.get("busy_seconds", 0.0)
        if isinstance(busy, bool) or not isinstance(busy, (int, float)):
            return Probe("failed", detail=f"/ping answered busy_seconds={busy!r}, not a number")
        counts = [body.get(k, 0) for k in ("served", "inflight")]
        served, inflight = (int(c) if isinstance(c, int) and not isinstance(c, bool) else 0 for c in counts)
        return Probe("ready", busy_seconds=float(busy), served=served, inflight=inflight)
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
        self.clear_orphan_nginx(processes.get("nginx"))
        probes = dict(zip(
            [s.name for s in self.slots],
            self.pool.map(lambda s: probe(s.port, self.settings.probe_timeout), self.slots),
        ))
        restarts = []
        for slot in self.slots:
            before = self.tracks[slot.name]
            verdict = judge(before, processes.get(slot.name), probes[slot.name], self.policy)
            self.tracks[slot.name] = verdict.track
            if verdict.restart:
                log.warning("%s: out of rotation and restarting: %s", slot.name, verdict.restart)
                restarts.append(slot.name)
            elif before.in_rotation != verdict.track.in_rotation:
                log.info("%s: %s rotation%s", slot.name, "back in" if verdict.track.in_rotation else "out of",
                         f" ({verdict.track.reason})" if verdict.track.reason else "")
        self.recycle(processes, probes)
        self.publish()  # out of nginx's rotation first, then restart
        for name in restarts:
            self._kill(name)
        self.finish_recycling(probes)
        self.save()

    def recycle(self, processes: dict[str, ProcessInfo], probes: dict[str, Probe]) -> None:
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
        picked = pick_recycle(candidates, self.tracks)
        if picked:
            name, reason = picked
            log.info("%s: recycling (drained restart): %s", name, reason)
            self.tracks[name] = dataclasses.replace(self.tracks[name], in_rotation=False, goods=0,
                                                    recycling_since=time.time(), reason=f"recycling: {reason}",
                                                    restarts=self.tracks[name].restarts + 1)

    def finish_recycling(self, probes: dict[str, Probe]) -> None:
        """Once out of rotation and idle (or past --drain-timeout), stop it with TERM:
        it drains itself too, exits, and supervisord starts it again."""
        for slot in self.slots:
            track = self.tracks[slot.name]
            if not track.recycling_since or track.recycling_since < 0:
                continue
            idle = probes[slot.name].inflight == 0 and probes[slot.name].status == "ready"
            if idle or time.time() - track.recycling_since > self.policy.drain_timeout:
                try:
                    self.supervisor.signal(slot.name, "TERM")
                except Exception as exc:
                    log.warning("%s: TERM for recycling failed: %s", slot.name, exc)
                self.tracks[slot.name] = dataclasses.replace(track, recycling_since=-1.0)

    def clear_orphan_nginx(self, nginx: ProcessInfo | None) -> None:
        """Workers of a SIGKILLed nginx master keep the public port, so the master that
        supervisord starts next can never bind it: stop them."""
        if nginx is None or nginx.state == "RUNNING":
            return
        orphans = orphan_nginx(self.settings.port, nginx.pid)
        if orphans:
            log.warning("nginx: stopping %d orphaned worker(s) holding port %d (pids %s)", len(orphans),
                        self.settings.port, ", ".join(str(p.pid) for p in orphans))
            stop(orphans, timeout=5)

    def _kill(self, name: str) -> None:
        try:
            self.supervisor.signal(name, "KILL")
        except Exception as exc:  # it may have died on its own meanwhile
            log.warning("%s: KILL failed: %s", name, exc)

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
