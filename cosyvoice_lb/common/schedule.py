"""Scheduled capacity (``--schedule "CRON=N"``): cron times, and the floor they set.

A cron time has the five fields of crontab(5) — minute, hour, day of month, month, day of
week — each a number, ``*``, a range ``a-b``, a list ``a,b``, or a step ``*/n`` or
``a-b/n``; day of week is 0-7 with 0 and 7 both Sunday. As in cron, when both day fields
are restricted (neither starts with ``*``) a day matching either one counts.

Pure and standard library only: the launcher's health loop asks :func:`scheduled_floor`
with its own clock, ``k8s render`` turns the same entries into KEDA's cron windows, and the
settings' check (:func:`schedule_check`) refuses a bad entry saying which field is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from cosyvoice_lb.common.checks import parsed_by

SEPARATOR = ";"  # between entries in one value (COSYVOICE_LB_SCHEDULE, cluster.json)
LOOK_BACK_DAYS = 8  # an entry that fired longer ago than this sets no floor
SYNTAX = "numbers, *, ranges a-b, lists a,b, steps */n and a-b/n"
EXAMPLE = "'0 9 * * 1-5=3'"

# (name, lowest, highest) of each field, in order.
FIELDS = (
    ("minute", 0, 59),
    ("hour", 0, 23),
    ("day of month", 1, 31),
    ("month", 1, 12),
    ("day of week", 0, 7),
)


class ScheduleError(ValueError):
    """A schedule entry that cannot be read; the message names the field and what is allowed."""


@dataclass(frozen=True)
class Cron:
    """One cron time: the values each field allows (day of week 0-6, Sunday 0)."""

    text: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]
    days_star: bool  # the day-of-month field starts with * (cron's rule for the two day fields)
    weekdays_star: bool

    def matches_day(self, day: datetime) -> bool:
        if day.month not in self.months:
            return False
        in_month = day.day in self.days
        in_week = (day.weekday() + 1) % 7 in self.weekdays  # (Python's Monday 0 is cron's 1)
        if self.days_star or self.weekdays_star:
            return in_month and in_week
        return in_month or in_week

    def matches(self, when: datetime) -> bool:
        return when.minute in self.minutes and when.hour in self.hours and self.matches_day(when)

    def last_at_or_before(self, now: datetime, days: int = LOOK_BACK_DAYS) -> datetime | None:
        """The latest minute this time matches at or before ``now`` (its wall clock, to the
        minute), looking back at most ``days`` days; None when it did not match in them."""
        limit = now.replace(second=0, microsecond=0)
        earliest = limit - timedelta(days=days)
        for back in range(days + 1):
            day = (limit - timedelta(days=back)).replace(hour=0, minute=0)
            if not self.matches_day(day):
                continue
            for hour in sorted(self.hours, reverse=True):
                if not back and hour > limit.hour:
                    continue
                minutes = [m for m in self.minutes if back or hour < limit.hour or m <= limit.minute]
                if minutes:
                    fired = day.replace(hour=hour, minute=max(minutes))
                    return fired if fired >= earliest else None
        return None

    @property
    def weekly(self) -> bool:
        """Every day of month and every month allowed: the times repeat week after week."""
        return self.days == frozenset(range(1, 32)) and self.months == frozenset(range(1, 13))


@dataclass(frozen=True)
class Entry:
    """``CRON=N``: from the time the cron names on, at least ``count`` instances (or pods)."""

    text: str
    cron: Cron
    count: int


def _field(text: str, name: str, low: int, high: int) -> frozenset[int]:
    allowed = f"{name} takes {low}-{high} ({SYNTAX})"
    values: set[int] = set()
    for part in text.split(","):
        spec, slash, step_text = part.partition("/")
        step = 1
        if slash:
            if not step_text.isdigit() or int(step_text) < 1:
                raise ScheduleError(f"{name} {part!r}: a step is a whole number of at least 1; {allowed}")
            step = int(step_text)
        if spec == "*":
            first, last = low, high
        elif "-" in spec:
            a, _, b = spec.partition("-")
            if not (a.isdigit() and b.isdigit()):
                raise ScheduleError(f"{name} {part!r} is not a range a-b; {allowed}")
            first, last = int(a), int(b)
            if first > last:
                raise ScheduleError(f"{name} {part!r}: a range goes up ({last}-{first}?); {allowed}")
        elif spec.isdigit() and not slash:
            first = last = int(spec)
        else:
            raise ScheduleError(f"{name} {part!r} is not understood; {allowed}")
        for value in (first, last):
            if not low <= value <= high:
                raise ScheduleError(f"{name} {value} is out of range; {allowed}")
        values.update(range(first, last + 1, step))
    return frozenset(values)


def parse_cron(text: str) -> Cron:
    """A 5-field cron time; :class:`ScheduleError` says which field is wrong and why."""
    parts = text.split()
    if len(parts) != len(FIELDS):
        raise ScheduleError(
            f"a cron time has 5 fields (minute hour day-of-month month day-of-week), got {len(parts)} in {text!r}"
        )
    minutes, hours, days, months, weekdays = (
        _field(part, name, low, high) for part, (name, low, high) in zip(parts, FIELDS)
    )
    return Cron(
        " ".join(parts),
        minutes,
        hours,
        days,
        months,
        frozenset(d % 7 for d in weekdays),  # 7 is Sunday too
        parts[2].startswith("*"),
        parts[4].startswith("*"),
    )


def parse_entry(text: str) -> Entry:
    """``CRON=N``, e.g. ``0 9 * * 1-5=3``."""
    cron_text, equals, count_text = text.strip().rpartition("=")
    if not equals or not cron_text.strip():
        raise ScheduleError(f"{text.strip()!r} is not CRON=N: write the cron time, '=', and a count, e.g. {EXAMPLE}")
    if not count_text.strip().isdigit() or int(count_text) < 1:
        raise ScheduleError(f"{text.strip()!r}: N (after '=') must be a whole number of at least 1, e.g. {EXAMPLE}")
    try:
        cron = parse_cron(cron_text)
    except ScheduleError as exc:
        raise ScheduleError(f"{text.strip()!r}: {exc}") from None
    return Entry(f"{cron.text}={int(count_text)}", cron, int(count_text))


def parse_schedule(value: str) -> tuple[Entry, ...]:
    """Every entry of a setting's value (entries separated by ``;``, blank ones skipped)."""
    return tuple(parse_entry(part) for part in value.split(SEPARATOR) if part.strip())


# The setting's check: what is wrong with the first bad entry ("" when none is).
schedule_check = parsed_by(parse_schedule, joiner=" ")


def last_fired(entries: tuple[Entry, ...] | list[Entry], now: datetime) -> tuple[Entry, datetime] | None:
    """The entry that fired most recently at or before ``now`` (within :data:`LOOK_BACK_DAYS`)
    and when; of entries firing in the same minute, the one given last."""
    found: tuple[Entry, datetime] | None = None
    for entry in entries:
        fired = entry.cron.last_at_or_before(now)
        if fired is not None and (found is None or fired >= found[1]):
            found = (entry, fired)
    return found


def scheduled_floor(entries: tuple[Entry, ...] | list[Entry], now: datetime) -> int | None:
    """N of the entry that fired most recently at or before ``now`` (its wall clock), looking
    back at most 8 days; None when none fired in that window."""
    found = last_fired(entries, now)
    return None if found is None else found[0].count
