"""The cluster's lifecycle: plan, render to disk, up, status, restart, down.

This is the edge where the pure core (planner, render) meets the box: files, ports,
nginx, supervisord and HTTP. The CLI calls these functions and prints what they return.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil
import requests

from .files import write_atomic
from .gpu import inventory
from .health import LOOPBACK
from .planner import Budget, Plan, PlanError, parse_size, plan
from .render import Layout, Programs, read_cluster_json, render
from .resources import app_path
from .settings import ENGINE_FOOTPRINTS, Settings
from .supervision import ProcessInfo, Supervisor, read_tail

SERVICES = ("nginx", "health")


class ClusterError(RuntimeError):
    """A user-facing failure: the message says what went wrong and what to do."""


def layout_for(settings_or_dir: Settings | str) -> Layout:
    state_dir = settings_or_dir.state_dir if isinstance(settings_or_dir, Settings) else settings_or_dir
    return Layout(Path(state_dir).expanduser().resolve())


def parse_instances(value: str) -> int | None:
    text = str(value).strip().lower()
    if text in ("", "auto"):
        return None
    if not text.isdigit() or int(text) < 1:
        raise PlanError(f"--instances {value!r}: give a number of instances (1 or more) or 'auto'")
    return int(text)


def make_plan(settings: Settings) -> tuple[Plan, str]:
    """The plan for these settings on this box, and where the GPU list came from."""
    defaults = ENGINE_FOOTPRINTS[settings.engine]
    footprint = settings.footprint
    budget = Budget(
        gpu_footprint=parse_size(footprint or defaults["gpu"]),
        host_footprint=parse_size(footprint or defaults["host"]),
        reserve=parse_size(settings.reserve),
        max_instances=settings.max_instances or None,
    )
    box = inventory(settings.gpus)
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
    return Programs(app=str(app_path()), launcher_python=sys.executable,
                    nginx=find_nginx(settings.nginx), run_as_user=user,
                    worker_processes=max(1, min(4, os.cpu_count() or 1)))


def make_dirs(layout: Layout) -> None:
    for directory in (layout.logs, layout.run, layout.nginx_dir, layout.gradio_tmp,
                      *(layout.nginx_temp(k) for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))):
        directory.mkdir(parents=True, exist_ok=True)
    os.chmod(layout.run, 0o700)


def out_of_rotation(layout: Layout) -> frozenset[str]:
    """Instances the running health loop has taken out (kept out when re-rendering)."""
    try:
        tracks = json.loads(layout.health_json.read_text())["instances"]
    except (OSError, ValueError, KeyError):
        return frozenset()
    return frozenset(name for name, track in tracks.items() if not track.get("in_rotation"))


def render_to_disk(settings: Settings) -> tuple[Plan, Layout, list[Path]]:
    """Render every config into the state dir; returns the files whose content changed.

    The configs are first rendered into a scratch dir and checked with ``nginx -t``, so a
    bad setting never replaces a running cluster's files; each file is written atomically.
    """
    result, _source = make_plan(settings)
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
    for relative, text in files.items():
        path = layout.root / relative
        if not path.exists() or path.read_text() != text:
            write_atomic(path, text)
            changed.append(path)
    return result, layout, changed


def check_nginx(settings: Settings, layout: Layout) -> None:
    done = subprocess.run(
        [find_nginx(settings.nginx), "-t", "-q", "-p", str(layout.nginx_dir), "-c", str(layout.nginx_conf),
         "-e", str(layout.log("nginx-error"))],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        raise ClusterError(f"nginx rejects the rendered config:\n{done.stderr.strip()}\n"
                           "check --host and --port; nothing was changed")


def port_owner(port: int) -> str:
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                try:
                    proc = psutil.Process(conn.pid)
                    return f" by pid {conn.pid} ({' '.join(proc.cmdline()[:3]) or proc.name()})"
                except psutil.Error:
                    return f" by pid {conn.pid}"
    except (psutil.Error, OSError):
        pass
    return ""


def check_port(host: str, port: int, what: str, hint: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ClusterError(f"{what} port {port} on {host} is not free ({exc.strerror}){port_owner(port)}: "
                               f"{hint}") from None


def check_tools(settings: Settings) -> None:
    if settings.engine == "espeak" and not shutil.which("espeak-ng"):
        raise ClusterError("espeak-ng not found: the embedded engine needs it; install it with "
                           "'sudo apt-get install -y espeak-ng'")
    if not Path(settings.python).exists():
        raise ClusterError(f"--python {settings.python} does not exist: name the Python that runs instances")


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

    def as_dict(self) -> dict:
        return {
            "running": self.running, "ok": self.running and not self.problems, "url": self.url,
            "instances": [i.__dict__ for i in self.instances], "nginx": self.nginx, "health": self.health,
            "problems": self.problems,
        }


def count_restarts(layout: Layout, name: str) -> int:
    try:
        starts = sum(1 for line in layout.starts(name).read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0
    return max(0, starts - 1)


def ping(port: int, timeout: float = 2.0) -> dict:
    try:
        response = LOOPBACK.get(f"http://127.0.0.1:{port}/ping", timeout=timeout)
        body = response.json()
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


def status(layout: Layout) -> ClusterStatus:
    supervisor = Supervisor(layout, timeout=5.0)
    if not supervisor.running():
        problems = [f"no cluster runs in {layout.root}"]
        strays = stray_processes(layout)
        if strays:
            problems.append(f"{len(strays)} process(es) of it outlived supervisord "
                            f"(pids {', '.join(str(p.pid) for p in strays)}): 'cosyvoice-lb down' stops them")
        return ClusterStatus(running=False, problems=problems)
    settings, slots = read_cluster_json(layout.cluster_json.read_text())
    processes = supervisor.processes()
    try:
        health = json.loads(layout.health_json.read_text())
    except (OSError, ValueError):
        health = {}
    tracks = health.get("instances", {})
    result = ClusterStatus(running=True, url=public_url(settings))
    for slot in slots:
        proc = processes.get(slot.name)
        body = ping(slot.port, timeout=settings.probe_timeout) if proc and proc.state == "RUNNING" else {}
        track = tracks.get(slot.name, {})
        ready = bool(body.get("ready"))
        in_rotation = bool(track.get("in_rotation")) and track.get("pid") == (proc.pid if proc else None)
        item = InstanceStatus(
            name=slot.name, port=slot.port, gpu=slot.gpu, pid=proc.pid if proc else 0,
            state=proc.state if proc else "MISSING", ready=ready, in_rotation=in_rotation,
            restarts=count_restarts(layout, slot.name), uptime=round(proc.uptime, 1) if proc else 0.0,
            reason=track.get("reason", "") if not in_rotation else "", inflight=int(body.get("inflight", 0)),
        )
        result.instances.append(item)
        if item.state != "RUNNING" or not ready:
            result.problems.append(f"{slot.name} is {item.state.lower()}{'' if ready else ', not ready'}")
        elif not in_rotation:
            result.problems.append(f"{slot.name} is ready but not in nginx's rotation yet")
    for name in SERVICES:
        proc = processes.get(name)
        info = {"state": proc.state if proc else "MISSING", "pid": proc.pid if proc else 0}
        if name == "nginx":
            info["port"] = settings.port
            info["url"] = result.url
        else:
            info["updated"] = health.get("updated", 0)
        setattr(result, name, info)
        if info["state"] != "RUNNING":
            result.problems.append(f"{name} is {info['state'].lower()}")
    return result


# --- up --------------------------------------------------------------------------------

@dataclass
class Progress:
    """What `up` reports while it waits."""

    ready: int
    total: int
    detail: str


def up(settings: Settings, on_progress: Callable[[Progress], None] = lambda p: None,
       poll: float = 0.25) -> ClusterStatus:
    """Start the cluster (or bring a running one to these settings) and wait until all ready."""
    layout = layout_for(settings)
    find_nginx(settings.nginx)
    check_tools(settings)
    supervisor = Supervisor(layout)
    already = supervisor.running()
    if not already:
        check_port(settings.host, settings.port, "public", "stop what holds it or choose another with --port")
        result, _ = make_plan(settings)
        for slot in result.slots:
            check_port("127.0.0.1", slot.port, f"{slot.name}'s", "choose another range with --base-port")
        for name in [p.stem for p in layout.run.glob("*.starts")]:  # restarts count from this up
            layout.starts(name).unlink(missing_ok=True)
        layout.health_json.unlink(missing_ok=True)
    result, layout, changed = render_to_disk(settings)
    if already:
        if changed:
            applied = supervisor.update()
            # The health loop reads the slots at start: restart it to pick up the new set;
            # it re-publishes the rotation, and nginx reloads gracefully.
            supervisor.stop("health")
            supervisor.start("health")
            supervisor.signal("nginx", "HUP")
            on_progress(Progress(0, len(result.slots), f"updated running cluster: {applied}"))
    else:
        supervisor.start_daemon()
    try:
        return wait_ready(layout, settings, len(result.slots), on_progress, poll)
    except ClusterError:
        if not already:
            down(layout)
        raise


def wait_ready(layout: Layout, settings: Settings, total: int, on_progress: Callable[[Progress], None],
               poll: float) -> ClusterStatus:
    supervisor = Supervisor(layout)
    deadline = time.monotonic() + settings.startup_timeout + 30
    while True:
        current = status(layout)
        ready = [i for i in current.instances if i.ready and i.in_rotation]
        failed = [i for i in current.instances if i.state == "FATAL"]
        if failed:
            name = failed[0].name
            raise ClusterError(
                f"{name} could not start (gave up after {settings.start_retries} tries); last log lines of "
                f"{layout.log(name)}:\n{_last_lines(supervisor, name)}\nThe cluster was stopped."
            )
        if current.exit_code == 0 and len(ready) == total and _nginx_answers(settings):
            on_progress(Progress(len(ready), total, "all ready"))
            return current
        for service in SERVICES:
            proc = getattr(current, service)
            if proc.get("state") in ("FATAL", "BACKOFF", "EXITED"):
                raise ClusterError(f"{service} does not stay up ({proc['state']}); last log lines:\n"
                                   f"{_last_lines(supervisor, service)}\nThe cluster was stopped.")
        waiting = [i.name + (f" ({i.reason})" if i.reason else "") for i in current.instances if i not in ready]
        on_progress(Progress(len(ready), total, "waiting for " + ", ".join(waiting) if waiting else "nginx"))
        if time.monotonic() > deadline:
            raise ClusterError(
                f"not all instances were ready within {settings.startup_timeout:.0f}s "
                f"(--startup-timeout): {'; '.join(current.problems)}. The cluster was stopped; "
                f"see the logs in {layout.logs}"
            )
        time.sleep(poll)


def _last_lines(supervisor: Supervisor, name: str, lines: int = 20) -> str:
    text = supervisor.tail(name, 8000)
    if name == "nginx":
        text += read_tail(supervisor.layout.log("nginx-error"), 4000)
    return "\n".join(text.strip().splitlines()[-lines:]) or "(empty log)"


def _nginx_answers(settings: Settings) -> bool:
    try:
        return LOOPBACK.get(public_url(settings) + "/ping", timeout=settings.probe_timeout + 1).status_code == 200
    except requests.RequestException:
        return False


# --- down, restart, logs ---------------------------------------------------------------

def stray_processes(layout: Layout) -> list[psutil.Process]:
    """Processes of this cluster that outlived their supervisord (e.g. it was SIGKILLed).

    Found by their command lines (every program names a path in the state dir) and, for
    nginx workers, whose command line names nothing, by the public port they listen on.
    """
    inside = (str(layout.run) + os.sep, str(layout.nginx_dir) + os.sep)
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        args = proc.info["cmdline"] or []
        if any(a.startswith(inside) for a in args) or any(
                a == "--state-dir" and b == str(layout.root) for a, b in zip(args, args[1:])):
            found[proc.pid] = proc
    try:
        settings, _ = read_cluster_json(layout.cluster_json.read_text())
        for conn in psutil.net_connections(kind="tcp"):
            if conn.pid and conn.laddr and conn.laddr.port == settings.port and conn.status == psutil.CONN_LISTEN:
                proc = psutil.Process(conn.pid)
                if "nginx" in proc.name():
                    found[proc.pid] = proc
    except (OSError, ValueError, KeyError, psutil.Error):
        pass
    found.pop(os.getpid(), None)
    return list(found.values())


def _terminate(procs: list[psutil.Process], timeout: float) -> None:
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _gone, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def down(layout: Layout, timeout: float | None = None) -> list[int]:
    """Stop everything the cluster started; returns the pids that were stopped."""
    supervisor = Supervisor(layout)
    pids: list[int] = []
    if supervisor.running():
        try:
            settings, _ = read_cluster_json(layout.cluster_json.read_text())
            drain = settings.drain_timeout
        except (OSError, ValueError, KeyError):
            drain = 30.0
        root_pid = supervisor.pid()
        try:
            tree = [psutil.Process(root_pid)] + psutil.Process(root_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        pids = [p.pid for p in tree]
        supervisor.shutdown()  # stops programs by priority: nginx (graceful), health, instances
        _gone, alive = psutil.wait_procs(tree, timeout=drain * 2 + 30 if timeout is None else timeout)
        for proc in alive:  # anything that outlived the drain (e.g. a stuck child)
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
    strays = stray_processes(layout)
    if strays:
        pids += [p.pid for p in strays]
        _terminate(strays, timeout=10)
    layout.socket.unlink(missing_ok=True)
    return pids


def restart(layout: Layout, names: list[str] | None = None) -> list[str]:
    """Restart the named programs, or every instance when ``names`` is None."""
    supervisor = Supervisor(layout)
    if not supervisor.running():
        raise ClusterError(f"no cluster runs in {layout.root}: start it with 'cosyvoice-lb up'")
    if names is None:
        names = instance_names(layout)
    known = supervisor.processes()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ClusterError(f"no program named {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    for name in names:
        supervisor.stop(name)
        supervisor.start(name)
    return names


def instance_names(layout: Layout) -> list[str]:
    _settings, slots = read_cluster_json(layout.cluster_json.read_text())
    return [s.name for s in slots]


def log_names(layout: Layout) -> list[str]:
    return sorted(p.stem for p in layout.logs.glob("*.log"))


def process_info(layout: Layout) -> dict[str, ProcessInfo]:
    return Supervisor(layout).processes()
