"""Scheduled capacity (--schedule "CRON=N"): the cron syntax and its errors
(cosyvoice_lb/common/schedule.py), the floor of the entry that fired last, and the elastic
loop's target following it on an injected clock (health/scaling.py, health/elastic.py)."""

from __future__ import annotations

import logging
from datetime import datetime

import pytest
import test_health_pool
from test_health_pool import I0, I1, I2, Rig

from cosyvoice_lb.common.schedule import (
    ScheduleError,
    last_fired,
    parse_cron,
    parse_entry,
    parse_schedule,
    schedule_check,
    scheduled_floor,
)
from cosyvoice_lb.common.setting_errors import setting_errors
from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.health.scaling import Bounds, Load, Scale, decide, schedule_notes
from cosyvoice_lb.launcher.plan.planner import Roles

WORKDAY = parse_schedule("0 9 * * 1-5=3;0 22 * * *=1")
MONDAY = datetime(2024, 6, 3)  # (a Monday)
IDLE = [Load(0, 0)]


def at(day: int, hour: int, minute: int = 0, second: int = 0) -> datetime:
    """June 2024, day ``day`` (3 is a Monday, 8 a Saturday)."""
    return datetime(2024, 6, day, hour, minute, second)


# --- the cron syntax ------------------------------------------------------------------------


def test_each_field_takes_numbers_stars_ranges_lists_and_steps():
    cron = parse_cron("*/15 9-17/4 1,15 * 1-5")
    assert cron.minutes == {0, 15, 30, 45} and cron.hours == {9, 13, 17}
    assert cron.days == {1, 15} and cron.months == set(range(1, 13)) and cron.weekdays == {1, 2, 3, 4, 5}
    assert parse_cron("0 0 * * 7").weekdays == {0} == parse_cron("0 0 * * 0").weekdays  # 7 and 0: Sunday
    assert parse_cron("0 0 * * 5-7").weekdays == {5, 6, 0}
    assert parse_cron("  5   4 * * *  ").text == "5 4 * * *"


@pytest.mark.parametrize(
    "text, words",
    [
        ("0 9 * *", "a cron time has 5 fields (minute hour day-of-month month day-of-week), got 4"),
        ("60 9 * * *", "minute 60 is out of range; minute takes 0-59"),
        ("0 24 * * *", "hour 24 is out of range; hour takes 0-23"),
        ("0 9 0 * *", "day of month 0 is out of range; day of month takes 1-31"),
        ("0 9 * 13 *", "month 13 is out of range; month takes 1-12"),
        ("0 9 * * 8", "day of week 8 is out of range; day of week takes 0-7"),
        ("0 9 * * MON", "day of week 'MON' is not understood"),
        ("0 9 * * 5-1", "a range goes up"),
        ("*/0 9 * * *", "minute '*/0': a step is a whole number of at least 1"),
        ("5/10 9 * * *", "minute '5/10' is not understood"),
        ("0 9-x * * *", "hour '9-x' is not a range a-b"),
    ],
)
def test_a_bad_cron_time_names_its_field_and_what_is_allowed(text, words):
    with pytest.raises(ScheduleError) as caught:
        parse_cron(text)
    assert words in str(caught.value)
    if "fields" not in words:
        assert "numbers, *, ranges a-b, lists a,b, steps */n and a-b/n" in str(caught.value)


@pytest.mark.parametrize(
    "text, words",
    [
        ("0 9 * * 1-5", "is not CRON=N: write the cron time, '=', and a count, e.g. '0 9 * * 1-5=3'"),
        ("0 9 * * 1-5=0", "N (after '=') must be a whole number of at least 1"),
        ("0 9 * * 1-5=two", "N (after '=') must be a whole number of at least 1"),
        ("=3", "is not CRON=N"),
        ("0 99 * * *=3", "'0 99 * * *=3': hour 99 is out of range"),
    ],
)
def test_a_bad_entry_says_what_to_write(text, words):
    with pytest.raises(ScheduleError) as caught:
        parse_entry(text)
    assert words in str(caught.value)


def test_the_setting_is_checked_entry_by_entry_and_names_the_flag():
    assert schedule_check("--schedule", "0 9 * * 1-5=3; 0 22 * * *=1;") == ""
    found = setting_errors(Settings(schedule="0 9 * * 1-5=3;0 25 * * *=1"))
    assert len(found) == 1 and found[0].startswith("--schedule '0 25 * * *=1': hour 25 is out of range")
    assert [e.count for e in parse_schedule(" 0 9 * * 1-5=3 ;; 0 22 * * *=1 ")] == [3, 1]
    assert parse_schedule("") == ()


def test_both_day_fields_restricted_match_either_and_a_star_step_matches_both():
    either = parse_cron("0 9 13 * 5")  # the 13th, or any Friday (cron's rule)
    assert either.matches(datetime(2024, 6, 13, 9)) and either.matches(datetime(2024, 6, 7, 9))
    assert not either.matches(datetime(2024, 6, 6, 9))
    both = parse_cron("0 9 */2 * 5")  # a day field starting with *: both must match
    assert both.matches(datetime(2024, 6, 7, 9)) and not both.matches(datetime(2024, 6, 14, 9))


# --- the floor: the entry that fired last -----------------------------------------------------


@pytest.mark.parametrize(
    "now, floor",
    [
        (at(3, 8, 59, 59), 1),  # Monday before 9: Sunday's 22:00
        (at(3, 9, 0), 3),  # at 9:00 sharp
        (at(3, 21, 59), 3),
        (at(3, 22, 0, 30), 1),
        (at(7, 23, 0), 1),  # Friday night
        (at(8, 12, 0), 1),  # Saturday: no 9:00 entry, Friday's 22:00 still
        (at(10, 9, 30), 3),  # the next Monday
    ],
)
def test_the_floor_is_the_n_of_the_entry_that_fired_last(now, floor):
    assert scheduled_floor(WORKDAY, now) == floor


def test_nothing_fired_within_eight_days_is_no_floor():
    new_year = parse_schedule("0 9 1 1 *=4")
    assert scheduled_floor(new_year, datetime(2024, 1, 9, 8, 59)) == 4  # 8 days after, less a minute
    assert scheduled_floor(new_year, datetime(2024, 1, 9, 9, 1)) is None
    assert scheduled_floor(new_year, datetime(2024, 6, 3, 12)) is None
    assert scheduled_floor((), MONDAY) is None


def test_entries_firing_in_the_same_minute_the_last_given_wins():
    assert scheduled_floor(parse_schedule("0 9 * * *=2;0 9 * * 1=5"), at(3, 10)) == 5
    assert scheduled_floor(parse_schedule("0 9 * * 1=5;0 9 * * *=2"), at(3, 10)) == 2
    entry, fired = last_fired(parse_schedule("*/20 * * * *=2"), at(3, 10, 59, 59)) or (None, None)
    assert entry is not None and fired == at(3, 10, 40)


# --- the elastic loop's target ---------------------------------------------------------------


def bounds(schedule: str = "0 9 * * 1-5=3;0 22 * * *=1", high: int = 4) -> Bounds:
    return Bounds(low=1, high=high, scale_up_after=30, idle_release=600, schedule=parse_schedule(schedule))


def test_the_target_rises_to_the_scheduled_floor_at_nine_and_falls_by_idleness_after_ten():
    b = bounds()
    scale = decide(Scale(1), IDLE, b, at(3, 8, 59, 30).timestamp())
    assert scale.target == 1
    scale = decide(scale, IDLE, b, at(3, 9, 0, 1).timestamp())
    assert scale.target == 3 and scale.decisions[-1].reason.startswith("scheduled: at least 3 since Mon 09:00")
    for hour in range(10, 22):  # idle all day: never below the floor
        scale = decide(scale, IDLE, b, at(3, hour).timestamp())
    assert scale.target == 3 and scale.idle_since is not None
    scale = decide(scale, IDLE, b, at(3, 22, 0, 5).timestamp())  # idle for hours: one fewer at once
    assert scale.target == 2 and scale.decisions[-1].reason.startswith("scale in")
    for minute in range(1, 12):  # the next one a whole --idle-release later
        scale = decide(scale, IDLE, b, at(3, 22, minute, 5).timestamp())
    assert scale.target == 1 and [d.target for d in scale.decisions] == [3, 2, 1]
    assert decide(scale, IDLE, b, at(4, 9, 0, 1).timestamp()).target == 3  # Tuesday morning
    assert decide(scale, IDLE, b, at(8, 9, 0, 1).timestamp()).target == 1  # not on Saturday


def test_above_the_floor_the_load_decides_and_a_hold_waits():
    b = bounds()
    busy = [Load(1, 2)] * 3
    scale = decide(Scale(3), busy, b, at(3, 10).timestamp())
    scale = decide(scale, busy, b, at(3, 10, 0, 30).timestamp())
    assert scale.target == 4  # scale out past the floor, as before
    held = decide(Scale(1), IDLE, b, at(3, 9, 1).timestamp(), hold="instance-1 loading")
    assert held.target == 1


def test_the_floor_is_capped_at_the_plan_and_said_once():
    b = bounds("0 9 * * *=12", high=4)
    scale = decide(Scale(1), IDLE, b, at(3, 9, 5).timestamp())
    assert scale.target == 4 and "capped at the 4 planned" in scale.decisions[-1].reason
    notes = schedule_notes(Settings(schedule="0 9 * * *=12;0 22 * * *=1"), Roles(serving=4, min_serving=1))
    assert notes == [
        "--schedule '0 9 * * *=12' asks for 12 instances, above the 4 planned to serve: capped at 4 "
        "(raise --instances or free memory for more)"
    ]
    fixed = schedule_notes(Settings(schedule="0 9 * * *=2"), Roles(serving=4))
    assert len(fixed) == 1 and "changes nothing" in fixed[0]
    assert schedule_notes(Settings(), Roles(serving=4, min_serving=1)) == []


rigs = test_health_pool.rigs  # the fixture: health loops on a scripted cluster


def test_the_health_loop_starts_parked_slots_at_nine_on_its_clock(tmp_path, rigs, caplog):
    caplog.set_level(logging.INFO, logger="cosyvoice_lb.health")
    rig = rigs(
        tmp_path,
        Roles(serving=4, min_serving=1),
        running=1,
        schedule="0 9 * * 1-5=3;0 22 * * *=1;0 10 * * 1-5=9",
        idle_release=5,
    )
    assert "'0 10 * * 1-5=9' asks for 9 instances, above the 4 planned to serve: capped at 4" in caplog.text
    rig.clock.now = at(3, 8, 59, 50).timestamp()
    rig.step(3)
    assert rig.serving() == [I0] and rig.loop.scale.target == 1
    rig.clock.now = at(3, 9, 0, 0).timestamp()
    rig.step()  # 09:00:01
    assert rig.loop.scale.target == 3
    starts = [c[1] for c in rig.sup.calls if c[0] == "start"]
    assert starts == [I1, I2]  # two parked slots, at once
    assert "elastic: scheduled: at least 3 since Mon 09:00" in caplog.text
    for pid, name in enumerate((I1, I2), 300):
        rig.start(name, pid)
    rig.step(3)
    assert rig.serving() == [I0, I1, I2]
    assert read_scale(rig)["target"] == 3

    rig.clock.now = at(3, 22, 0, 0).timestamp()  # idle since the morning: one fewer once the floor is 1
    rig.step(7)
    assert rig.loop.scale.target == 2 and rig.loop.tracks[I2].drain_signal is not None


def read_scale(rig: Rig) -> dict:
    from cosyvoice_lb.launcher.state.health_report import read_report

    return read_report(rig.layout).pool["scale"]
