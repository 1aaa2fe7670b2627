"""Waiting on the cluster while it changes: until instances serve (or failed), until the others
serve before one is stopped, until the health loop took a drain request or reported.

Used by ``lifecycle`` (up, restart) and ``rollout`` (surge roll-outs). Everything goes through
the :class:`~cosyvoice_lb.launcher.cluster.context.Cluster` passed in: its status reader, its
supervisord, its clock; the health loop is reached through the state dir (``markers``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cosyvoice_lb.common.timeouts import SUPERVISOR_SILENT
from cosyvoice_lb.launcher.cluster.context import Cluster, Progress
from cosyvoice_lb.launcher.cluster.diagnosis import ESSENTIAL, MISSING, SERVICES, ClusterStatus, InstanceStatus
from cosyvoice_lb.launcher.cluster.status import failure_report, last_lines
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.state.health_report import read_report
from cosyvoice_lb.launcher.state.markers import (
    DrainAction,
    answer_drain,
    ask_drain,
    drain_pending,
)
from cosyvoice_lb.launcher.state.supervision import ALIVE, ProgramState


def loop_reported(c: Cluster, since: float) -> None:
    """Wait (bounded) until the health loop has written a report after ``since``: it has
    then published the rotation for the slots it read at its start."""
    c.wait_until(lambda: read_report(c.layout).updated > since, c.timeouts.loop_answer)


def others_serving(c: Cluster, name: str) -> None:
    """Before a drained stop of ``name``: wait until every other instance (but those given
    up on, drained by hand, or a model roll-out's canary) serves, so the stop costs one instance of capacity and never
    the last one."""
    deadline = c.clock() + c.timeouts.others_serving
    while True:
        instances = [i for i in c.read_status().instances if i.name != name and not (i.failed or i.parked or i.canary)]
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
        if c.clock() > deadline:
            raise ClusterError(
                f"{', '.join(short)} did not serve within --startup-timeout: not stopping {name} "
                "as well; see 'cosyvoice-lb status' (restart NAME restarts one regardless)"
            )
        c.progress(Progress(len(others) - len(short), len(others), f"before {name}: waiting for {', '.join(short)}"))
        c.sleep(0.5)


def drain(c: Cluster, names: list[str], action: DrainAction) -> dict[str, int]:
    """Ask the health loop for a drained stop of ``names``: out of rotation, then (once their
    requests are done) TERM, or for HOLD nothing: the caller replaces them. Returns the pids
    of those that were running. Without a working health loop they are stopped directly
    (each still drains its own requests on TERM; nginx retries the ones it refuses)."""
    procs = c.supervisor.processes()
    running = {n: procs[n].pid for n in names if n in procs and procs[n].state in ALIVE}
    for name in names:
        ask_drain(c.layout, name, action)
    health_up = "health" in procs and procs["health"].state in ALIVE
    c.wait_until(
        lambda: not any(drain_pending(c.layout, n) for n in names), c.timeouts.loop_answer if health_up else 0.0
    )
    ignored = [n for n in names if drain_pending(c.layout, n)]
    report = read_report(c.layout)
    for name in ignored:
        if not report.track(name).failed:  # (kept for one given up on: the health loop clears it)
            answer_drain(c.layout, name)
        c.progress(Progress(0, len(names), f"the health loop did not take the request: stopping {name} directly"))
        if name in running:
            c.supervisor.stop(name)
            if action is DrainAction.TERM:
                c.supervisor.start(name)
    held = [n for n in running if n not in ignored]
    if action is DrainAction.HOLD and held:
        c.wait_until(lambda: all(read_report(c.layout).track(n).signalled_at for n in held), c.timeouts.hold_done)
    return running


def serving_or_fail(
    c: Cluster, names: list[str], replacing: dict[str, int], bad_audio_fails: bool = False
) -> ClusterStatus:
    """Wait for ``names`` (new processes) to serve; any of them failing is an error (with
    ``bad_audio_fails``, making bad audio once is failing: see :class:`Start`)."""
    current = wait_serving(c, names, replacing=replacing, bad_audio_fails=bad_audio_fails)
    report = failure_report(c.layout, current, names, c.supervisor)
    if report:
        raise ClusterError("\n".join(report))
    return current


@dataclass
class Start:
    """One wait for instances to serve: who, since when, and what was seen so far.
    ``bad_audio_fails``: one that makes bad audio (its warm-up's, seen in its /ping or the
    health loop's record) has failed at once, not only once the loop gives up on it after
    --start-retries (a surge roll-out stops there, and keeps the old instances serving)."""

    names: list[str]
    replacing: dict[str, int]
    since: float  # epoch seconds: a failure the health loop recorded before this is not this start's
    served: set[str] = field(default_factory=set)  # seen serving once: done, even if recycled meanwhile
    failed: dict[str, str] = field(default_factory=dict)
    bad_audio_fails: bool = False

    def note(self, current: ClusterStatus) -> list[InstanceStatus]:
        """Take in a status; the named instances still waited for."""
        for item in current.instances:
            if item.name not in self.names:
                continue
            if item.available and item.pid != self.replacing.get(item.name):
                self.served.add(item.name)
            recorded = item.failed if item.failed_at >= self.since or item.state == ProgramState.FATAL else ""
            if not recorded and self.bad_audio_fails and item.audio_fault and item.audio_fault_at >= self.since:
                recorded = f"failed: it made bad audio ({item.audio_fault})"
            if item.name not in self.failed and item.name not in self.served and recorded:
                self.failed[item.name] = recorded
            item.failed = self.failed.get(item.name, "")
        return [
            i
            for i in current.instances
            if i.name in self.names and i.name not in self.served and i.name not in self.failed
        ]


def wait_serving(
    c: Cluster,
    names: list[str],
    poll: float = 0.25,
    replacing: dict[str, int] | None = None,
    bad_audio_fails: bool = False,
    since: float | None = None,
) -> ClusterStatus:
    """Wait until each named instance serves (ready and in rotation; for ``replacing``,
    a process other than the pid given) or has failed, and nginx answers.

    An instance has failed when the health loop gave up on it (a crash loop: it tells
    restarts it ordered from crashes) or supervisord did (FATAL). One seen serving once is
    done, even if it is recycled while the others are waited for. The others are still
    waited for; :class:`ClusterError` only when none of them serves.
    """
    start = Start(names, replacing or {}, since=c.wall() if since is None else since, bad_audio_fails=bad_audio_fails)
    deadline = c.clock() + c.timeouts.serving
    answered = c.clock()
    while True:
        current = c.read_status()
        if current.unanswered or not current.running:
            # supervisord stopped answering (stopped, swapping, stuck) or went away: no
            # instance can be started or checked; bounded, then a clear error.
            if c.clock() - answered > SUPERVISOR_SILENT or not current.unanswered:
                raise ClusterError(
                    f"supervisord stopped answering while instances started: "
                    f"{'; '.join(current.problems)}; see {c.layout.log('supervisord')}"
                )
            c.progress(Progress(0, len(names), "supervisord does not answer; asking again"))
            c.sleep(poll)
            continue
        answered = c.clock()
        waiting = start.note(current)
        essential_up(c, current)
        if not waiting and start.failed and len(start.failed) == len(names):
            first = "no instance could start:" if len(names) > 1 else f"{names[0]} could not start:"
            raise ClusterError("\n".join([first] + failure_report(c.layout, current, names, c.supervisor)))
        # (a service supervisord still calls STARTING, nginx above all, is not up yet: its
        # startsecs have not passed; `status` would say so, so `up` waits them out too)
        settling = [s for s in SERVICES if getattr(current, s).get("state") == ProgramState.STARTING]
        if not waiting and current.nginx.get("answers") == 200 and not settling:
            failed = start.failed
            done = "all ready" if not failed else f"{len(failed)} failed: {', '.join(failed)}"
            c.progress(Progress(len(names) - len(failed), len(names), done))
            return current
        detail = ", ".join(i.name + (f" ({i.reason})" if i.reason else "") for i in waiting)
        detail = detail or (", ".join(f"{s} (starting)" for s in settling) if settling else "nginx")
        c.progress(Progress(len(names) - len(waiting) - len(start.failed), len(names), "waiting for " + detail))
        if c.clock() > deadline:
            return timed_out(c, start, current, waiting)
        c.sleep(poll)


def essential_up(c: Cluster, current: ClusterStatus) -> None:
    """nginx and the health loop stay up while instances start (the control panel need not:
    a cluster serves without it); raises with their last log lines when one does not."""
    for service in ESSENTIAL:
        state = getattr(current, service).get("state")
        if state in (ProgramState.FATAL, ProgramState.BACKOFF, ProgramState.EXITED, MISSING):
            raise ClusterError(
                f"{service} does not stay up ({state}); last log lines:\n{last_lines(c.supervisor, service)}"
            )


def timed_out(c: Cluster, start: Start, current: ClusterStatus, waiting: list[InstanceStatus]) -> ClusterStatus:
    """--startup-timeout passed: with some serving, the slow ones are reported as failed (not
    fatal); with none, an error with each one's last log lines."""
    names, failed = start.names, start.failed
    if len(waiting) + len(failed) < len(names):
        for item in waiting:
            item.failed = failed[item.name] = (
                f"failed: not ready within --startup-timeout {c.settings.startup_timeout:.0f}s"
            )
        c.progress(Progress(len(names) - len(failed), len(names), f"{len(failed)} failed"))
        return current
    tails = "\n".join(f"--- {i.name} ({c.layout.log(i.name)}):\n{last_lines(c.supervisor, i.name, 8)}" for i in waiting)
    raise ClusterError(
        f"not ready within --startup-timeout {c.settings.startup_timeout:.0f}s: "
        f"{'; '.join(current.problems) or 'nginx does not answer /ping with 200'}\n{tails}"
    )
