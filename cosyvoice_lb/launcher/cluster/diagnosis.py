"""What the cluster's state means: the facts ``status`` gathers in, a :class:`ClusterStatus`
(each instance's state, the problems and warnings, the pool) out.

Pure, as the health loop's ``judge`` is: no supervisord, no HTTP, no files, no clock of its
own, so every rule is tested with facts written by hand.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.timeouts import Timeouts
from cosyvoice_lb.jobs.model import JobStatus
from cosyvoice_lb.launcher.cluster.listeners import Address, beyond_loopback, describe, wanted
from cosyvoice_lb.launcher.health.rotation import OCCUPIED, is_parked
from cosyvoice_lb.launcher.plan.gpu import GpuReading
from cosyvoice_lb.launcher.plan.planner import Roles, Slot
from cosyvoice_lb.launcher.state.canary import Canary
from cosyvoice_lb.launcher.state.health_report import HealthReport, OnPurpose, Track
from cosyvoice_lb.launcher.state.supervision import ProcessInfo, ProgramState

# status's state of a program supervisord does not have (not one of supervisord's own)
MISSING = "MISSING"

SERVICES = ("nginx", "health", "admin", "jobs")
ESSENTIAL = ("nginx", "health")  # the cluster does not serve (well) without them
JOBS_STALE = 30.0  # seconds without a report from a running jobs process: hung, or its run dir unwritable


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
    bad_audio: dict[str, int] = field(default_factory=dict)  # syntheses of this process that failed the audio check
    bad_audio_restarts: int = 0  # restarts the health loop ordered for bad audio
    audio_fault: str = ""  # the last bad audio that took it out (its /ping now, or the health loop's record)
    audio_fault_at: float = 0.0  # when that was seen (epoch s)
    # its speech check (/ping's speech): the last warm-up's or canary's verdict, passed, failed
    # or unchecked ("" from an instance that does not say), and why not passed
    speech: str = ""
    speech_why: str = ""
    speech_last: list[dict] = field(default_factory=list)  # its last checks, with what was heard
    canary: bool = False  # a model roll-out's canary: never in the serving rotation (``launcher.canary``)

    @property
    def serving(self) -> bool:
        return self.state == ProgramState.RUNNING and self.ready and self.in_rotation

    @property
    def available(self) -> bool:
        """Up and ready, and in rotation unless drained by hand or a warm spare (what a
        start waits for)."""
        return self.state == ProgramState.RUNNING and self.ready and (self.in_rotation or self.drained or self.spare)


@dataclass
class ClusterStatus:
    running: bool
    url: str = ""
    instances: list[InstanceStatus] = field(default_factory=list)
    nginx: dict = field(default_factory=dict)
    health: dict = field(default_factory=dict)
    admin: dict = field(default_factory=dict)
    jobs: dict = field(default_factory=dict)  # the long-form jobs' API and runner
    problems: list[str] = field(default_factory=list)
    report: list[str] = field(default_factory=list)  # per failed instance: why, and its log's last lines
    access: dict = field(default_factory=dict)  # who can reach it, whether credentials are needed
    warnings: list[str] = field(default_factory=list)  # works, but defeats a guarantee
    unanswered: bool = False  # supervisord's socket is there but it does not answer
    gpus: list[GpuReading] = field(default_factory=list)  # the cards visible here, read now; none without NVML
    pool: dict = field(default_factory=dict)  # wanted in rotation, spares, surge, elastic scale (health.json)
    daemons: dict = field(default_factory=dict)  # CUDA MPS control daemons (--mps): name -> state, pid
    code: str = ""  # the digest of the instance code staged now (what a restart runs)
    canary: dict = field(default_factory=dict)  # a model roll-out under comparison: what and since when

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
            "jobs": self.jobs,
            "problems": self.problems,
            "access": self.access,
            "warnings": self.warnings,
            "gpus": [g.as_dict() for g in self.gpus],
            "pool": self.pool,
            "daemons": self.daemons,
            "code": self.code,
            "canary": self.canary,
        }


@dataclass
class Observation:
    """Everything ``status`` read from a running cluster, at one moment."""

    settings: Settings
    slots: tuple[Slot, ...]
    roles: Roles
    programs: dict[str, ProcessInfo]  # supervisord's, by program name
    health: HealthReport  # the health loop's last report (health.json); updated 0 before its first
    pings: dict[str, dict]  # each running instance's /ping body ({} when it did not answer)
    nginx_answer: int  # nginx's /ping status (0: no answer)
    drained: frozenset[str] = frozenset()  # drained by hand
    starts: dict[str, int] = field(default_factory=dict)  # how often each instance was started
    listening: frozenset[Address] | None = None  # nginx's real sockets; None: no nginx process
    config_behind: float = 0.0  # the mtime of a config nginx has not taken (0: it runs the newest)
    staged: str = ""  # the digest of the instance code staged now
    admin_token_file: str = ""
    open_warning: str = ""  # the access warning of these settings, if any
    jobs_report: dict | None = None  # the jobs process's last report (run/jobs.json); {}: none there; None: not read
    now: float = 0.0  # epoch seconds
    canary: Canary | None = None  # a model roll-out under comparison


def public_url(settings: Settings) -> str:
    host = settings.listen_host
    if host in ("0.0.0.0", "*", ""):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "[::1]"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"


def diagnose(seen: Observation) -> ClusterStatus:
    """The cluster's status from what was seen: each instance, the services, the pool, nginx's
    listeners, the code and the health loop's freshness, each with what is wrong and what to do."""
    settings = seen.settings
    result = ClusterStatus(running=True, url=public_url(settings))
    result.access = {
        "listen": f"{settings.listen_host}:{settings.port}",
        "public": settings.exposed,
        "credentials": settings.auth_required,
        "admin": f"{result.url}/admin",
        "admin_token_file": seen.admin_token_file,
    }
    result.warnings = [seen.open_warning] if seen.open_warning else []
    for slot in seen.slots:
        item = instance_status(seen, slot, seen.health.track(slot.name))
        result.instances.append(item)
        instance_findings(result, item, seen.pings.get(slot.name, {}))
    service_findings(result, seen.programs)
    jobs = seen.programs.get("jobs")
    jobs_findings(result, seen.jobs_report, seen.now, jobs.uptime if jobs else 0.0)
    result.pool = pool_summary(seen.roles, seen.health.pool, result.instances)
    coming = sum(
        1 for i in result.instances if not i.parked and not i.serving and not i.spare and not i.failed and not i.canary
    )
    if result.pool["in_rotation"] + coming < result.pool["wanted"]:  # e.g. an instance stopped by hand
        result.problems.append(
            f"{result.pool['in_rotation']} instance(s) in rotation of {result.pool['wanted']} wanted, and none "
            "coming: 'cosyvoice-lb up' with the cluster's settings starts parked slots"
        )
    result.nginx.update(port=settings.port, url=result.url, answers=seen.nginx_answer)
    listener_findings(result, settings, seen.listening, seen.config_behind)
    result.code = seen.staged
    if seen.canary is not None:
        result.canary = {**seen.canary.as_dict(), "summary": seen.canary.describe()}
    behind = [i.name for i in result.instances if i.code and result.code and i.code != result.code]
    if behind:
        result.warnings.append(
            f"roll-out not finished: {', '.join(behind)} run(s) older code than staged ({result.code}): "
            "'cosyvoice-lb restart --all' replaces them"
        )
    if result.nginx["state"] == ProgramState.RUNNING and seen.nginx_answer == 0:
        result.problems.append(f"nginx does not answer on {result.url}")
    age = seen.now - seen.health.updated
    result.health["updated_seconds_ago"] = round(age, 1) if seen.health.updated else None
    if result.health["state"] == ProgramState.RUNNING and age > Timeouts(settings).health_stale:
        result.problems.append(f"the health loop has not reported for {age:.0f}s (hung?)")
    return result


def shown_reason(track: Track, *, canary: bool, parked: bool, in_rotation: bool) -> str:
    """Why an instance is out, as status and the panel show it (empty: in rotation)."""
    if canary:
        return "canary (model roll-out)"
    if parked:
        return str(OnPurpose.PARKED)
    return "" if in_rotation else track.reason_words


def instance_status(seen: Observation, slot: Slot, track: Track) -> InstanceStatus:
    """One slot: what supervisord, its /ping and the health loop's track say of it."""
    proc = seen.programs.get(slot.name)
    body = seen.pings.get(slot.name, {})
    ready = bool(body.get("ready"))
    canary = seen.canary is not None and slot.name in seen.canary.slots
    in_rotation = track.in_rotation and track.pid == (proc.pid if proc else None) and not canary
    failed = track.failed or (
        "failed: supervisord gave up starting it" if proc and proc.state == ProgramState.FATAL else ""
    )
    parked = proc is not None and is_parked(proc.state, bool(failed))
    fault, fault_at = track.bad_audio, track.bad_audio_at
    if body.get("state") == "bad-audio":  # (out now: newer than anything the loop recorded)
        fault, fault_at = str(body.get("error", "")) or "bad audio", seen.now
    counts = body.get("bad_audio")
    said = body.get("speech")
    speech: dict = said if isinstance(said, dict) else {}
    return InstanceStatus(
        name=slot.name,
        port=slot.port,
        gpu=slot.gpu,
        pid=proc.pid if proc else 0,
        state=proc.state if proc else MISSING,
        ready=ready,
        in_rotation=in_rotation,
        restarts=max(0, seen.starts.get(slot.name, 0) - 1),
        uptime=round(proc.uptime, 1) if proc and proc.state in OCCUPIED else 0.0,  # (a stopped one: its last run)
        reason=shown_reason(track, canary=canary, parked=parked, in_rotation=in_rotation),
        inflight=int(body.get("inflight", 0)),
        waiting=int(body.get("waiting", 0)),
        failed=failed,
        failed_at=track.failed_at if track.failed else 0.0,
        drained=slot.name in seen.drained,
        spare=ready and not in_rotation and track.on_purpose is OnPurpose.SPARE,
        parked=parked,
        code=str(body.get("code", "")),
        bad_audio={str(k): int(v) for k, v in counts.items() if isinstance(v, int)} if isinstance(counts, dict) else {},
        bad_audio_restarts=int(track.ordered.get("bad_audio", 0)),
        audio_fault=fault,
        audio_fault_at=fault_at,
        speech=str(speech.get("verdict", "")),
        speech_why=str(speech.get("why", "")),
        speech_last=[c for c in speech.get("last", []) if isinstance(c, dict)][-5:],
        canary=canary,
    )


def instance_findings(result: ClusterStatus, item: InstanceStatus, body: dict) -> None:
    """What is wrong with one instance (problems) or only worth saying (warnings), in place."""
    # (it serves, yet something is wrong there: e.g. its results are not kept, disk full)
    result.problems.extend(f"{item.name}: {problem}" for problem in body.get("problems", []) if item.ready)
    if item.ready and item.bad_audio:
        result.warnings.append(
            f"{item.name} made bad audio {sum(item.bad_audio.values())} time(s) since it started ("
            + ", ".join(f"{reason} {n}" for reason, n in sorted(item.bad_audio.items()))
            + "): those answers were not sent (retried elsewhere); it serves while its canary passes, see "
            f"'cosyvoice-lb logs {item.name}'"
        )
    if item.failed:
        result.problems.append(
            f"{item.name} {item.failed}; see 'cosyvoice-lb logs {item.name}', fix the cause, "
            f"then 'cosyvoice-lb restart {item.name}'"
        )
    elif item.parked or item.spare:  # on purpose: said in the pool line
        pass
    elif body.get("state") == "bad-audio":
        result.problems.append(
            f"{item.name} makes bad audio ({item.audio_fault}): out of rotation, the health loop restarts it"
        )
    elif item.state != ProgramState.RUNNING or not item.ready:
        result.problems.append(f"{item.name} is {item.state.lower()}{'' if item.ready else ', not ready'}")
    elif item.drained:  # on purpose: said, not a problem
        result.warnings.append(
            f"{item.name} is drained by hand (out of rotation): 'cosyvoice-lb undrain {item.name}' puts it back"
        )
    elif not item.in_rotation and not item.canary:  # (a model roll-out's canary: in a pool of its own)
        result.problems.append(f"{item.name} is ready but not in nginx's rotation yet")


def service_findings(result: ClusterStatus, programs: dict[str, ProcessInfo]) -> None:
    """nginx, the health loop, the panel, the jobs process, the CUDA MPS daemons and the
    Alertmanager (--alertmanager): their states, in place."""
    for name in SERVICES:
        proc = programs.get(name)
        state = proc.state if proc else MISSING
        setattr(result, name, {"state": state, "pid": proc.pid if proc else 0})
        if state != ProgramState.RUNNING:
            result.problems.append(f"{name} is {state.lower()}")
    for name, proc in sorted(programs.items()):
        if name.startswith("mps-gpu") or name == "alertmanager":
            result.daemons[name] = {"state": proc.state, "pid": proc.pid}
            what = "CUDA MPS" if name.startswith("mps-gpu") else "alerts reach nobody"
            if proc.state != ProgramState.RUNNING:
                result.problems.append(f"{name} ({what}) is {proc.state.lower()}: see 'cosyvoice-lb logs {name}'")


def jobs_findings(result: ClusterStatus, report: dict | None, now: float, uptime: float) -> None:
    """The long-form jobs from the jobs process's report (in place): queued and running
    counts, the running jobs' progress. A report missing or stale past ``JOBS_STALE`` (once
    the process has run that long: it reports within seconds of its start), or one that says
    the store fails, is a "jobs: ..." problem; nothing here fails the status itself."""
    if result.jobs.get("state") != ProgramState.RUNNING or report is None:
        return
    silent = uptime > JOBS_STALE
    if not report:
        if silent:
            result.problems.append(
                "jobs: the jobs process has not reported (run/jobs.json); see 'cosyvoice-lb logs jobs'"
            )
        return
    try:
        age = max(0.0, now - float(report.get("updated", 0)))
        counts = report.get("counts")
        known: dict[str, int] = (
            {s: int(counts.get(s, 0)) for s in (JobStatus.QUEUED, JobStatus.RUNNING)}
            if isinstance(counts, dict)
            else {}
        )
        running = [{"id": str(r["id"]), "done": int(r["done"]), "total": int(r["total"])} for r in report["running"]]
    except (TypeError, ValueError, KeyError, AttributeError):
        result.problems.append("jobs: its report (run/jobs.json) is not readable; see 'cosyvoice-lb logs jobs'")
        return
    result.jobs.update(known, updated_seconds_ago=round(age, 1), running_jobs=running)
    # (the cluster's /metrics carries them: cosyvoice_lb.jobs.metrics.families)
    result.jobs["metrics"] = {k: report[k] for k in ("counts", "segments_done", "retries", "durations") if k in report}
    if age > JOBS_STALE and silent:
        result.problems.append(
            f"jobs: the jobs process has not reported for {age:.0f}s (hung?); see 'cosyvoice-lb logs jobs'"
        )
    if report.get("error"):
        result.problems.append(f"jobs: {report['error']}")


def jobs_line(jobs: dict) -> str:
    """The jobs in words, for `status` ("" before the jobs process reported)."""
    if JobStatus.QUEUED not in jobs and not jobs.get("running_jobs"):
        return ""
    words = f"jobs: {jobs.get(JobStatus.QUEUED, '?')} queued, {jobs.get(JobStatus.RUNNING, '?')} running"
    shown = jobs.get("running_jobs") or []
    if shown:
        words += " (" + ", ".join(f"{r['id']} {r['done']}/{r['total']}" for r in shown) + ")"
    return words


def listener_findings(
    result: ClusterStatus, settings: Settings, actual: frozenset[Address] | None, config_behind: float
) -> None:
    """What nginx really does (in place): the addresses its processes listen on (``access``
    says those, not the config's), and a problem where they or its config lag what is on disk."""
    listening = actual or frozenset()
    configured = wanted(settings.listen_host, settings.port)
    result.access.update(listen=describe(set(listening)), public=beyond_loopback(set(listening)))
    result.nginx["listening"] = sorted(describe({address}) for address in listening)
    result.nginx["configured"] = f"{settings.listen_host}:{settings.port}"
    if actual is None:  # (no nginx process)
        return
    if listening != configured:
        result.problems.append(
            f"nginx listens on {describe(set(listening))}, not on {describe(configured)} as its config says: "
            "'cosyvoice-lb up' with the cluster's settings (or 'cosyvoice-lb restart nginx') moves it"
        )
    if beyond_loopback(set(listening)) and not settings.auth_required and not settings.exposed:
        result.problems.append(
            f"nginx listens on {describe(set(listening))} while the cluster requires no credentials: anyone who "
            "reaches it can synthesize; 'cosyvoice-lb restart nginx' puts it back on loopback"
        )
    if config_behind:
        result.problems.append(
            "nginx still runs a config older than the one on disk ("
            + time.strftime("%H:%M:%S", time.localtime(config_behind))
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
        "canary": sum(1 for i in instances if i.canary),
        "surge": int(reported.get("surge", 0)),
        "elastic": {"min": pool.min_serving, "max": pool.serving} if pool.elastic else None,
        "decisions": scale.get("decisions", [])[-3:] if scale else [],
    }
