"""Surge roll-outs: replacements start on parked slots (spare ports) and serve before the
old instances are drained and stopped, so the number in rotation never drops below what
it was. Used by `restart --rolling` and by `up` with changed settings when the cluster has
``--surge``; where no parked slot has memory, the caller drains first instead.

The health loop is told (``markers.start_rollout``) to let ``surge`` more instances into
rotation while it lasts, and to scale nothing meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cosyvoice_lb.launcher.cluster.context import Cluster, Progress, Supervision
from cosyvoice_lb.launcher.cluster.diagnosis import MISSING
from cosyvoice_lb.launcher.cluster.waits import drain, loop_reported, serving_or_fail
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.health.rotation import OCCUPIED, is_parked
from cosyvoice_lb.launcher.plan.planner import Slot
from cosyvoice_lb.launcher.state import canary as canary_state
from cosyvoice_lb.launcher.state.health_report import read_report
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.markers import (
    DrainAction,
    drained_by_hand,
    end_rollout,
    start_rollout,
)

# Puts a stopped slot's program on the current config (for `up`: remove and add its group).
Refresh = Callable[[str], None]


@dataclass(frozen=True)
class Slots:
    """The instance slots as supervisord and the health loop see them now (a model roll-out's
    canary slots are neither: ``launcher.canary`` alone starts and stops them)."""

    running: tuple[Slot, ...]
    parked: tuple[Slot, ...]  # stopped on purpose, not given up on

    @classmethod
    def read(cls, layout: Layout, supervisor: Supervision, slots: tuple[Slot, ...]) -> Slots:
        procs = supervisor.processes()
        report = read_report(layout)
        canary = canary_state.names(layout)
        slots = tuple(s for s in slots if s.name not in canary)
        state = {s.name: procs[s.name].state if s.name in procs else MISSING for s in slots}
        return cls(
            running=tuple(s for s in slots if state[s.name] in OCCUPIED),
            parked=tuple(s for s in slots if is_parked(state[s.name], bool(report.track(s.name).failed))),
        )


def surge_room(c: Cluster, now: Slots, surge: int, old: list[str]) -> list[Slot]:
    """The parked slots a roll-out may start at once: up to ``surge``, as memory allows now
    (not one drained by hand: it would start out of rotation)."""
    parked = tuple(s for s in now.parked if s.name not in old and not drained_by_hand(c.layout, s.name))
    return c.room(now.running, parked)[:surge]


def surge_rollout(c: Cluster, old: list[str], free: list[Slot], refresh: Refresh = lambda name: None) -> list[str]:
    """Replace the ``old`` instances, ``len(free)`` at a time: start replacements on the
    ``free`` parked slots, wait until they serve, then drain the same number of old ones
    (out of rotation, idle) and stop them; their slots take the next replacements.
    Returns "old -> new" for each. A replacement that cannot start, or whose warm-up makes bad
    audio (NaN, silence: see the instance's ``audio.check``), stops the roll-out with a
    :class:`ClusterError`: the old instances not yet replaced still serve."""
    surge = len(free)
    if not surge:
        raise ClusterError("a surge roll-out needs at least one parked slot with memory")
    asked = c.wall()
    start_rollout(c.layout, surge)
    loop_reported(c, asked)  # the loop lets the extra ones in from now on
    queue, spare = list(old), [s.name for s in free]
    done: list[str] = []
    try:
        while queue:
            batch, spare = spare[: min(surge, len(queue))], spare[min(surge, len(queue)) :]
            c.progress(Progress(len(done), len(old), f"starting {', '.join(batch)} (surge) to replace {queue[0]}"))
            for name in batch:
                refresh(name)
                c.supervisor.start(name)
            try:
                serving_or_fail(c, batch, {}, bad_audio_fails=True)  # (bad audio: stop now, not after retries)
            except ClusterError as exc:
                # (stopped through the loop, which counts the stop: its next start is no crash)
                drain(c, batch, DrainAction.STOP)
                raise ClusterError(
                    f"surge roll-out stopped, {len(done)} of {len(old)} replaced ({', '.join(done) or 'none'}); "
                    f"the instances not replaced still serve:\n{exc}"
                ) from None
            outgoing, queue = queue[: len(batch)], queue[len(batch) :]
            c.progress(Progress(len(done), len(old), f"{', '.join(batch)} serving: draining {', '.join(outgoing)}"))
            drain(c, outgoing, DrainAction.HOLD)
            for name in outgoing:
                c.supervisor.stop(name)
                refresh(name)
            spare += outgoing
            done += [f"{o} -> {n}" for o, n in zip(outgoing, batch)]
    finally:
        ended = c.wall()
        end_rollout(c.layout)
        loop_reported(c, ended)  # the rotation is back to the wanted number when this returns
    c.progress(Progress(len(old), len(old), "surge roll-out done"))
    return done
