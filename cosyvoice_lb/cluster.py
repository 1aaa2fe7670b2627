"""The cluster's lifecycle: plan, render to disk, up, status, restart, down.

This is the edge where the pure core (planner, render) meets the box: files, ports,
nginx, supervisord and HTTP. The CLI calls these functions and prints what they return.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil
import requests

from . import processes
from .files import write_atomic
from .gpu import inventory
from .health import LOOPBACK
from .planner import Budget, Plan, PlanError, Slot, parse_size, plan, with_own_slots
from .render import Layout, Programs, read_cluster_json, render
from .resources import instance_files
from .settings import ENGINE_FOOTPRINTS, TRT_EXTRA, VLLM_CARD_FRACTION, Settings
from .supervision import Supervisor, read_tail

SERVICES = ("nginx", "health")


class ClusterError(RuntimeError):
    """A user-facing failure: the message says what went wrong and what to do."""


Report = Callable[["Progress"], None]


@dataclass
class Progress:
    """What `up` and `restart` report while they wait."""

    ready: int
    total: int
    detail: str


def layout_for(settings_or_dir: Settings | str) -> Layout:
    state_dir = settings_or_dir.state_dir if isinstance(settings_or_dir, Settings) else settings_or_dir
    return Layout(Path(state_dir).expanduser().resolve())


def recorded(layout: Layout) -> tuple[Settings, tuple[Slot, ...]] | None:
    """The settings and slots the cluster in ``layout`` was last rendered with."""
    try:
        return read_cluster_json(layout.cluster_json.read_text())
    except (OSError, ValueError, KeyError):
        return None


# --- planning and rendering ----------------------------------------------------------------

def parse_instances(value: str) -> int | None:
    text = str(value).strip().lower()
    if text in ("", "auto"):
        return None
    if not text.isdigit() or int(text) < 1:
        raise PlanError(f"--instances {value!r}: give a number of instances (1 or more) or 'auto'")
    return int(text)


def absolute(settings: Settings) -> Settings:
    """Paths made absolute now: supervisord runs everything from the state dir."""
    paths = {}
    for name in ("model_dir", "cosyvoice_root", "outputs_dir"):
        value = getattr(settings, name)
        if value:
            paths[name] = str(Path(value).expanduser().resolve())
    return dataclasses.replace(settings, **paths)


def flags_key(settings: Settings) -> str:
    """Which calibration a footprint belongs to: the engine (and model version) and the
    flags that change memory."""
    engine = settings.resolved_engine
    if engine == "cosyvoice3" and settings.model_dir:
        from .engines.cosyvoice import model_version

        try:
            engine = f"cosyvoice{model_version(settings.model_dir)}"
        except ValueError:
            pass
    flags = [f for f in ("load_trt", "load_vllm", "fp16") if getattr(settings, f)]
    return "+".join([engine, *flags])


def calibrated(layout: Layout, settings: Settings) -> dict | None:
    """The footprint `cosyvoice-lb calibrate` measured for this engine and these flags."""
    try:
        return json.loads(layout.footprint_json.read_text()).get(flags_key(settings))
    except (OSError, ValueError):
        return None


def budget_for(settings: Settings, layout: Layout) -> tuple[Budget, str]:
    """Memory per instance, and where the figure came from."""
    engine = settings.resolved_engine
    defaults = ENGINE_FOOTPRINTS[engine]
    gpu, host, fraction, source = parse_size(defaults["gpu"]), parse_size(defaults["host"]), 0.0, "default"
    if engine == "cosyvoice3":
        if settings.load_trt:
            gpu += parse_size(TRT_EXTRA)
        if settings.load_vllm:
            fraction = VLLM_CARD_FRACTION
    measured = calibrated(layout, settings)
    if measured:
        gpu, fraction, source = int(measured["gpu_bytes"]), 0.0, f"calibrated {measured.get('when', '')}".strip()
    if settings.footprint:
        gpu = host = parse_size(settings.footprint)
        fraction, source = 0.0, "--footprint"
    return Budget(gpu_footprint=gpu, host_footprint=host, reserve=parse_size(settings.reserve),
                  max_instances=settings.max_instances or None, gpu_fraction=fraction), source


def make_plan(settings: Settings, own: tuple[Slot, ...] = ()) -> tuple[Plan, str]:
    """The plan for these settings on this box, and where the GPU list came from.

    ``own``: the slots of the cluster already running here, whose memory is theirs to keep.
    """
    budget, _ = budget_for(settings, layout_for(settings))
    box = with_own_slots(inventory(settings.gpus), own)
    result = plan(box, budget, base_port=settings.base_port, instances=parse_instances(settings.instances),
                  force=settings.force)
    return result, box.source


def find_nginx(name: str) -> str:
    found = shutil.which(name) or (shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin") if "/" not in name else None)
    if not found:
        raise ClusterError(
            f"nginx not found ({name!r} is not on PATH or in /usr/sbin): install it with "
            "'sudo apt-get install -y nginx', or point --nginx at the binary"
        )
    return found


def programs_for(settings: Settings) -> Programs:
    # As root, nginx's workers would drop to 'nobody' and could not write request-body
    # temp files in a private state dir; run them as the launcher's own user instead.
    user = pwd.getpwuid(os.geteuid()).pw_name if os.geteuid() == 0 else ""
    return Programs(app=str(layout_for(settings).instance_lib / "app.py"), launcher_python=sys.executable,
                    nginx=find_nginx(settings.nginx),
                    run_as_user=user, worker_processes=max(1, min(4, os.cpu_count() or 1)))


def make_dirs(layout: Layout) -> None:
    for directory in (layout.logs, layout.run, layout.nginx_dir, layout.gradio_tmp,
                      *(layout.nginx_temp(k) for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))):
        directory.mkdir(parents=True, exist_ok=True)
    os.chmod(layout.run, 0o700)


def read_health(layout: Layout) -> dict:
    """What the health loop last wrote (health.json): ``updated`` and its ``instances``
    tracks; {} when there is none (yet)."""
    try:
        health = json.loads(layout.health_json.read_text())
    except (OSError, ValueError):
        return {}
    return health if isinstance(health, dict) else {}


def health_tracks(layout: Layout) -> dict[str, dict]:
    return read_health(layout).get("instances", {})


def out_of_rotation(layout: Layout) -> frozenset[str]:
    """Instances the running health loop has taken out (kept out when re-rendering)."""
    return frozenset(name for name, track in health_tracks(layout).items() if not track.get("in_rotation"))


def render_to_disk(settings: Settings, own: tuple[Slot, ...] = (),
                   planned: Plan | None = None) -> tuple[Plan, Layout, list[Path]]:
    """Render every config into the state dir; returns the files whose content changed.

    The configs are first rendered into a scratch dir and checked with ``nginx -t``, so a
    bad setting never replaces a running cluster's files; each file is written atomically.
    """
    result = planned or make_plan(settings, own)[0]
    layout = layout_for(settings)
    programs = programs_for(settings)
    out = out_of_rotation(layout)
    files = render(settings, result, layout, programs, out)
    with tempfile.TemporaryDirectory(prefix="cvlb-check-") as scratch:
        trial = Layout(Path(scratch))
        make_dirs(trial)
        for relative, text in render(settings, result, trial, programs, out).items():
            write_atomic(trial.root / relative, text)
        check_nginx(settings, trial)
    make_dirs(layout)
    changed = []
    staged = {layout.relative(layout.instance_lib / name): text for name, text in instance_files().items()}
    for relative, text in {**files, **staged}.items():
        path = layout.root / relative
        if not path.exists() or path.read_text() != text:
            write_atomic(path, text)
            changed.append(path)
    return result, layout, changed


def render_only(settings: Settings) -> tuple[Plan, Layout, list[Path]]:
    """`cosyvoice-lb render`: never touches the files of a running cluster."""
    layout = layout_for(settings)
    if Supervisor(layout).running():
        raise ClusterError(f"a cluster runs in {layout.root}: 'cosyvoice-lb up' applies new settings to it; "
                           "to look at a config, render into another --state-dir")
    if settings.resolved_engine == "cosyvoice3":
        check_model(settings)
    return render_to_disk(settings)


def check_nginx(settings: Settings, layout: Layout) -> None:
    done = subprocess.run(
        [find_nginx(settings.nginx), "-t", "-q", "-p", str(layout.nginx_dir), "-c", str(layout.nginx_conf),
         "-e", str(layout.log("nginx-error"))],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        raise ClusterError(f"nginx rejects the rendered config, nothing was changed:\n{done.stderr.strip()}")


# Run by the instances' Python: which of the modules an instance imports are missing there.
ENV_PROBE = """
import importlib, importlib.util, json, sys
sys.path[:0] = [p for p in sys.argv[2:] if p]
missing, versions = [], {}
for name in sys.argv[1].split(","):
    try:
        found = importlib.util.find_spec(name) is not None
    except Exception:
        found = False
    if not found:
        missing.append(name)
try:
    import gradio
    versions["gradio"] = gradio.__version__
except Exception:
    pass
broken = ""
for name in sys.argv[1].split(","):  # the model package: import it for real, its dependencies too
    if name.startswith("cosyvoice") and name not in missing:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if (exc.name or name) not in missing:
                missing.append(exc.name or name)
        except Exception as exc:
            broken = f"{type(exc).__name__}: {exc}"
print(json.dumps({"missing": missing, "broken": broken, "python": sys.version.split()[0], "versions": versions}))
"""
# module -> what to pip install
INSTANCE_NEEDS = {"numpy": "numpy", "soundfile": "soundfile", "fastapi": "fastapi", "uvicorn": "uvicorn",
                  "gradio": "gradio", "multipart": "python-multipart"}
ENGINE_NEEDS = {"espeak": {"pypinyin": "pypinyin"}, "cosyvoice3": {"torch": "torch"}, "simulated": {}}


def check_instance_env(settings: Settings) -> dict:
    """Ask the instances' Python what it lacks; refuse with the exact install command."""
    engine = settings.resolved_engine
    needs = {**INSTANCE_NEEDS, **ENGINE_NEEDS[engine]}
    modules = list(needs) + (["cosyvoice.cli.cosyvoice"] if engine == "cosyvoice3" else [])
    roots = []
    if settings.cosyvoice_root:
        root = Path(settings.cosyvoice_root)
        roots = [str(root), str(root / "third_party" / "Matcha-TTS")]
    try:
        done = subprocess.run([settings.python, "-c", ENV_PROBE, ",".join(modules), *roots], capture_output=True,
                              text=True, timeout=120, check=False)
        report = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"--python {settings.python} could not be run to check its packages ({exc})") from None
    missing = [m for m in report["missing"] if m != "cosyvoice.cli.cosyvoice"]
    if missing:  # the instance's own packages, or what importing upstream CosyVoice needed
        packages = " ".join(sorted({needs.get(m, m.split(".")[0]) for m in missing}))
        raise ClusterError(f"the instances' Python ({settings.python}, Python {report['python']}) lacks "
                           f"{', '.join(missing)}: install with '{settings.python} -m pip install {packages}' "
                           "(nothing was started)")
    if report.get("broken"):
        raise ClusterError(f"the instances' Python cannot import upstream CosyVoice: {report['broken']} "
                           "(nothing was started)")
    if "cosyvoice.cli.cosyvoice" in report["missing"]:
        raise ClusterError("the instances' Python cannot import upstream CosyVoice (cosyvoice.cli.cosyvoice): "
                           "pass --cosyvoice-root with the checkout that holds cosyvoice/ and "
                           "third_party/Matcha-TTS (nothing was started)")
    return report


def check_tools(settings: Settings) -> None:
    """Everything `up` needs before it starts anything."""
    find_nginx(settings.nginx)
    if not Path(settings.python).exists():
        raise ClusterError(f"--python {settings.python} does not exist: name the Python that runs instances")
    if settings.resolved_engine == "espeak" and not shutil.which("espeak-ng"):
        raise ClusterError("espeak-ng not found: the embedded engine needs it; install it with "
                           "'sudo apt-get install -y espeak-ng'")
    if settings.resolved_engine == "cosyvoice3":
        check_model(settings)
    check_instance_env(settings)


def check_model(settings: Settings) -> None:
    from .engines.cosyvoice import model_version

    if not settings.model_dir:
        raise ClusterError("--engine cosyvoice3 needs --model-dir: a local CosyVoice model dir")
    try:
        model_version(settings.model_dir)
    except ValueError as exc:
        raise ClusterError(str(exc)) from None
    if settings.cosyvoice_root:
        root = Path(settings.cosyvoice_root)
        lacking = [p for p in ("cosyvoice", "third_party/Matcha-TTS/matcha") if not (root / p).is_dir()]
        if lacking:
            raise ClusterError(f"--cosyvoice-root {root} lacks {', '.join(lacking)}: point it at a checkout of "
                               "FunAudioLLM/CosyVoice with its submodules (git submodule update --init --recursive)")


def check_ports(settings: Settings, slots: tuple[Slot, ...], held: set[int]) -> None:
    """Refuse ports someone else holds (``held``: the running cluster's own)."""
    wanted = [(settings.host, settings.port, "public", "stop what holds it or choose another with --port")]
    wanted += [("127.0.0.1", s.port, f"{s.name}'s", "choose another range with --base-port") for s in slots]
    for host, port, what, hint in wanted:
        if port in held:
            continue
        why = processes.port_taken(host, port)
        if why:
            raise ClusterError(f"{what} port {port} on {host} is not free ({why}): {hint}")


# --- status ----------------------------------------------------------------------------

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
    failed: str = ""  # given up on after a crash loop: why (it stays stopped until restarted)
    failed_at: float = 0.0

    @property
    def serving(self) -> bool:
        return self.state == "RUNNING" and self.ready and self.in_rotation


@dataclass
class ClusterStatus:
    running: bool
    url: str = ""
    instances: list[InstanceStatus] = field(default_factory=list)
    nginx: dict = field(default_factory=dict)
    health: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if not self.running:
            return 3
        return 1 if self.problems else 0

    def instance(self, name: str) -> InstanceStatus | None:
        return next((i for i in self.instances if i.name == name), None)

    def as_dict(self) -> dict:
        return {
            "running": self.running, "ok": self.running and not self.problems, "url": self.url,
            "instances": [i.__dict__ for i in self.instances], "nginx": self.nginx, "health": self.health,
            "problems": self.problems,
        }


def ping(port: int, timeout: float = 2.0) -> dict:
    """An instance's /ping body ({} when it does not answer with one)."""
    try:
        body = LOOPBACK.get(f"http://127.0.0.1:{port}/ping", timeout=timeout).json()
        return body if isinstance(body, dict) else {}
    except (requests.RequestException, ValueError):
        return {}


def public_url(settings: Settings) -> str:
    host = settings.host
    if host in ("0.0.0.0", "*", ""):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "[::1]"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"


def nginx_answer(settings: Settings) -> int:
    """HTTP status of /ping through nginx (0: nginx does not answer)."""
    try:
        return LOOPBACK.get(public_url(settings) + "/ping", timeout=settings.probe_timeout + 1).status_code
    except requests.RequestException:
        return 0


def health_stale_after(settings: Settings) -> float:
    return max(10.0, 5 * settings.probe_interval + 2 * settings.probe_timeout)


def status(layout: Layout) -> ClusterStatus:
    supervisor = Supervisor(layout, timeout=5.0)
    record = recorded(layout)
    if not supervisor.running() or record is None:
        problems = [f"no cluster runs in {layout.root}"]
        strays = processes.stray_processes(layout, record[0].port if record else None)
        if strays:
            problems.append(f"{len(strays)} process(es) of it outlived supervisord "
                            f"(pids {', '.join(str(p.pid) for p in strays)}): 'cosyvoice-lb down' stops them")
        return ClusterStatus(running=False, problems=problems)
    settings, slots = record
    programs = supervisor.processes()
    health = read_health(layout)
    tracks = health.get("instances", {})
    result = ClusterStatus(running=True, url=public_url(settings))
    for slot in slots:
        proc = programs.get(slot.name)
        body = ping(slot.port, timeout=settings.probe_timeout) if proc and proc.state == "RUNNING" else {}
        track = tracks.get(slot.name, {})
        ready = bool(body.get("ready"))
        in_rotation = bool(track.get("in_rotation")) and track.get("pid") == (proc.pid if proc else None)
        failed = track.get("failed", "") or ("failed: supervisord gave up starting it"
                                             if proc and proc.state == "FATAL" else "")
        item = InstanceStatus(
            name=slot.name, port=slot.port, gpu=slot.gpu, pid=proc.pid if proc else 0,
            state=proc.state if proc else "MISSING", ready=ready, in_rotation=in_rotation,
            restarts=max(0, layout.starts_count(slot.name) - 1), uptime=round(proc.uptime, 1) if proc else 0.0,
            reason="" if in_rotation else track.get("reason", ""), inflight=int(body.get("inflight", 0)),
            failed=failed, failed_at=float(track.get("failed_at", 0.0)) if track.get("failed") else 0.0,
        )
        result.instances.append(item)
        if failed:
            result.problems.append(f"{slot.name} {failed}; see 'cosyvoice-lb logs {slot.name}', fix the cause, "
                                   f"then 'cosyvoice-lb restart {slot.name}'")
        elif item.state != "RUNNING" or not ready:
            result.problems.append(f"{slot.name} is {item.state.lower()}{'' if ready else ', not ready'}")
        elif not in_rotation:
            result.problems.append(f"{slot.name} is ready but not in nginx's rotation yet")
    for name in SERVICES:
        proc = programs.get(name)
        info = {"state": proc.state if proc else "MISSING", "pid": proc.pid if proc else 0}
        setattr(result, name, info)
        if info["state"] != "RUNNING":
            result.problems.append(f"{name} is {info['state'].lower()}")
    answer = nginx_answer(settings)
    result.nginx.update(port=settings.port, url=result.url, answers=answer)
    if result.nginx["state"] == "RUNNING" and answer == 0:
        result.problems.append(f"nginx does not answer on {result.url}")
    age = time.time() - float(health.get("updated", 0))
    result.health["updated_seconds_ago"] = round(age, 1) if health else None
    if result.health["state"] == "RUNNING" and age > health_stale_after(settings):
        result.problems.append(f"the health loop has not reported for {age:.0f}s (hung?)")
    return result


# --- waiting ---------------------------------------------------------------------------

def wait_serving(layout: Layout, settings: Settings, names: list[str], on_progress: Report,
                 poll: float = 0.25, replacing: dict[str, int] | None = None) -> ClusterStatus:
    """Wait until each named instance serves (ready and in rotation; for ``replacing``,
    a process other than the pid given) or has failed, and nginx answers.

    An instance has failed when the health loop gave up on it (a crash loop: it tells
    restarts it ordered from crashes) or supervisord did (FATAL). One seen serving once is
    done, even if it is recycled while the others are waited for. The others are still
    waited for; :class:`ClusterError` only when none of them serves.
    """
    supervisor = Supervisor(layout)
    replacing = replacing or {}
    since = time.time()  # a failure the health loop recorded before this wait is not this start's
    deadline = time.monotonic() + settings.startup_timeout + settings.drain_timeout + 30
    failed: dict[str, str] = {}
    served: set[str] = set()
    while True:
        current = status(layout)
        for item in current.instances:
            if item.name not in names:
                continue
            if item.serving and item.pid != replacing.get(item.name):
                served.add(item.name)
            recorded = item.failed if item.failed_at >= since or item.state == "FATAL" else ""
            if item.name not in failed and item.name not in served and recorded:
                failed[item.name] = recorded
            item.failed = failed.get(item.name, "")
        for service in SERVICES:
            state = getattr(current, service).get("state")
            if state in ("FATAL", "BACKOFF", "EXITED", "MISSING"):
                raise ClusterError(f"{service} does not stay up ({state}); last log lines:\n"
                                   f"{last_lines(supervisor, service)}")
        waiting = [i for i in current.instances
                   if i.name in names and i.name not in served and i.name not in failed]
        if not waiting and failed and len(failed) == len(names):
            first = "no instance could start:" if len(names) > 1 else f"{names[0]} could not start:"
            raise ClusterError("\n".join([first] + failure_report(layout, current, names)))
        if not waiting and current.nginx.get("answers") == 200:
            on_progress(Progress(len(names) - len(failed), len(names),
                                 "all ready" if not failed else f"{len(failed)} failed: {', '.join(failed)}"))
            return current
        detail = ", ".join(i.name + (f" ({i.reason})" if i.reason else "") for i in waiting) or "nginx"
        on_progress(Progress(len(names) - len(waiting) - len(failed), len(names), "waiting for " + detail))
        if time.monotonic() > deadline:
            if len(waiting) + len(failed) < len(names):  # some serve: the slow ones are reported, not fatal
                for item in waiting:
                    item.failed = failed[item.name] = (f"failed: not ready within --startup-timeout "
                                                       f"{settings.startup_timeout:.0f}s")
                on_progress(Progress(len(names) - len(failed), len(names), f"{len(failed)} failed"))
                return current
            tails = "\n".join(f"--- {i.name} ({layout.log(i.name)}):\n{last_lines(supervisor, i.name, 8)}"
                              for i in waiting)
            raise ClusterError(
                f"not ready within --startup-timeout {settings.startup_timeout:.0f}s: "
                f"{'; '.join(current.problems) or 'nginx does not answer /ping with 200'}\n{tails}"
            )
        time.sleep(poll)


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


# --- up --------------------------------------------------------------------------------

def up(settings: Settings, on_progress: Report = lambda p: None) -> ClusterStatus:
    """Start the cluster, or bring a running one to these settings; wait until all ready."""
    layout = layout_for(settings)
    check_tools(settings)
    supervisor = Supervisor(layout)
    previous = recorded(layout) if supervisor.running() else None
    if previous is None:
        return _start(settings, layout, supervisor, on_progress)
    return _update(settings, layout, supervisor, previous, on_progress)


def _start(settings: Settings, layout: Layout, supervisor: Supervisor, on_progress: Report) -> ClusterStatus:
    result, _ = make_plan(settings)
    check_ports(settings, result.slots, held=set())
    if layout.run.is_dir():  # restarts are counted from this up; old requests are void
        for stale in [*layout.run.glob("*.starts"), *layout.run.glob("*.restart")]:
            stale.unlink()
    layout.health_json.unlink(missing_ok=True)
    result, layout, _ = render_to_disk(settings, planned=result)
    supervisor.start_daemon()
    try:
        if settings.staggered:  # one model load at a time: each instance serves before the next starts
            for slot in result.slots:
                on_progress(Progress(slot.index, len(result.slots), f"starting {slot.name} (--stagger)"))
                supervisor.start(slot.name)
                try:
                    wait_serving(layout, settings, [slot.name], on_progress)
                except ClusterError:  # this one failed: the others may still serve (checked below)
                    pass
        # Serving with some instances failed is still serving: they are reported, not fatal.
        return wait_serving(layout, settings, [s.name for s in result.slots], on_progress)
    except ClusterError as exc:
        down(layout)
        raise ClusterError(f"{exc}\nThe cluster was stopped; logs are in {layout.logs}") from None


def _update(settings: Settings, layout: Layout, supervisor: Supervisor,
            previous: tuple[Settings, tuple[Slot, ...]], on_progress: Report) -> ClusterStatus:
    """Apply new settings to a running cluster, one instance at a time."""
    old_settings, old_slots = previous
    result, _ = make_plan(settings, own=old_slots)
    check_ports(settings, result.slots, held={old_settings.port, *(s.port for s in old_slots)})
    result, layout, changed = render_to_disk(settings, own=old_slots, planned=result)
    names = [s.name for s in result.slots]
    if changed:
        added, groups_changed, removed = supervisor.reload()
        # The health loop reads its slots at start; it re-publishes the rotation at once.
        supervisor.stop("health")
        supervisor.start("health", wait=True)  # it must be there to drain the instances replaced below
        for name in removed:
            supervisor.remove_group(name)
            layout.starts(name).unlink(missing_ok=True)
        for name in added:
            supervisor.add_group(name)
        supervisor.signal("nginx", "HUP")
        # New instance code (staged in run/lib) means every instance is "changed".
        if any(layout.instance_lib in path.parents for path in changed):
            groups_changed = sorted(set(groups_changed) | (set(names) - set(added)))
        # Changed instances are replaced one after another, each serving before the next:
        # out of rotation and idle first (the health loop's drain), then the new config.
        for name in [n for n in groups_changed if n not in SERVICES]:
            on_progress(Progress(0, len(names), f"replacing {name} with its new settings"))
            others_serving(layout, settings, name, on_progress)
            old = drain(layout, settings, supervisor, [name], "HOLD", on_progress)
            supervisor.remove_group(name)
            supervisor.add_group(name)
            serving_or_fail(layout, settings, [name], on_progress, old)
        if "nginx" in groups_changed:
            supervisor.remove_group("nginx")
            supervisor.add_group("nginx")
    return wait_serving(layout, settings, names, on_progress)


# --- restart, down, logs ---------------------------------------------------------------

def restart(layout: Layout, names: list[str] | None = None, on_progress: Report = lambda p: None,
            rolling: bool = True) -> list[str]:
    """Restart the named programs (every instance when ``names`` is None). Instances get a
    drained restart: out of nginx's rotation first, stopped once their requests are done.
    ``rolling``: one at a time, each serving again before the next goes; otherwise all at
    once (an outage while they load)."""
    supervisor = Supervisor(layout)
    record = recorded(layout)
    if not supervisor.running() or record is None:
        raise ClusterError(f"no cluster runs in {layout.root}: start it with 'cosyvoice-lb up'")
    settings, slots = record
    instances = [s.name for s in slots]
    # --all --rolling keeps capacity: each waits for the others to serve. Names given by
    # hand are restarted as asked.
    careful = names is None and rolling
    names = instances if names is None else names
    known = supervisor.processes()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ClusterError(f"no program named {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    for name in [n for n in names if n in SERVICES]:
        on_progress(Progress(0, 1, f"restarting {name}"))
        supervisor.stop(name)
        supervisor.start(name)
    current = {i.name: i for i in status(layout).instances}
    # Those not serving first: restarting them costs no capacity.
    targets = sorted((n for n in names if n in instances), key=lambda n: current[n].serving)
    for group in ([[n] for n in targets] if rolling else [targets] if targets else []):
        on_progress(Progress(0, len(group), f"restarting {', '.join(group)}"))
        if careful and current[group[0]].serving:
            others_serving(layout, settings, group[0], on_progress)
        old = drain(layout, settings, supervisor, group, "TERM", on_progress)
        for name in group:
            if name not in old:  # stopped (given up on after a crash loop, or crashed): start it
                supervisor.start(name)
        serving_or_fail(layout, settings, group, on_progress, old)
    return names


def others_serving(layout: Layout, settings: Settings, name: str, on_progress: Report) -> None:
    """Before a drained stop of ``name``: wait until every other instance (but those given
    up on) serves, so the stop costs one instance of capacity and never the last one."""
    deadline = time.monotonic() + settings.startup_timeout + 30
    while True:
        others = [i for i in status(layout).instances if i.name != name and not i.failed]
        short = [i.name for i in others if not i.serving]
        if not short:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"{', '.join(short)} did not serve within --startup-timeout: not stopping {name} "
                               "as well; see 'cosyvoice-lb status' (restart NAME restarts one regardless)")
        on_progress(Progress(len(others) - len(short), len(others), f"before {name}: waiting for {', '.join(short)}"))
        time.sleep(0.5)


def drain(layout: Layout, settings: Settings, supervisor: Supervisor, names: list[str], action: str,
          on_progress: Report) -> dict[str, int]:
    """Ask the health loop for a drained stop of ``names``: out of rotation, then (once their
    requests are done) TERM, or for HOLD nothing: the caller replaces them. Returns the pids
    of those that were running. Without a working health loop they are stopped directly
    (each still drains its own requests on TERM; nginx retries the ones it refuses)."""
    procs = supervisor.processes()
    running = {n: procs[n].pid for n in names if n in procs and procs[n].state in ("RUNNING", "STARTING")}
    for name in names:
        write_atomic(layout.restart_request(name), action + "\n")
    health_up = "health" in procs and procs["health"].state in ("RUNNING", "STARTING")
    deadline = time.monotonic() + (max(15.0, 10 * settings.probe_interval) if health_up else 0.0)
    while any(layout.restart_request(n).exists() for n in names) and time.monotonic() < deadline:
        time.sleep(0.1)
    ignored = [n for n in names if layout.restart_request(n).exists()]
    tracks = health_tracks(layout)
    for name in ignored:
        if not tracks.get(name, {}).get("failed"):  # (kept for one given up on: the health loop clears it)
            layout.restart_request(name).unlink(missing_ok=True)
        on_progress(Progress(0, len(names), f"the health loop did not take the request: stopping {name} directly"))
        if name in running:
            supervisor.stop(name)
            if action == "TERM":
                supervisor.start(name)
    held = [n for n in running if n not in ignored]
    if action == "HOLD" and held:
        deadline = time.monotonic() + settings.drain_timeout + max(15.0, 10 * settings.probe_interval)
        while time.monotonic() < deadline and not all(health_tracks(layout).get(n, {}).get("signalled_at")
                                                      for n in held):
            time.sleep(0.1)
    return running


def serving_or_fail(layout: Layout, settings: Settings, names: list[str], on_progress: Report,
                    replacing: dict[str, int]) -> ClusterStatus:
    """Wait for ``names`` (new processes) to serve; any of them failing is an error."""
    current = wait_serving(layout, settings, names, on_progress, replacing=replacing)
    report = failure_report(layout, current, names)
    if report:
        raise ClusterError("\n".join(report))
    return current


def down(layout: Layout, timeout: float | None = None) -> list[int]:
    """Stop everything the cluster started; returns the pids that were stopped."""
    supervisor = Supervisor(layout)
    record = recorded(layout)
    pids: list[int] = []
    if supervisor.running():
        drain = record[0].drain_timeout if record else 30.0
        root = psutil.Process(supervisor.pid())
        tree = [root] + root.children(recursive=True)
        pids = [p.pid for p in tree]
        # Stops by priority: the health loop, then the instances (each drains), then nginx.
        supervisor.shutdown()
        processes.stop(tree, timeout=drain * 2 + 30 if timeout is None else timeout, term=False)
    strays = processes.stray_processes(layout, record[0].port if record else None)
    if strays:
        pids += [p.pid for p in strays]
        processes.stop(strays, timeout=10)
    layout.socket.unlink(missing_ok=True)
    return pids


def instance_names(layout: Layout) -> list[str]:
    record = recorded(layout)
    return [s.name for s in record[1]] if record else []


def log_names(layout: Layout) -> list[str]:
    return sorted(p.stem for p in layout.logs.glob("*.log"))


# --- calibrate ---------------------------------------------------------------------------

def calibrate(settings: Settings, on_progress: Report = lambda p: None) -> dict:
    """Measure one instance's peak GPU memory through load, warm-up and a full-length, a
    streamed and a default request, and store it as the footprint `plan` and `up` use.

    Per process through NVML (the instance and its children: vLLM's engine runs in one);
    where NVML's pids match nothing (containers), the card's used memory above what it
    used before the instance started.
    """
    from .gpu import device_used, nvml_gpus, process_gpu_memory

    gpus, source = nvml_gpus()
    if not gpus:
        raise ClusterError(
            f"cannot calibrate: no GPU is visible to NVML ({source}). The footprint is measured per process "
            "on a GPU; here plan and up keep the defaults (see 'cosyvoice-lb plan'). Run calibrate on the GPU box")
    layout = layout_for(settings)
    trial = dataclasses.replace(settings, state_dir=str(layout.root / "calibrate"), instances="1", force=True,
                                gpus="", port=settings.port + 1000, base_port=settings.base_port + 1000)
    card = gpus[0].index  # a one-instance plan pins it to the first card
    baseline = device_used(card)
    peak = {"process": 0, "device": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                pids = set()
                for proc in psutil.process_iter():
                    if _is_instance(proc, layout_for(trial)):
                        pids |= {proc.pid, *(c.pid for c in proc.children(recursive=True))}
                peak["process"] = max(peak["process"], sum(process_gpu_memory(pids).values()))
                peak["device"] = max(peak["device"], device_used(card) - baseline)
            except Exception as exc:  # keep sampling: one bad read must not end the measurement
                log_line = f"sampling GPU memory failed once: {exc}"
                on_progress(Progress(0, 1, log_line))
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        current = up(trial, on_progress)
        url = current.url + "/v1/tts"
        longest = ("This sentence is repeated to reach the longest text an instance accepts. " * 20)[:settings.max_chars]
        for body in ({"text": longest}, {"text": longest, "stream": True}, {"text": "A short one."}):
            on_progress(Progress(0, 1, f"synthesizing ({len(body['text'])} chars{', streamed' if body.get('stream') else ''})"))
            LOOPBACK.post(url, json=body, timeout=settings.hang_timeout).raise_for_status()
    except requests.RequestException as exc:
        raise ClusterError(f"calibration request failed: {exc}") from None
    finally:
        stop.set()
        sampler.join(timeout=5)
        down(layout_for(trial))
    measured = peak["process"] or peak["device"]
    if measured <= 0:
        raise ClusterError("the instance ran but NVML saw no GPU memory for it: is it pinned to a GPU?")
    entry = {"gpu_bytes": int(measured * 1.1), "peak_bytes": measured, "gpu": gpus[0].name,
             "how": "per process" if peak["process"] else "card used memory above the baseline",
             "when": time.strftime("%Y-%m-%d %H:%M")}
    try:
        stored = json.loads(layout.footprint_json.read_text())
    except (OSError, ValueError):
        stored = {}
    stored[flags_key(settings)] = entry
    make_dirs(layout)
    write_atomic(layout.footprint_json, json.dumps(stored, indent=2) + "\n")
    return entry


def _is_instance(proc: psutil.Process, layout: Layout) -> bool:
    try:
        return "--starts-file" in proc.cmdline() and processes.is_cluster_program(proc.cmdline(), layout)
    except psutil.Error:
        return False
