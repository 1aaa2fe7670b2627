"""Elastic instances, one job of the health loop: follow the scaler's target
(:func:`~cosyvoice_lb.launcher.health.scaling.decide`) by starting parked slots, or by
draining and stopping one instance.

The loop passes in what its step saw (supervisord's processes, the probes, the tracks, the
rotation it last published), a way to start a slot and one to ask whether a slot is
drained by hand (``markers``, through the loop's state files); it applies what comes back: the
next scale, and the drain of an instance scaled in. Never during a roll-out, nor while an
instance loads or stops: the load it would judge by is not the pool's own then.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cosyvoice_lb.launcher.health.probe import Probe
from cosyvoice_lb.launcher.health.rotation import OCCUPIED, is_parked
from cosyvoice_lb.launcher.health.rules import Track, start_drain
from cosyvoice_lb.launcher.health.scaling import Bounds, Load, Scale, decide
from cosyvoice_lb.launcher.plan.planner import Slot
from cosyvoice_lb.launcher.state.markers import DrainAction
from cosyvoice_lb.launcher.state.supervision import ProcessInfo

log = logging.getLogger("cosyvoice_lb.health")

# Of the parked slots, those with memory to start now beside the running ones.
Room = Callable[[tuple[Slot, ...], tuple[Slot, ...]], list[Slot]]


@dataclass(frozen=True)
class Seen:
    """What one step of the health loop saw, as far as following the load needs it."""

    slots: tuple[Slot, ...]
    processes: Mapping[str, ProcessInfo]
    probes: Mapping[str, Probe]
    tracks: Mapping[str, Track]
    serving_before: frozenset[str]  # the rotation as last published
    surge: int  # a roll-out's extra instances in rotation (0: no roll-out under way)
    spares: int  # the plan's warm spares, running beside the target


@dataclass(frozen=True)
class Followed:
    """What following the load decided, for the loop to keep: the next scale, whether a
    scale-out is short of memory (warned about once until one starts), and the tracks of
    instances now draining to be stopped."""

    scale: Scale
    short_of_room: bool
    drains: dict[str, Track] = field(default_factory=dict)


def running_slots(seen: Seen) -> list[Slot]:
    """The slots that count toward the target: a process occupies them, not one given up
    on, nor one already draining to be scaled in."""
    alive = {name for name, p in seen.processes.items() if p.state in OCCUPIED}
    return [
        s
        for s in seen.slots
        if s.name in alive
        and not seen.tracks[s.name].failed
        and seen.tracks[s.name].drain_signal is not DrainAction.STOP
    ]


def hold_reason(seen: Seen, running: list[Slot]) -> str:
    """Why the target may not move now ("" when it may): a roll-out under way, an instance
    still loading, or one stopping."""
    if seen.surge:
        return "a roll-out is under way"
    loading = [s.name for s in running if not seen.tracks[s.name].ever_ready]
    if loading:
        return f"{', '.join(loading)} loading"
    stopping = [s.name for s in seen.slots if seen.tracks[s.name].draining_since]
    if stopping:
        return f"{', '.join(stopping)} stopping"
    return ""


def follow_load(
    seen: Seen,
    scale: Scale,
    bounds: Bounds,
    *,
    room: Room,
    drained_by_hand: Callable[[str], bool],
    start: Callable[[str], None],
    short_of_room: bool,
    now: float,
) -> Followed:
    """The scaler's next target, then parked slots started (through ``start``, those
    ``room`` finds memory for) or one instance drained to reach it."""
    running = running_slots(seen)
    hold = hold_reason(seen, running)
    # (the rotation as last published: a ready spare is eligible again until balance says no)
    serving = [s for s in running if s.name in seen.serving_before]
    loads = [Load(seen.probes[s.name].inflight, seen.probes[s.name].waiting) for s in serving]
    decided = decide(scale, loads, bounds, now, hold)
    if decided.decisions != scale.decisions:
        log.info("elastic: %s: %d wanted in rotation", decided.decisions[-1].reason, decided.target)
    desired = decided.target + seen.spares
    if hold or len(running) == desired:
        return Followed(decided, short_of_room)
    if len(running) < desired:
        return _scale_out(
            seen,
            decided,
            bounds.floor(now)[0],
            running,
            desired,
            room=room,
            drained_by_hand=drained_by_hand,
            start=start,
            warned=short_of_room,
        )
    return _scale_in(seen, decided, running, desired, short_of_room=short_of_room, now=now)


def _scale_out(
    seen: Seen,
    decided: Scale,
    floor: int,
    running: list[Slot],
    desired: int,
    *,
    room: Room,
    drained_by_hand: Callable[[str], bool],
    start: Callable[[str], None],
    warned: bool,
) -> Followed:
    """Start parked slots (not those drained by hand) up to ``desired`` running, as many as
    have memory. The target follows what can run: a scale-out without memory is taken back
    (and tried again after another busy period), warned about once until one starts; never
    below ``floor`` (a scheduled floor stays wanted, and its slots start once memory frees)."""
    parked = tuple(
        s
        for s in seen.slots
        if s.name in seen.processes
        and is_parked(seen.processes[s.name].state, bool(seen.tracks[s.name].failed))
        and not drained_by_hand(s.name)
    )
    startable = room(tuple(running), parked)[: desired - len(running)]
    for slot in startable:
        log.info("elastic: starting %s (%d wanted, %d running)", slot.name, desired, len(running))
        start(slot.name)
    short = desired - len(running) - len(startable)
    if not short:
        return Followed(decided, False)
    if not warned:
        log.warning(
            "elastic: %d more instance(s) wanted, but no parked slot has memory for one now (%d parked)",
            short,
            len(parked),
        )
    return Followed(dataclasses.replace(decided, target=max(floor, decided.target - short)), True)


def _scale_in(
    seen: Seen, decided: Scale, running: list[Slot], desired: int, *, short_of_room: bool, now: float
) -> Followed:
    """Drain one instance to stop it once idle: one out of rotation first (a spare, or one
    still loading), else the last in slot order, the one the smaller rotation leaves out
    anyway."""
    victim = max(running, key=lambda s: (s.name not in seen.serving_before, s.index))
    log.info("elastic: draining and stopping %s (%d wanted, %d running)", victim.name, desired, len(running))
    track = start_drain(seen.tracks[victim.name], "scaled in: stopping once idle", DrainAction.STOP, now, "scaled_in")
    return Followed(decided, short_of_room, {victim.name: track})
