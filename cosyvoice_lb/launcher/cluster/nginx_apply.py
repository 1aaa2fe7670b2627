"""Applying nginx's rendered config to the running nginx, checked rather than assumed: a
graceful reload, and a restart through supervisord where a reload cannot move the
listener (the new socket cannot be bound beside the old one: with ``reuseport`` on the
public listener it can, on the same port). Afterwards nginx runs the new config and listens where it says, or this raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

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
from cosyvoice_lb.launcher.state.supervision import Supervisor, read_tail

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


def lagging(supervisor: Supervisor, layout: Layout, want: set[Address]) -> bool:
    """nginx is not where its config says, or runs an older config than the one on disk."""
    master = _master(supervisor)
    if not master:
        return True
    procs = nginx_processes(master)
    return listening(procs) != want or bool(config_behind(procs, (layout.nginx_conf, layout.upstreams_conf), grace=0))


def _master(supervisor: Supervisor) -> int:
    info = supervisor.processes().get("nginx")
    return info.pid if info is not None and info.state in ("RUNNING", "STARTING") and info.pid else 0


def apply(
    supervisor: Supervisor,
    log: Path,
    host: str,
    port: int,
    say: Callable[[str], None] = lambda line: None,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """Make the running nginx take its config on disk and listen on ``host:port``.
    Returns what it took: "reloaded", "restarted" or "started"."""
    want = wanted(host, port)
    master = _master(supervisor)
    if not master:
        supervisor.start("nginx")
        wait_listening(supervisor, log, want, clock)
        return "started"
    before, offset = _workers(master), _size(log)
    supervisor.signal("nginx", "HUP")
    deadline, errors = clock() + RELOAD_WAIT, []
    while clock() < deadline:
        if _workers(master) - before:  # a reload that took starts new workers
            break
        errors = _new_errors(log, offset)
        if any("still could not bind" in line or "bind()" not in line for line in errors):
            break  # (a busy bind is retried for a while: its last word says it gave up)
        time.sleep(POLL)
    took = bool(_workers(master) - before)
    now, settle = nginx_listening(master), clock() + SETTLE
    while took and now != want and clock() < settle:  # (old workers let go of their sockets)
        time.sleep(POLL)
        now = nginx_listening(master)
    if took and now == want:
        return "reloaded"
    if now != want:
        say(
            f"nginx: a reload cannot move its listener from {describe(now)} to {describe(want)}; restarting it "
            "(new connections are refused until it listens again, requests in flight finish first)"
        )
        supervisor.stop("nginx")
        supervisor.start("nginx")
        wait_listening(supervisor, log, want, clock)
        return "restarted"
    detail = "\n".join(errors[-3:]) or f"(no new worker within {RELOAD_WAIT:.0f}s and nothing in {log})"
    raise ClusterError(
        f"nginx did not take its new config (the reload failed; it still serves the previous one):\n{detail}\n"
        "fix the cause, then run 'cosyvoice-lb up' again (or 'cosyvoice-lb restart nginx')"
    )


def wait_listening(
    supervisor: Supervisor, log: Path, want: set[Address], clock: Callable[[], float] = time.monotonic
) -> None:
    """Until the (re)started nginx listens on ``want``; raises when it does not."""
    deadline, now = clock() + RESTART_WAIT, set()
    while clock() < deadline:
        info = supervisor.processes().get("nginx")
        now = nginx_listening(info.pid) if info is not None and info.pid else set()
        # (it serves once it listens; supervisord calls it RUNNING after its startsecs)
        if now == want and info is not None and info.state == "RUNNING":
            return
        time.sleep(POLL)
    tail = "\n".join(read_tail(log, 2000).strip().splitlines()[-3:])
    raise ClusterError(
        f"nginx listens on {describe(now)} after a restart, not on {describe(want)} as its config says:\n{tail}\n"
        "see 'cosyvoice-lb logs nginx-error'; free the address, then run 'cosyvoice-lb up' again"
    )
