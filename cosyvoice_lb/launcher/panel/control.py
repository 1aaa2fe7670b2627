"""What the control panel reads and does: the cluster's view (supervisord, the health loop,
NVML, nginx's counters) and the operator's actions on an instance (a drained restart,
drain by hand, return).

The HTTP edge is ``admin.py``; this module holds no routes. Actions run in threads of
their own: a drained restart waits for the instance to serve again, which takes as long
as a model load.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from cosyvoice_lb.launcher.cluster import lifecycle
from cosyvoice_lb.launcher.cluster.disk import recorded
from cosyvoice_lb.launcher.cluster.status import NO_TELEMETRY, ClusterStatus, status
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.health.probe import loopback_session
from cosyvoice_lb.launcher.panel.metrics import ClusterView, NginxCounters, parse_stub_status
from cosyvoice_lb.launcher.render.addresses import balancer_url
from cosyvoice_lb.launcher.state.health_report import read_report
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.supervision import SupervisionError

ACTIONS = ("restart", "drain", "undrain")


def nginx_counters(url: str, timeout: float = 2.0) -> NginxCounters | None:
    """nginx's stub_status (None: nginx does not answer)."""
    try:
        answer = loopback_session(1).get(url + "/nginx_status", timeout=timeout)
    except Exception:  # (any failure to reach it means the same: no counters now)
        return None
    return parse_stub_status(answer.text) if answer.status_code == 200 else None


def rss(pids: dict[str, int]) -> dict[str, int]:
    found = {}
    for name, pid in pids.items():
        try:
            found[name] = psutil.Process(pid).memory_info().rss
        except psutil.Error:
            found[name] = 0
    return found


def gather(layout: Layout, read_status: Callable[[Layout], ClusterStatus] = status) -> ClusterView:
    """The cluster as it is now, for a scrape or the panel."""
    current = read_status(layout)
    record = recorded(layout)
    names = [i.name for i in current.instances]
    return ClusterView(
        status=current,
        planned=len(record[1]) if record else len(names),
        report=read_report(layout),
        memory=rss({i.name: i.pid for i in current.instances if i.pid}),
        nginx=nginx_counters(balancer_url(record[0])) if record else None,
        now=time.time(),
    )


@dataclass
class Action:
    """One operator action on an instance, as the panel shows it."""

    name: str
    action: str
    state: str = "running"  # running, done, failed
    detail: str = ""
    started: float = field(default_factory=time.time)
    ended: float = 0.0


class Actions:
    """The operator's actions. ``restart`` is the ``restart`` command's drained restart;
    ``drain`` keeps the instance out of rotation (its requests finish, its process stays)
    until ``undrain``. One restart at a time, and neither a restart nor a drain of the last
    instance serving: a click never takes the whole service down (the CLI still can, by name)."""

    def __init__(
        self,
        layout: Layout,
        restart: Callable[..., Any] = lifecycle.restart,
        read_status: Callable[[Layout], ClusterStatus] = lambda layout: status(layout, telemetry=NO_TELEMETRY),
    ):
        self.layout, self._restart, self.read_status = layout, restart, read_status
        self.lock = threading.Lock()
        self.latest: dict[str, Action] = {}

    def instances(self) -> list[str]:
        record = recorded(self.layout)
        return [s.name for s in record[1]] if record else []

    def start(self, name: str, action: str) -> Action:
        """Start ``action`` on ``name``; ValueError for an unknown one, RuntimeError while
        another action on it runs."""
        if action not in ACTIONS:
            raise ValueError(f"no action {action!r}: use one of {', '.join(ACTIONS)}")
        if name not in self.instances():
            known = ", ".join(self.instances()) or "none"
            raise ValueError(f"no instance named {name!r} (instances: {known})")
        with self.lock:
            running = self.latest.get(name)
            if running is not None and running.state == "running":
                raise RuntimeError(f"{name} is busy: {running.action} is still running ({running.detail})")
            restarting = [a.name for a in self.latest.values() if a.action == "restart" and a.state == "running"]
            if action == "restart" and restarting:
                raise RuntimeError(f"{restarting[0]} is restarting: one restart at a time from the panel")
            if action in ("restart", "drain"):
                self._keeps_one_serving(name, action)
            current = self.latest[name] = Action(name, action)
        if action == "restart":
            threading.Thread(target=self._run_restart, args=(current,), name=f"restart-{name}", daemon=True).start()
            return current
        try:
            changed = lifecycle.set_drained(self.layout, [name], action == "drain")
        except (ClusterError, OSError) as exc:  # (said on the row; the next action is not refused as busy)
            self._end(current, "failed", str(exc))
            return current
        if action == "drain":
            self._end(current, "done", "out of rotation; its requests finish" if changed else "was drained already")
        else:
            self._end(current, "done", "back in rotation after its next good probes" if changed else "was not drained")
        return current

    def _keeps_one_serving(self, name: str, action: str) -> None:
        """RuntimeError when ``name`` is the last instance serving (and it serves)."""
        current = self.read_status(self.layout)
        this = current.instance(name)
        if this is None or not this.serving:
            return  # taking out one that serves nothing costs nothing
        if not any(i.serving for i in current.instances if i.name != name):
            raise RuntimeError(
                f"{name} is the only instance serving: a {action} now would leave none (every request would get "
                f"503); wait for the others, or run 'cosyvoice-lb {action} {name}' if that is what you want"
            )

    def _run_restart(self, current: Action) -> None:
        def progress(step: lifecycle.Progress) -> None:
            current.detail = step.detail

        try:
            self._restart(self.layout, [current.name], progress)
        except (ClusterError, SupervisionError) as exc:
            self._end(current, "failed", str(exc))
        except Exception as exc:  # (an action never takes the panel down; it says what happened)
            self._end(current, "failed", f"{type(exc).__name__}: {exc}")
        else:
            self._end(current, "done", "restarted, serving again")

    def _end(self, current: Action, state: str, detail: str) -> None:
        current.state, current.detail, current.ended = state, detail, time.time()

    def as_dict(self) -> dict[str, dict]:
        with self.lock:
            return {name: asdict(action) for name, action in self.latest.items()}
