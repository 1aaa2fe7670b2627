"""`cosyvoice-lb status`: what supervisord, the health loop, the instances and nginx say.

Read-only; ``lifecycle`` polls it while it waits for instances to serve.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.timeouts import SUPERVISOR_POLL, Timeouts
from cosyvoice_lb.launcher.cluster import processes
from cosyvoice_lb.launcher.cluster.layout import Layout
from cosyvoice_lb.launcher.cluster.listeners import (
    beyond_loopback,
    config_behind,
    describe,
    nginx_listening,
    nginx_processes,
    wanted,
)
from cosyvoice_lb.launcher.cluster.protocol import drained_by_hand, read_report, starts_count
from cosyvoice_lb.launcher.cluster.supervision import SupervisionError, Supervisor, read_tail
from cosyvoice_lb.launcher.health.probe import Prober
from cosyvoice_lb.launcher.health.rotation import OCCUPIED, PARKED, SPARE, is_parked
from cosyvoice_lb.launcher.plan.gpu import GpuReading, gpu_readings, process_gpu_memory
from cosyvoice_lb.launcher.plan.planner import Roles, Slot
from cosyvoice_lb.launcher.render.credentials import admin_token_path, open_warning
from cosyvoice_lb.launcher.render.disk import recorded, recorded_pool
from cosyvoice_lb.launcher.render.staging import staged_digest

SERVICES = ("nginx", "health", "admin")
ESSENTIAL = ("nginx", "health")  # the cluster does not serve (well) without them


@dataclass
class InstanceStatus:
    name: str
    port: int
    gpu: int | None
    pid: int
    state: str
    ready: bool
    in_rotation: bool
    restarts: int
    uptime: float
    reason: str = ""
    inflight: int = 0
    waiting: int = 0  # requests waiting for its engine
    failed: str = ""  # given up on after a crash loop: why (it stays stopped until restarted)
    failed_at: float = 0.0
    gpu_memory: int = 0  # bytes NVML says this process holds; 0 without a GPU (or pids NVML cannot see)
    drained: bool = False  # drained by hand: out of rotation on purpose until undrained
    spare: bool = False  # a warm spare: ready, out of rotation until an instance is taken out
    parked: bool = False  # a slot not started on purpose (for surges; scaled in)
    code: str = ""  # the digest of the staged code it runs (its /ping); "" while it does not answer

    @property
    def serving(self) -> bool:
        return self.state == "RUNNING" and self.ready and self.in_rotation

    @property
    def available(self) -> bool:
        """Up and ready, and in rotation unless drained by hand or a warm spare (what a
        start waits for)."""
        return self.state == "RUNNING" and self.ready and (self.in_rotation or self.drained or self.spare)


@dataclass
class ClusterStatus:
    running: bool
    url: str = ""
    instances: list[InstanceStatus] = field(default_factory=list)
    nginx: dict = field(default_factory=dict)
    health: dict = field(default_factory=dict)
    admin: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    report: list[str] = field(default_factory=list)  # per failed instance: why, and its log's last lines
    access: dict = field(default_factory=dict)  # who can reach it, whether credentials are needed
    warnings: list[str] = field(default_factory=list)  # works, but defeats a guarantee
    unanswered: bool = False  # supervisord's socket is there but it does not answer
    gpus: list[GpuReading] = field(default_factory=list)  # the cards visible here, read now; none without NVML
    pool: dict = field(default_factory=dict)  # wanted in rotation, spares, surge, elastic scale (health.json)
    daemons: dict = field(default_factory=dict)  # CUDA MPS control daemons (--mps): name -> state, pid
    code: str = ""  # the digest of the instance code staged now (what a restart runs)

    @property
    def exit_code(self) -> int:
        if self.unanswered:  # it runs, but its supervisord does not answer: a problem, not "not running"
            return 1
        if not self.running:
            return 3
        return 1 if self.problems else 0

    def instance(self, name: str) -> InstanceStatus | None:
        return next((i for i in self.instances if i.name == name), None)

    def as_dict(self) -> dict:
        return {
            "running": self.running,
            "ok": self.running and not self.problems,
            "url": self.url,
            "instances": [i.__dict__ for i in self.instances],
            "nginx": self.nginx,
            "health": self.health,
            "admin": self.admin,
            "problems": self.problems,
            "access": self.access,
            "warnings": self.warnings,
            "gpus": [g.as_dict() for g in self.gpus],
            "pool": self.pool,
            "daemons": self.daemons,
            "code": self.code,
        }


@dataclass(frozen=True)
class Telemetry:
    """Where :func:`status` reads the GPUs from: NVML by default, a fake inventory in tests.

    ``readings()`` gives the visible cards; ``process_memory(pids)`` the GPU bytes per pid.
    """

    readings: Callable[[], tuple[GpuReading, ...]] = gpu_readings
    process_memory: Callable[[set[int]], dict[int, int]] = process_gpu_memory


NVML = Telemetry()
NO_TELEMETRY = Telemetry(readings=lambda: (), process_memory=lambda pids: {})  # for callers that only need states


def public_url(settings: Settings) -> str:
    host = settings.listen_host
    if host in ("0.0.0.0", "*", ""):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "[::1]"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"


def ask_all(prober: Prober, slots: list[Slot], timeout: float, url: str) -> tuple[dict[str, dict], int]:
    """Every instance's /ping body and nginx's /ping status, all asked at once: instances
    that do not answer cost one timeout together, not one each."""
    with ThreadPoolExecutor(max_workers=len(slots) + 1) as pool:
        nginx = pool.submit(prober.get_status, url + "/ping", timeout + 1)
        bodies = dict(zip([s.name for s in slots], pool.map(lambda s: prober.ping(s.port, timeout), slots)))
        return bodies, nginx.result()


def status(layout: Layout, prober: Prober | None = None, telemetry: Telemetry = NVML) -> ClusterStatus:
    """The cluster as supervisord, the health loop, the instances' /ping and nginx see it.

    The instances are asked in parallel (with nginx): an instance that does not answer
    costs one probe timeout, not one per instance. A supervisord that does not answer
    makes a status with ``running`` False and that said in ``problems``. A running
    cluster's status has its GPUs and each instance's GPU memory, from ``telemetry``."""
    supervisor = Supervisor(layout, timeout=SUPERVISOR_POLL)
    record = recorded(layout)
    if record is not None and layout.socket.exists():
        try:
            programs = supervisor.processes()
        except SupervisionError as exc:
            if exc.timed_out:
                return ClusterStatus(running=False, problems=[f"supervisord does not answer: {exc}"], unanswered=True)
            programs = {}  # a socket nobody listens on: not running
    else:
        programs = {}
    if not programs or record is None:
        problems = [f"no cluster runs in {layout.root}"]
        strays = processes.stray_processes(layout, record[0].port if record else None)
        if strays:
            problems.append(
                f"{len(strays)} process(es) of it outlived supervisord "
                f"(pids {', '.join(str(p.pid) for p in strays)}): 'cosyvoice-lb down' stops them"
            )
        return ClusterStatus(running=False, problems=problems)
    settings, slots = record
    health = read_report(layout)
    tracks = health.get("instances", {})
    result = ClusterStatus(running=True, url=public_url(settings))
    result.access = {
        "listen": f"{settings.listen_host}:{settings.port}",
        "public": settings.exposed,
        "credentials": settings.auth_required,
        "admin": f"{result.url}/admin",
        "admin_token_file": str(admin_token_path(settings, layout)),
    }
    result.warnings = [w for w in [open_warning(settings)] if w]
    running = [s for s in slots if s.name in programs and programs[s.name].state == "RUNNING"]
    bodies, answer = ask_all(prober or Prober(len(slots) + 1), running, settings.probe_timeout, result.url)
    for slot in slots:
        proc = programs.get(slot.name)
        body = bodies.get(slot.name, {})
        track = tracks.get(slot.name, {})
        ready = bool(body.get("ready"))
        in_rotation = bool(track.get("in_rotation")) and track.get("pid") == (proc.pid if proc else None)
        failed = track.get("failed", "") or (
            "failed: supervisord gave up starting it" if proc and proc.state == "FATAL" else ""
        )
        parked = proc is not None and is_parked(proc.state, bool(failed))
        item = InstanceStatus(
            name=slot.name,
            port=slot.port,
            gpu=slot.gpu,
            pid=proc.pid if proc else 0,
            state=proc.state if proc else "MISSING",
            ready=ready,
            in_rotation=in_rotation,
            restarts=max(0, starts_count(layout, slot.name) - 1),
            uptime=round(proc.uptime, 1) if proc and proc.state in OCCUPIED else 0.0,  # (a stopped one: its last run)
            reason="" if in_rotation else track.get("reason", ""),
            inflight=int(body.get("inflight", 0)),
            waiting=int(body.get("waiting", 0)),
            failed=failed,
            failed_at=float(track.get("failed_at", 0.0)) if track.get("failed") else 0.0,
            drained=drained_by_hand(layout, slot.name),
            spare=ready and not in_rotation and track.get("reason") == SPARE,
            parked=parked,
            code=str(body.get("code", "")),
        )
        if parked:
            item.reason = PARKED
        result.instances.append(item)
        # (it serves, yet something is wrong there: e.g. its results are not kept, disk full)
        result.problems.extend(f"{slot.name}: {problem}" for problem in body.get("problems", []) if ready)
        if failed:
            result.problems.append(
                f"{slot.name} {failed}; see 'cosyvoice-lb logs {slot.name}', fix the cause, "
                f"then 'cosyvoice-lb restart {slot.name}'"
            )
        elif parked or item.spare:  # on purpose: said in the pool line
            pass
        elif item.state != "RUNNING" or not ready:
            result.problems.append(f"{slot.name} is {item.state.lower()}{'' if ready else ', not ready'}")
        elif item.drained:  # on purpose: said, not a problem
            result.warnings.append(
                f"{slot.name} is drained by hand (out of rotation): 'cosyvoice-lb undrain {slot.name}' puts it back"
            )
        elif not in_rotation:
            result.problems.append(f"{slot.name} is ready but not in nginx's rotation yet")
    for name in SERVICES:
        proc = programs.get(name)
        state = proc.state if proc else "MISSING"
        setattr(result, name, {"state": state, "pid": proc.pid if proc else 0})
        if state != "RUNNING":
            result.problems.append(f"{name} is {state.lower()}")
    for name, proc in sorted(programs.items()):
        if name.startswith("mps-gpu"):
            result.daemons[name] = {"state": proc.state, "pid": proc.pid}
            if proc.state != "RUNNING":
                result.problems.append(f"{name} (CUDA MPS) is {proc.state.lower()}: see 'cosyvoice-lb logs {name}'")
    result.pool = pool_summary(recorded_pool(layout, slots), health.get("pool", {}), result.instances)
    coming = sum(1 for i in result.instances if not i.parked and not i.serving and not i.spare and not i.failed)
    if result.pool["in_rotation"] + coming < result.pool["wanted"]:  # e.g. an instance stopped by hand
        result.problems.append(
            f"{result.pool['in_rotation']} instance(s) in rotation of {result.pool['wanted']} wanted, and none "
            "coming: 'cosyvoice-lb up' with the cluster's settings starts parked slots"
        )
    result.nginx.update(port=settings.port, url=result.url, answers=answer)
    read_listeners(result, settings, layout)
    result.code = staged_digest(layout.instance_lib)
    behind = [i.name for i in result.instances if i.code and result.code and i.code != result.code]
    if behind:
        result.warnings.append(
            f"roll-out not finished: {', '.join(behind)} run(s) older code than staged ({result.code}): "
            "'cosyvoice-lb restart --all' replaces them"
        )
    if result.nginx["state"] == "RUNNING" and answer == 0:
        result.problems.append(f"nginx does not answer on {result.url}")
    age = time.time() - float(health.get("updated", 0))
    result.health["updated_seconds_ago"] = round(age, 1) if health else None
    if result.health["state"] == "RUNNING" and age > Timeouts(settings).health_stale:
        result.problems.append(f"the health loop has not reported for {age:.0f}s (hung?)")
    result.report = failure_report(layout, result)
    read_gpus(result, telemetry)
    return result


def read_listeners(result: ClusterStatus, settings: Settings, layout: Layout) -> None:
    """What nginx really does (in place): the addresses its processes listen on (``access``
    says those, not the config's), and a problem where they or its config lag what is on disk."""
    configured = wanted(settings.listen_host, settings.port)
    procs = nginx_processes(result.nginx["pid"]) if result.nginx.get("state") == "RUNNING" else []
    actual = nginx_listening(result.nginx["pid"]) if procs else set()
    result.access.update(listen=describe(actual), public=beyond_loopback(actual))
    result.nginx["listening"] = sorted(describe({address}) for address in actual)
    result.nginx["configured"] = f"{settings.listen_host}:{settings.port}"
    if not procs:
        return
    if actual != configured:
        result.problems.append(
            f"nginx listens on {describe(actual)}, not on {describe(configured)} as its config says: "
            "'cosyvoice-lb up' with the cluster's settings (or 'cosyvoice-lb restart nginx') moves it"
        )
    if beyond_loopback(actual) and not settings.auth_required and not settings.exposed:
        result.problems.append(
            f"nginx listens on {describe(actual)} while the cluster requires no credentials: anyone who reaches it "
            "can synthesize; 'cosyvoice-lb restart nginx' puts it back on loopback"
        )
    behind = config_behind(procs, (layout.nginx_conf, layout.upstreams_conf))
    if behind:
        result.problems.append(
            "nginx still runs a config older than the one on disk ("
            + time.strftime("%H:%M:%S", time.localtime(behind))
            + "): a reload failed, so rotation changes do not reach it; see 'cosyvoice-lb logs nginx-error', "
            "then 'cosyvoice-lb up' with the cluster's settings (or 'cosyvoice-lb restart nginx')"
        )


def pool_summary(pool: Roles, reported: dict, instances: list[InstanceStatus]) -> dict:
    """How many serve of how many wanted, the spares, the parked slots, a roll-out's surge and
    the elastic scale with its latest decisions (from the health loop's report)."""
    scale = reported.get("scale") if isinstance(reported.get("scale"), dict) else None
    return {
        "wanted": int(reported.get("wanted", pool.serving)),
        "in_rotation": sum(1 for i in instances if i.serving),
        "spares": sum(1 for i in instances if i.spare),
        "spares_wanted": pool.spares,
        "parked": sum(1 for i in instances if i.parked),
        "surge": int(reported.get("surge", 0)),
        "elastic": {"min": pool.min_serving, "max": pool.serving} if pool.elastic else None,
        "decisions": scale.get("decisions", [])[-3:] if scale else [],
    }


def pool_line(pool: dict) -> str:
    """The pool in words, for `status`."""
    if not pool:
        return ""
    words = f"pool: {pool['in_rotation']} in rotation of {pool['wanted']} wanted"
    if pool.get("elastic"):
        words += f" (elastic {pool['elastic']['min']}..{pool['elastic']['max']})"
    if pool.get("surge"):
        words += f", +{pool['surge']} for a roll-out under way"
    if pool.get("spares_wanted") or pool.get("spares"):
        words += f"; {pool['spares']} of {pool['spares_wanted']} warm spare(s) ready"
    if pool.get("parked"):
        words += f"; {pool['parked']} parked slot(s)"
    for decision in pool.get("decisions", []):
        when = time.strftime("%H:%M:%S", time.localtime(float(decision.get("at", 0))))
        words += f"\n  {when} {decision.get('reason', '')} -> {decision.get('target')}"
    return words


def read_gpus(result: ClusterStatus, telemetry: Telemetry) -> None:
    """Fill in the cards and each instance's GPU memory (in place); nothing without a GPU."""
    result.gpus = list(telemetry.readings())
    pids = {i.pid for i in result.instances if i.pid}
    if not result.gpus or not pids:
        return  # no card, or nothing running: no second NVML session
    used = telemetry.process_memory(pids)
    for item in result.instances:
        item.gpu_memory = used.get(item.pid, 0) if item.pid else 0


def failure_report(layout: Layout, current: ClusterStatus, names: list[str] | None = None) -> list[str]:
    """For each failed instance: why, and the last lines of its log."""
    supervisor = Supervisor(layout)
    lines = []
    for item in current.instances:
        if item.failed and (names is None or item.name in names):
            lines.append(f"{item.name} {item.failed}; last lines of {layout.log(item.name)}:")
            lines += ["    " + line for line in last_lines(supervisor, item.name, 12).splitlines()]
    return lines


def last_lines(supervisor: Supervisor, name: str, lines: int = 20) -> str:
    text = supervisor.tail(name, 8000)
    if name == "nginx":
        text += read_tail(supervisor.layout.log("nginx-error"), 4000)
    return "\n".join(text.strip().splitlines()[-lines:]) or "(empty log)"
