"""What the health loop asks of the world outside it: supervisord, the instances' probes,
and the operating system (psutil, NVML).

The loop gets each one passed in, so tests script them; :class:`Host` is the real
operating system's adapter, :class:`~cosyvoice_lb.launcher.state.supervision.Supervisor`
and :class:`~cosyvoice_lb.launcher.health.probe.Prober` the real others.
"""

from __future__ import annotations

import signal
from typing import Protocol

import psutil

from cosyvoice_lb.launcher.health.probe import Probe
from cosyvoice_lb.launcher.plan.gpu import process_gpu_memory
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
