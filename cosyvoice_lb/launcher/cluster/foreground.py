"""`up --foreground`: the launcher as a container's main process. It stays with a started
cluster, watches that supervisord is still there, reaps what is orphaned to it (PID 1), and
on SIGTERM or SIGINT drains and stops everything (``lifecycle.down``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, Protocol

import psutil

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.timeouts import SUPERVISOR_POLL, SUPERVISOR_SILENT, Timeouts
from cosyvoice_lb.launcher.cluster.lifecycle import down
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.state import processes
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.supervision import SupervisionError, Supervisor

# How often the foreground asks whether supervisord is still there.
FOREGROUND_POLL = 3.0

Liveness = Literal["answers", "stopping", "silent", "gone"]


class StopEvent(Protocol):
    """What the foreground waits on (a :class:`threading.Event`; a fake in tests)."""

    def wait(self, timeout: float | None = None) -> bool: ...

    def is_set(self) -> bool: ...


@dataclass
class Stopped:
    """How :func:`stay` ended: ``code`` 0 stopped on a signal, 1 supervisord went away
    (``reason`` says how); ``pids``: what ``down`` stopped."""

    code: int
    pids: list[int]
    reason: str = ""


def supervisord_liveness(layout: Layout) -> Liveness:
    """``answers`` (RUNNING), ``stopping`` (answers, but shuts down: a ``down`` from outside),
    ``silent`` (its process is there but does not answer: stopped, swapping, stuck) or ``gone``."""
    supervisor = Supervisor(layout, timeout=SUPERVISOR_POLL)
    if layout.socket.exists():
        try:
            supervisor.pid()  # getPID answers in every state, shutting down included
        except SupervisionError:
            pass
        else:
            return "answers" if supervisor.running() else "stopping"
    try:
        proc = psutil.Process(int(layout.supervisord_pid.read_text().strip()))
        there = proc.status() != psutil.STATUS_ZOMBIE and processes.is_cluster_program(proc.cmdline(), layout)
    except (OSError, ValueError, psutil.Error):
        there = False
    return "silent" if there else "gone"


def reap_children() -> None:
    """Collect exited children. In a container the launcher is PID 1: the daemonized
    supervisord, and whatever is orphaned when it dies, become its children, and nobody else
    would ever reap them."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no children at all
            return
        if pid == 0:
            return


def stay(
    layout: Layout,
    settings: Settings,
    stop: StopEvent,
    *,
    liveness: Callable[[], Liveness] | None = None,
    stop_cluster: Callable[[Layout], list[int]] = down,
    reap: Callable[[], None] = reap_children,
    poll: float = FOREGROUND_POLL,
    silent: float = SUPERVISOR_SILENT,
    clock: Callable[[], float] = time.monotonic,
    say: Callable[[str], None] = lambda line: None,
) -> Stopped:
    """Stay with a started cluster until ``stop`` is set (SIGTERM, SIGINT: see
    :class:`StopSignals`), then ``down``: the health loop, the instances (each drains its
    requests, up to --drain-timeout), nginx. Every ``poll`` seconds supervisord is asked
    whether it is still there; gone, silent for ``silent`` seconds, or shutting down (a
    ``down`` from outside) for longer than a down takes, it ends with code 1 after a ``down``
    that sweeps what is left: a container must not look alive with nothing inside."""
    check = liveness or (lambda: supervisord_liveness(layout))
    stopping_bound = Timeouts(settings).down + SUPERVISOR_SILENT
    say("running in the foreground: SIGTERM drains and stops it")
    answered = clock()
    stopping_since: float | None = None
    reason = ""
    while not stop.wait(poll):
        reap()
        state = check()
        if stop.is_set():  # a stop asked meanwhile wins: it is a planned one
            break
        now = clock()
        if state == "answers":
            answered, stopping_since = now, None
        elif state == "stopping":
            answered = now
            stopping_since = now if stopping_since is None else stopping_since
            if now - stopping_since > stopping_bound:
                reason = f"supervisord has been shutting down for {now - stopping_since:.0f}s"
                break
        elif state == "gone":
            reason = (
                "supervisord was shut down from outside (cosyvoice-lb down?)"
                if stopping_since is not None
                else "supervisord went away"
            )
            break
        elif now - answered > silent:
            reason = f"supervisord has not answered for {now - answered:.0f}s"
            break
    pids = stop_cluster(layout)
    reap()
    if reason:
        return Stopped(1, pids, f"{reason}; stopped what was left of the cluster ({len(pids)} process(es))")
    say(f"drained and stopped {len(pids)} process(es)")
    return Stopped(0, pids)


def _write_stderr(line: str) -> None:
    # (os.write, not print: a signal handler must not enter a buffered stream that the code it
    # interrupted may be writing to)
    os.write(2, (line + "\n").encode())


class StopSignals:
    """SIGTERM and SIGINT for `up --foreground`. While the cluster starts, either interrupts
    the start as Ctrl-C does (`up` stops what it started). Once it serves, the first sets
    :attr:`event` (the foreground drains and stops); later ones are only logged, so that
    nothing interrupts the drain."""

    def __init__(self, write: Callable[[str], None] | None = None):
        self.event = threading.Event()
        self.starting = True
        self.stopped_starting = False  # a signal came while starting: the cluster was stopped
        self.write = write or _write_stderr

    def install(self) -> StopSignals:
        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, self)
        return self

    def __call__(self, number: int, frame: object = None) -> None:
        name = signal.Signals(number).name
        if self.event.is_set():
            self.write(f"{name} again: still draining (the drain is not interrupted)")
            return
        self.event.set()
        if self.starting:
            raise KeyboardInterrupt
        self.write(f"{name}: draining and stopping the cluster")

    @contextmanager
    def while_starting(self, layout: Layout) -> Iterator[None]:
        """Around `up`: a signal during the start stops the cluster, as a stop asked for (a
        pod deleted while it loads): :attr:`stopped_starting` is then set and nothing is
        raised. A start that fails without a signal raises as it did."""
        try:
            yield
        except (KeyboardInterrupt, ClusterError):
            self.starting = False
            if not self.event.is_set():
                raise
            down(layout)  # (`up` stops a first start itself; this covers an update)
            self.stopped_starting = True
            return
        self.starting = False
