"""Applying nginx's rendered config to the running nginx, checked rather than assumed: a
graceful reload, and a restart through supervisord where a reload cannot move the
listener (the new socket cannot be bound beside the old one: with ``reuseport`` on the
public listener it can, on the same port). Afterwards nginx runs the new config and listens where it says, or this raises.

What it acts on and reads is passed in: supervisord, a clock and a sleep for its waits, and
:class:`Watch`, what it reads of the running nginx (its processes, psutil) and of its error
log; tests script them, the cluster (``context.Cluster.of``) passes the real ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cosyvoice_lb.launcher.cluster.listeners import (
    Address,
    config_behind,
    describe,
    listening,
    nginx_listening,
    nginx_processes,
    wanted,
)
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.supervision import ALIVE, ProcessInfo, ProgramState, Supervisor, read_tail

# nginx retries a busy address for ~2.5 s before a reload gives up; then it logs why.
RELOAD_WAIT = 10.0
# A restarted nginx binds at once; supervisord may take a moment to start it.
RESTART_WAIT = 20.0
POLL = 0.1
# After a reload that took: the old workers close their listening sockets a moment later.
SETTLE = 3.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _new_errors(log: Path, offset: int) -> list[str]:
    try:
        with open(log, "rb") as handle:
            handle.seek(offset)
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if "[emerg]" in line or "[alert]" in line]


def _workers(master: int) -> set[int]:
    return {p.pid for p in nginx_processes(master)[1:]}


class NginxSupervision(Protocol):
    """What applying asks of supervisord (:class:`Supervisor`)."""

    def processes(self) -> dict[str, ProcessInfo]: ...
    def start(self, name: str, wait: bool = False) -> None: ...
    def stop(self, name: str, wait: bool = True) -> None: ...
    def signal(self, name: str, signal: str) -> None: ...


@dataclass(frozen=True)
class Watch:
    """What applying reads of the running nginx and its error log: the workers of a master
    and where it listens (psutil), the log's size and its ``[emerg]``/``[alert]`` lines past
    an offset, its last lines."""

    workers: Callable[[int], set[int]] = _workers
    listening: Callable[[int], set[Address]] = nginx_listening
    log_size: Callable[[Path], int] = _size
    new_errors: Callable[[Path, int], list[str]] = _new_errors
    tail: Callable[[Path, int], str] = read_tail


WATCH = Watch()  # the real one


def lagging(supervisor: Supervisor, layout: Layout, want: set[Address]) -> bool:
    """nginx is not where its config says, or runs an older config than the one on disk."""
    master = _master(supervisor)
    if not master:
        return True
    procs = nginx_processes(master)
    return listening(procs) != want or bool(config_behind(procs, (layout.nginx_conf, layout.upstreams_conf), grace=0))


def _master(supervisor: NginxSupervision) -> int:
    info = supervisor.processes().get("nginx")
    return info.pid if info is not None and info.state in ALIVE and info.pid else 0


def apply(
    supervisor: NginxSupervision,
    log: Path,
    host: str,
    port: int,
    say: Callable[[str], None] = lambda line: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    watch: Watch = WATCH,
) -> str:
    """Make the running nginx take its config on disk and listen on ``host:port``.
    Returns what it took: "reloaded", "restarted" or "started"."""
    want = wanted(host, port)
    master = _master(supervisor)
    if not master:
        supervisor.start("nginx")
        wait_listening(supervisor, log, want, clock, sleep, watch)
        return "started"
    before, offset = watch.workers(master), watch.log_size(log)
    supervisor.signal("nginx", "HUP")
    deadline, errors = clock() + RELOAD_WAIT, []
    while clock() < deadline:
        if watch.workers(master) - before:  # a reload that took starts new workers
            break
        errors = watch.new_errors(log, offset)
        if any("still could not bind" in line or "bind()" not in line for line in errors):
            break  # (a busy bind is retried for a while: its last word says it gave up)
        sleep(POLL)
    took = bool(watch.workers(master) - before)
    now, settle = watch.listening(master), clock() + SETTLE
    while took and now != want and clock() < settle:  # (old workers let go of their sockets)
        sleep(POLL)
        now = watch.listening(master)
    if took and now == want:
        return "reloaded"
    if now != want:
        say(
            f"nginx: a reload cannot move its listener from {describe(now)} to {describe(want)}; restarting it "
            "(new connections are refused until it listens again, requests in flight finish first)"
        )
        supervisor.stop("nginx")
        supervisor.start("nginx")
        wait_listening(supervisor, log, want, clock, sleep, watch)
        return "restarted"
    detail = "\n".join(errors[-3:]) or f"(no new worker within {RELOAD_WAIT:.0f}s and nothing in {log})"
    raise ClusterError(
        f"nginx did not take its new config (the reload failed; it still serves the previous one):\n{detail}\n"
        "fix the cause, then run 'cosyvoice-lb up' again (or 'cosyvoice-lb restart nginx')"
    )


def wait_listening(
    supervisor: NginxSupervision,
    log: Path,
    want: set[Address],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    watch: Watch = WATCH,
) -> None:
    """Until the (re)started nginx listens on ``want``; raises when it does not."""
    deadline, now = clock() + RESTART_WAIT, set()
    while clock() < deadline:
        info = supervisor.processes().get("nginx")
        now = watch.listening(info.pid) if info is not None and info.pid else set()
        # (it serves once it listens; supervisord calls it RUNNING after its startsecs)
        if now == want and info is not None and info.state == ProgramState.RUNNING:
            return
        sleep(POLL)
    tail = "\n".join(watch.tail(log, 2000).strip().splitlines()[-3:])
    raise ClusterError(
        f"nginx listens on {describe(now)} after a restart, not on {describe(want)} as its config says:\n{tail}\n"
        "see 'cosyvoice-lb logs nginx-error'; free the address, then run 'cosyvoice-lb up' again"
    )
