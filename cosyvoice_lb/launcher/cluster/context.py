"""A running cluster as the lifecycle changes it: where it lives, its settings, and the
collaborators that act on it — supervisord, the status reader, nginx, the clock — passed in
as the health loop's are, so the ordering rules of up, restart and roll-outs are unit-tested
against a scripted cluster, and run against the real one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.timeouts import Timeouts
from cosyvoice_lb.launcher.cluster import nginx_apply
from cosyvoice_lb.launcher.cluster.diagnosis import ClusterStatus
from cosyvoice_lb.launcher.cluster.listeners import wanted
from cosyvoice_lb.launcher.cluster.status import NO_TELEMETRY, status
from cosyvoice_lb.launcher.plan.footprint import room_to_start
from cosyvoice_lb.launcher.plan.planner import Slot
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.supervision import ProcessInfo, Supervisor


@dataclass
class Progress:
    """What `up` and `restart` report while they wait."""

    ready: int
    total: int
    detail: str


Report = Callable[[Progress], None]
Say = Callable[[str], None]
# Of the parked slots, those there is memory for now beside the running ones.
Room = Callable[[tuple[Slot, ...], tuple[Slot, ...]], list[Slot]]


class Supervision(Protocol):
    """What the lifecycle asks of supervisord (:class:`Supervisor`; a scripted one in tests)."""

    layout: Layout

    def running(self) -> bool: ...

    def start_daemon(self) -> None: ...

    def processes(self) -> dict[str, ProcessInfo]: ...

    def start(self, name: str, wait: bool = False) -> None: ...

    def stop(self, name: str, wait: bool = True) -> None: ...

    def tail(self, name: str, length: int = 4000) -> str: ...

    def reload(self) -> tuple[list[str], list[str], list[str]]: ...

    def add_group(self, name: str) -> None: ...

    def remove_group(self, name: str) -> None: ...


class Nginx(Protocol):
    """What the lifecycle asks of nginx (:class:`NginxThroughSupervisor`; scripted in tests)."""

    def apply(self, settings: Settings, say: Say) -> None:
        """Take the config on disk, listening where ``settings`` say (checked)."""

    def replace_program(self, settings: Settings) -> None:
        """Its program changed: supervisord runs the new one, listening where it should."""

    def restarted(self, settings: Settings) -> None:
        """After a restart by hand: wait until it listens where ``settings`` say."""

    def lagging(self, settings: Settings) -> bool:
        """It is not where its config says, or runs an older config than the one on disk."""


@dataclass
class NginxThroughSupervisor:
    """nginx as supervisord runs it, each change checked (``nginx_apply``), waiting by
    ``clock`` and ``sleep``."""

    supervisor: Supervisor
    layout: Layout
    clock: Callable[[], float]
    sleep: Callable[[float], None]

    def apply(self, settings: Settings, say: Say) -> None:
        nginx_apply.apply(
            self.supervisor,
            self.layout.log("nginx-error"),
            settings.listen_host,
            settings.port,
            say,
            clock=self.clock,
            sleep=self.sleep,
        )

    def replace_program(self, settings: Settings) -> None:
        self.supervisor.remove_group("nginx")
        self.supervisor.add_group("nginx")
        self.restarted(settings)

    def restarted(self, settings: Settings) -> None:
        want = wanted(settings.listen_host, settings.port)
        nginx_apply.wait_listening(
            self.supervisor, self.layout.log("nginx-error"), want, clock=self.clock, sleep=self.sleep
        )

    def lagging(self, settings: Settings) -> bool:
        return nginx_apply.lagging(self.supervisor, self.layout, wanted(settings.listen_host, settings.port))


@dataclass
class Cluster:
    """One cluster and what acts on it. ``read_status`` gives its status now (states only:
    no NVML); ``clock`` is monotonic, ``wall`` epoch seconds (what the health loop writes)."""

    layout: Layout
    settings: Settings
    supervisor: Supervision
    nginx: Nginx
    read_status: Callable[[], ClusterStatus]
    room: Room
    progress: Report = lambda p: None
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    timeouts: Timeouts = field(init=False)

    def __post_init__(self) -> None:
        self.timeouts = Timeouts(self.settings)

    @classmethod
    def of(cls, layout: Layout, settings: Settings, progress: Report = lambda p: None) -> Cluster:
        """The real one: its supervisord, nginx through it, ``status`` without telemetry."""
        supervisor = Supervisor(layout, wait_timeout=Timeouts(settings).supervisor_wait)
        clock, sleep = time.monotonic, time.sleep
        return cls(
            layout=layout,
            settings=settings,
            supervisor=supervisor,
            nginx=NginxThroughSupervisor(supervisor, layout, clock, sleep),
            read_status=lambda: status(layout, telemetry=NO_TELEMETRY),
            room=lambda running, parked: room_to_start(settings, running, parked),
            progress=progress,
            clock=clock,
            wall=time.time,
            sleep=sleep,
        )

    def with_settings(self, settings: Settings) -> Cluster:
        """The same cluster and collaborators, under other settings (an update's two steps)."""
        return replace(self, settings=settings)

    def wait_until(self, done: Callable[[], bool], seconds: float, poll: float = 0.1) -> bool:
        """Poll ``done`` until it holds or ``seconds`` pass; whether it held."""
        deadline = self.clock() + seconds
        while not done():
            if self.clock() >= deadline:
                return False
            self.sleep(poll)
        return True
