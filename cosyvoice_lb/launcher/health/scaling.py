"""Elastic instances on one box: when to serve with one more, and when with one fewer.

Pure: the loads of the instances in rotation and the clock go in; the next
:class:`Scale` (the number wanted in rotation, and why it last changed) comes out. The
health loop starts a parked slot or drains and stops one to follow it.

The floor is --min-instances, raised by ``--schedule`` while a scheduled entry asks for more
(:meth:`Bounds.floor`, on the loop's clock in the box's local time): below it the target
goes up at once; above it the load decides as before.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime

from cosyvoice_lb.common.schedule import Entry, last_fired, parse_schedule
from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.plan.planner import Roles

HISTORY = 8  # decisions kept (health.json, status)


@dataclass(frozen=True)
class Bounds:
    low: int  # --min-instances
    high: int  # the plan's serving count (--instances, or as many as fit)
    scale_up_after: float
    idle_release: float
    schedule: tuple[Entry, ...] = ()  # --schedule

    @classmethod
    def of(cls, pool: Roles, settings: Settings) -> Bounds:
        return cls(
            pool.min_serving,
            pool.serving,
            settings.scale_up_after,
            settings.idle_release,
            parse_schedule(settings.schedule),
        )

    def floor(self, now: float) -> tuple[int, str]:
        """The floor at ``now`` (epoch seconds, read in local time) and why: the N of the
        schedule's entry that fired last when it is above --min-instances, capped at the
        plan's serving count; else --min-instances ("")."""
        found = last_fired(self.schedule, datetime.fromtimestamp(now)) if self.schedule else None
        if found is None or min(found[0].count, self.high) <= self.low:
            return self.low, ""
        entry, fired = found
        floor = min(entry.count, self.high)
        capped = f", capped at the {self.high} planned" if entry.count > self.high else ""
        return floor, f"scheduled: at least {floor} since {fired:%a %H:%M} ('{entry.text}'{capped})"


@dataclass(frozen=True)
class Load:
    """One instance in rotation, as its last probe saw it."""

    inflight: int
    waiting: int


@dataclass(frozen=True)
class Decision:
    at: float  # epoch seconds
    target: int  # the number wanted after it
    reason: str

    def as_dict(self) -> dict:
        return {"at": self.at, "target": self.target, "reason": self.reason}


@dataclass(frozen=True)
class Scale:
    target: int  # instances wanted in rotation
    busy_since: float | None = None  # every instance in rotation has had a queue since (None: not now)
    idle_since: float | None = None  # no instance has had a request since (None: not now)
    decisions: tuple[Decision, ...] = ()  # the latest last

    def as_dict(self) -> dict:
        return {
            "target": self.target,
            "busy_since": self.busy_since,
            "idle_since": self.idle_since,
            "decisions": [d.as_dict() for d in self.decisions],
        }

    @classmethod
    def from_dict(cls, saved: object, bounds: Bounds) -> Scale:
        """Back from health.json (a loop restarted keeps its target); the bounds' floor
        when there is nothing usable."""
        if not isinstance(saved, dict):
            return cls(bounds.low)
        try:
            decisions = tuple(
                Decision(float(d["at"]), int(d["target"]), str(d["reason"])) for d in saved.get("decisions", [])
            )
            target = min(bounds.high, max(bounds.low, int(saved["target"])))
            since = [saved.get(key) for key in ("busy_since", "idle_since")]
            busy, idle = (None if value is None else float(value) for value in since)
            return cls(target, busy, idle, decisions)
        except (KeyError, TypeError, ValueError):
            return cls(bounds.low)


def decide(scale: Scale, loads: list[Load], bounds: Bounds, now: float, hold: str = "") -> Scale:
    """The next scale. One more when every instance in rotation has had requests waiting for
    its engine for ``scale_up_after``; one fewer after ``idle_release`` without a request
    anywhere; never outside the bounds. ``hold`` (why not now: a roll-out, an instance still
    loading or stopping) keeps the target and restarts both clocks."""
    if hold:
        return dataclasses.replace(scale, busy_since=None, idle_since=None)
    floor, scheduled = bounds.floor(now)
    busy = bool(loads) and all(load.inflight > 0 and load.waiting > 0 for load in loads)
    # (none in rotation: drained by hand, or all out: nothing to judge the load by)
    idle = bool(loads) and all(load.inflight == 0 and load.waiting == 0 for load in loads)
    busy_since = (now if scale.busy_since is None else scale.busy_since) if busy else None
    idle_since = (now if scale.idle_since is None else scale.idle_since) if idle else None
    scale = dataclasses.replace(scale, busy_since=busy_since, idle_since=idle_since)
    if scheduled and scale.target < floor:  # (below the schedule's floor: up at once)
        return _decided(scale, floor, scheduled, now)
    if busy_since is not None and scale.target < bounds.high and now - busy_since >= bounds.scale_up_after:
        waiting = sum(load.waiting for load in loads)
        return _decided(
            scale,
            scale.target + 1,
            f"scale out: all {len(loads)} instance(s) in rotation had a queue for {now - busy_since:.0f}s "
            f"({waiting} waiting now; --scale-up-after {bounds.scale_up_after:g})",
            now,
        )
    if idle_since is not None and scale.target > floor and now - idle_since >= bounds.idle_release:
        return _decided(
            scale,
            scale.target - 1,
            f"scale in: no request for {now - idle_since:.0f}s (--idle-release {bounds.idle_release:g})",
            now,
        )
    return scale


def schedule_notes(settings: Settings, pool: Roles) -> list[str]:
    """What the health log says once about --schedule: entries asking for more instances than
    the plan has to serve (capped), or a pool that is not elastic (the schedule changes nothing)."""
    entries = parse_schedule(settings.schedule)
    if entries and not pool.elastic:
        return [
            f"--schedule changes nothing: every one of the {pool.serving} planned instance(s) serves "
            "(a fixed pool; --min-instances below --instances makes it elastic)"
        ]
    return [
        f"--schedule '{entry.text}' asks for {entry.count} instances, above the {pool.serving} planned to serve: "
        f"capped at {pool.serving} (raise --instances or free memory for more)"
        for entry in entries
        if entry.count > pool.serving
    ]


def _decided(scale: Scale, target: int, reason: str, now: float) -> Scale:
    # Both clocks start again: the next step out (or in) needs a whole period of its own.
    return Scale(target, None, None, (*scale.decisions, Decision(now, target, reason))[-HISTORY:])
