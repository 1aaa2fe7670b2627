"""What the health loop asks of the world outside it: supervisord, the instances' probes,
the operating system (psutil, NVML), the state dir's files and the routing board.

The loop gets each one passed in, so tests script them; :class:`Host` is the real
operating system's adapter, :class:`StateDir` the real state files, :func:`create_board`
the real board, :class:`~cosyvoice_lb.launcher.state.supervision.Supervisor` and
:class:`~cosyvoice_lb.launcher.health.probe.Prober` the real others.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.instance.routing.board import Board
from cosyvoice_lb.launcher.health.probe import Probe
from cosyvoice_lb.launcher.plan.gpu import process_gpu_memory
from cosyvoice_lb.launcher.state import canary as canary_state
from cosyvoice_lb.launcher.state import health_report, markers
from cosyvoice_lb.launcher.state.canary import Canary
from cosyvoice_lb.launcher.state.health_report import HealthReport
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.markers import DrainAction
from cosyvoice_lb.launcher.state.processes import orphan_nginx
from cosyvoice_lb.launcher.state.supervision import ProcessInfo


class Supervision(Protocol):
    """What the loop asks of supervisord (``supervision.Supervisor``)."""

    def processes(self) -> dict[str, ProcessInfo]: ...
    def start(self, name: str, wait: bool = False) -> None: ...
    def stop(self, name: str, wait: bool = True) -> None: ...
    def signal(self, name: str, signal: str) -> None: ...
    def tail(self, name: str, length: int = 4000) -> str: ...


class Probing(Protocol):
    def probe(self, port: int, timeout: float) -> Probe: ...


class Host:
    """What the loop asks of the operating system (psutil, NVML): an adapter of its own."""

    def children(self, pid: int) -> list[psutil.Process]:
        try:
            return psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            return []

    def kill(self, procs: list[psutil.Process], sig: int = signal.SIGKILL) -> None:
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass

    def memory(self, pids: dict[str, int]) -> dict[str, int]:
        """Per instance, the larger of its RSS and its GPU memory (per process), bytes."""
        gpu = process_gpu_memory(set(pids.values()))
        found = {}
        for name, pid in pids.items():
            try:
                rss = psutil.Process(pid).memory_info().rss
            except psutil.Error:
                rss = 0
            found[name] = max(rss, gpu.get(pid, 0))
        return found

    def orphan_nginx(self, port: int, master_pid: int) -> list[psutil.Process]:
        return orphan_nginx(port, master_pid)


class RoutingBoard(Protocol):
    """What the loop asks of the routing board (:class:`~cosyvoice_lb.instance.routing.board.Board`)."""

    def configure(self, work: bool, slack: float) -> None: ...
    def set_rotation(self, slots: Iterable[int]) -> None: ...
    def rotation(self) -> set[int]: ...


def create_board(path: Path) -> RoutingBoard:
    """The real board at ``path``, made afresh (raises OSError when it cannot be)."""
    return Board.create(path)


class StateFiles(Protocol):
    """What the loop reads and writes in the state dir (:class:`StateDir`): its report,
    the markers the launcher and the instances leave it, and nginx's rotation."""

    def read_report(self) -> HealthReport: ...
    def write_report(self, report: HealthReport) -> None: ...
    def read_canary(self) -> Canary | None: ...
    def starts_count(self, name: str) -> int: ...
    def drain_pending(self, name: str) -> bool: ...
    def read_drain(self, name: str) -> DrainAction | None: ...
    def answer_drain(self, name: str) -> None: ...
    def drained_by_hand(self, name: str) -> bool: ...
    def rollout_surge(self) -> int: ...
    def write_upstreams(self, text: str) -> None: ...


@dataclass(frozen=True)
class StateDir:
    """The real state files, in ``layout`` (``health_report``, ``markers``, ``canary``)."""

    layout: Layout

    def read_report(self) -> HealthReport:
        return health_report.read_report(self.layout)

    def write_report(self, report: HealthReport) -> None:
        health_report.write_report(self.layout, report)

    def read_canary(self) -> Canary | None:
        return canary_state.read(self.layout)

    def starts_count(self, name: str) -> int:
        return markers.starts_count(self.layout, name)

    def drain_pending(self, name: str) -> bool:
        return markers.drain_pending(self.layout, name)

    def read_drain(self, name: str) -> DrainAction | None:
        return markers.read_drain(self.layout, name)

    def answer_drain(self, name: str) -> None:
        markers.answer_drain(self.layout, name)

    def drained_by_hand(self, name: str) -> bool:
        return markers.drained_by_hand(self.layout, name)

    def rollout_surge(self) -> int:
        return markers.rollout_surge(self.layout)

    def write_upstreams(self, text: str) -> None:
        write_atomic(self.layout.upstreams_conf, text)
