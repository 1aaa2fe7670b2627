"""Waiting on the cluster while it changes: until instances serve (or failed), until the others
serve before one is stopped, until the health loop took a drain request or reported.

Used by ``lifecycle`` (up, restart) and ``rollout`` (surge roll-outs); reads the cluster
through ``status`` and talks to the health loop through ``protocol``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.timeouts import SUPERVISOR_SILENT, Timeouts
from cosyvoice_lb.launcher.cluster.layout import Layout
from cosyvoice_lb.launcher.cluster.protocol import (
    DrainAction,
    answer_drain,
    ask_drain,
    drain_pending,
    read_report,
    report_tracks,
)
from cosyvoice_lb.launcher.cluster.status import (
    ESSENTIAL,
    NO_TELEMETRY,
    ClusterStatus,
    failure_report,
    last_lines,
    status,
)
from cosyvoice_lb.launcher.cluster.supervision import Supervisor
from cosyvoice_lb.launcher.errors import ClusterError

Report = Callable[["Progress"], None]


@dataclass
class Progress:
    """What `up` and `restart` report while they wait."""

    ready: int
    total: int
    detail: str


def loop_reported(layout: Layout, settings: Settings, since: float) -> None:
    """Wait (bounded) until the health loop has written a report after ``since``: it has
    then published the rotation for the slots it read at its start."""
    deadline = time.monotonic() + Timeouts(settings).loop_answer
    while time.monotonic() < deadline and float(read_report(layout).get("updated", 0)) <= since:
        time.sleep(0.1)


def others_serving(layout: Layout, settings: Settings, name: str, on_progress: Report) -> None:
    """Before a drained stop of ``name``: wait until every other instance (but those given
    up on, or drained by hand) serves, so the stop costs one instance of capacity and never
    the last one."""
    deadline = time.monotonic() + Timeouts(settings).others_serving
    while True:
        instances = [
            i
            for i in status(layout, telemetry=NO_TELEMETRY).instances
            if i.name != name and not i.failed and not i.parked
        ]
        # (drained by hand: out of rotation on purpose, nothing to wait for; but not the only ones left)
        others = [i for i in instances if not i.drained]
        drained = [i.name for i in instances if i.drained]
        if drained and not others:
            raise ClusterError(
                f"{', '.join(drained)} {'is' if len(drained) == 1 else 'are'} drained by hand: stopping {name} too "
                f"would leave no instance serving; 'cosyvoice-lb undrain {drained[0]}' first "
                f"(restart {name} restarts it regardless)"
            )
        short = [i.name for i in others if not (i.serving or i.spare)]
        if not short:
            return
        if time.monotonic() > deadline:
            raise ClusterError(
                f"{', '.join(short)} did not serve within --startup-timeout: not stopping {name} "
                "as well; see 'cosyvoice-lb status' (restart NAME restarts one regardless)"
            )
        on_progress(Progress(len(others) - len(short), len(others), f"before {name}: waiting for {', '.join(short)}"))
        time.sleep(0.5)


def drain(
    layout: Layout,
    settings: Settings,
    supervisor: Supervisor,
    names: list[str],
    action: DrainAction,
    on_progress: Report,
) -> dict[str, int]:
    """Ask the health loop for a drained stop of ``names``: out of rotation, then (once their
    requests are done) TERM, or for HOLD nothing: the caller replaces them. Returns the pids
    of those that were running. Without a working health loop they are stopped directly
    (each still drains its own requests on TERM; nginx retries the ones it refuses)."""
    procs = supervisor.processes()
    running = {n: procs[n].pid for n in names if n in procs and procs[n].state in ("RUNNING", "STARTING")}
    timeouts = Timeouts(settings)
    for name in names:
        ask_drain(layout, name, action)
    health_up = "health" in procs and procs["health"].state in ("RUNNING", "STARTING")
    deadline = time.monotonic() + (timeouts.loop_answer if health_up else 0.0)
    while any(drain_pending(layout, n) for n in names) and time.monotonic() < deadline:
        time.sleep(0.1)
    ignored = [n for n in names if drain_pending(layout, n)]
    tracks = report_tracks(layout)
    for name in ignored:
        if not tracks.get(name, {}).get("failed"):  # (kept for one given up on: the health loop clears it)
            answer_drain(layout, name)
        on_progress(Progress(0, len(names), f"the health loop did not take the request: stopping {name} directly"))
        if name in running:
            supervisor.stop(name)
            if action is DrainAction.TERM:
                supervisor.start(name)
    held = [n for n in running if n not in ignored]
    if action is DrainAction.HOLD and held:
        deadline = time.monotonic() + timeouts.hold_done
        while time.monotonic() < deadline and not all(
            report_tracks(layout).get(n, {}).get("signalled_at") for n in held
        ):
            time.sleep(0.1)
    return running


def serving_or_fail(
    layout: Layout, settings: Settings, names: list[str], on_progress: Report, replacing: dict[str, int]
) -> ClusterStatus:
    """Wait for ``names`` (new processes) to serve; any of them failing is an error."""
    current = wait_serving(layout, settings, names, on_progress, replacing=replacing)
    report = failure_report(layout, current, names)
    if report:
        raise ClusterError("\n".join(report))
    return current


def wait_serving(
    layout: Layout,
    settings: Settings,
    names: list[str],
    on_progress: Report,
    poll: float = 0.25,
    replacing: dict[str, int] | None = None,
) -> ClusterStatus:
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
    deadline = time.monotonic() + Timeouts(settings).serving
    failed: dict[str, str] = {}
    served: set[str] = set()
    answered = time.monotonic()
    while True:
        current = status(layout, telemetry=NO_TELEMETRY)  # (polled: no NVML each time)
        if current.unanswered or not current.running:
            # supervisord stopped answering (stopped, swapping, stuck) or went away: no
            # instance can be started or checked; bounded, then a clear error.
            if time.monotonic() - answered > SUPERVISOR_SILENT or not current.unanswered:
                raise ClusterError(
                    f"supervisord stopped answering while instances started: "
                    f"{'; '.join(current.problems)}; see {layout.log('supervisord')}"
                )
            on_progress(Progress(0, len(names), "supervisord does not answer; asking again"))
            time.sleep(poll)
            continue
        answered = time.monotonic()
        for item in current.instances:
            if item.name not in names:
                continue
            if item.available and item.pid != replacing.get(item.name):
                served.add(item.name)
            recorded = item.failed if item.failed_at >= since or item.state == "FATAL" else ""
            if item.name not in failed and item.name not in served and recorded:
                failed[item.name] = recorded
            item.failed = failed.get(item.name, "")
        for service in ESSENTIAL:  # (the control panel is not: a cluster serves without it)
            state = getattr(current, service).get("state")
            if state in ("FATAL", "BACKOFF", "EXITED", "MISSING"):
                raise ClusterError(
                    f"{service} does not stay up ({state}); last log lines:\n{last_lines(supervisor, service)}"
                )
        waiting = [i for i in current.instances if i.name in names and i.name not in served and i.name not in failed]
        if not waiting and failed and len(failed) == len(names):
            first = "no instance could start:" if len(names) > 1 else f"{names[0]} could not start:"
            raise ClusterError("\n".join([first] + failure_report(layout, current, names)))
        if not waiting and current.nginx.get("answers") == 200:
            on_progress(
                Progress(
                    len(names) - len(failed),
                    len(names),
                    "all ready" if not failed else f"{len(failed)} failed: {', '.join(failed)}",
                )
            )
            return current
        detail = ", ".join(i.name + (f" ({i.reason})" if i.reason else "") for i in waiting) or "nginx"
        on_progress(Progress(len(names) - len(waiting) - len(failed), len(names), "waiting for " + detail))
        if time.monotonic() > deadline:
            if len(waiting) + len(failed) < len(names):  # some serve: the slow ones are reported, not fatal
                for item in waiting:
                    item.failed = failed[item.name] = (
                        f"failed: not ready within --startup-timeout {settings.startup_timeout:.0f}s"
                    )
                on_progress(Progress(len(names) - len(failed), len(names), f"{len(failed)} failed"))
                return current
            tails = "\n".join(
                f"--- {i.name} ({layout.log(i.name)}):\n{last_lines(supervisor, i.name, 8)}" for i in waiting
            )
            raise ClusterError(
                f"not ready within --startup-timeout {settings.startup_timeout:.0f}s: "
                f"{'; '.join(current.problems) or 'nginx does not answer /ping with 200'}\n{tails}"
            )
        time.sleep(poll)
