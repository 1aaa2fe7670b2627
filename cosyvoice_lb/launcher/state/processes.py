"""Process and port facts from the OS (psutil): who holds a port, what a cluster left behind."""

from __future__ import annotations

import os
import socket

import psutil

from cosyvoice_lb.launcher.compat import MODULES
from cosyvoice_lb.launcher.state.layout import Layout


def listeners(port: int) -> list[psutil.Process]:
    """Processes listening on a TCP port (any address)."""
    found: dict[int, psutil.Process] = {}
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.pid and conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                try:
                    found[conn.pid] = psutil.Process(conn.pid)
                except psutil.NoSuchProcess:
                    pass
    except (psutil.Error, OSError):
        pass
    return list(found.values())


def port_owner(port: int) -> str:
    """`` by pid N (command)`` for the first listener on ``port``, or ``""``."""
    for proc in listeners(port):
        try:
            return f" by pid {proc.pid} ({' '.join(proc.cmdline()[:3]) or proc.name()})"
        except psutil.Error:
            return f" by pid {proc.pid}"
    return ""


def port_taken(host: str, port: int) -> str:
    """Why ``port`` cannot be bound on ``host`` (``""`` when it can)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as exc:
            return f"{exc.strerror}{port_owner(port)}"
    return ""


def is_cluster_program(args: list[str], layout: Layout) -> bool:
    """True for the command line of a program the cluster in ``layout`` runs.

    Each program names its own file in the state dir: supervisord and nginx their config
    (``-c``), an instance its ``--starts-file``, the health loop ``cosyvoice_lb.launcher.health.loop
    --state-dir`` and the control panel ``cosyvoice_lb.launcher.panel.server --state-dir``. Nothing else
    matches, not even a ``cosyvoice-lb logs -f`` on the dir.
    """
    pairs = list(zip(args, args[1:]))
    if ("-c", str(layout.supervisord_conf)) in pairs or ("-c", str(layout.nginx_conf)) in pairs:
        return True
    if f"--config.file={layout.alertmanager_yml}" in args:  # (the cluster's Alertmanager)
        return True
    if any(
        flag in ("--starts-file", "--pipe-dir") and value.startswith(str(layout.run) + os.sep) for flag, value in pairs
    ):  # (an instance; a CUDA MPS daemon's wrapper)
        return True
    modules = {"cosyvoice_lb.launcher.health.loop", "cosyvoice_lb.launcher.panel.server", "cosyvoice_lb.jobs"}
    modules |= {shim.old for shim in MODULES if shim.new in modules}  # (a cluster an older version started)
    return any(m in args for m in modules) and ("--state-dir", str(layout.root)) in pairs


def _listens_on(proc: psutil.Process, port: int) -> bool:
    """Whether ``proc`` itself holds a listening socket on ``port``: per process, since
    workers share their master's socket and the system-wide view names one pid per socket."""
    try:
        conns = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections("tcp")
    except psutil.Error:
        return False
    return any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in conns)


def nginx_on_port(port: int) -> list[psutil.Process]:
    """nginx processes that themselves hold a listening socket on ``port`` (every worker,
    not only the one pid the system-wide socket table names)."""
    found = []
    for proc in psutil.process_iter(["name"]):
        if "nginx" in (proc.info["name"] or "") and _listens_on(proc, port):
            found.append(proc)
    return found


def orphan_nginx(port: int, master_pid: int) -> list[psutil.Process]:
    """nginx workers whose master is gone and that still hold ``port`` (never a master, nor
    a worker of another nginx, e.g. the system's or another cluster's).

    When an nginx master is SIGKILLed its workers live on and keep the port, so the master
    supervisord starts next can never bind it.
    """
    orphans = []
    for proc in nginx_on_port(port):
        try:
            if proc.pid == master_pid or "worker process" not in " ".join(proc.cmdline()):
                continue
            parent = proc.parent()  # an orphan's master is gone: another nginx's workers have theirs
            if parent is None or "nginx" not in parent.name():
                orphans.append(proc)
        except psutil.Error:
            pass
    return orphans


def stray_processes(layout: Layout, public_port: int | None) -> list[psutil.Process]:
    """Programs of this cluster that outlived their supervisord (e.g. it was SIGKILLed)."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        if is_cluster_program(proc.info["cmdline"] or [], layout):
            found[proc.pid] = proc
    if public_port:  # nginx workers name nothing; they hold the public port
        found.update((proc.pid, proc) for proc in nginx_on_port(public_port))
    found.pop(os.getpid(), None)
    return list(found.values())


def stop(procs: list[psutil.Process], timeout: float, term: bool = True) -> None:
    """TERM (unless ``term`` is False), wait up to ``timeout``, then KILL what is left."""
    if term:
        for proc in procs:
            try:
                proc.terminate()
                proc.resume()  # a stopped (SIGSTOP) process acts on its TERM only once continued
            except psutil.NoSuchProcess:
                pass
    _gone, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
