"""Elastic decisions: one more when every instance has had a queue for --scale-up-after,
one fewer after --idle-release without requests, within the bounds, held while told."""

from __future__ import annotations

from cosyvoice_lb.launcher.health.scaling import HISTORY, Bounds, Decision, Load, Scale, decide

BOUNDS = Bounds(low=1, high=3, scale_up_after=30, idle_release=600)
BUSY = [Load(inflight=1, waiting=2), Load(inflight=1, waiting=1)]
IDLE = [Load(0, 0), Load(0, 0)]


def run(scale: Scale, loads: list[Load], times: range | list[float], hold: str = "") -> Scale:
    for now in times:
        scale = decide(scale, loads, BOUNDS, float(now), hold)
    return scale


def test_scales_out_after_a_whole_busy_period():
    scale = run(Scale(2), BUSY, range(1000, 1029))
    assert scale.target == 2 and scale.busy_since == 1000
    scale = decide(scale, BUSY, BOUNDS, 1030.0)
    assert scale.target == 3
    assert "scale out: all 2 instance(s) in rotation had a queue for 30s (3 waiting now" in scale.decisions[-1].reason
    assert scale.busy_since is None  # the next step out needs a whole period again


def test_a_moment_without_a_queue_restarts_the_busy_clock():
    scale = run(Scale(2), BUSY, range(1000, 1020))
    scale = decide(scale, [Load(1, 0), Load(1, 3)], BOUNDS, 1020.0)  # one has no queue
    assert scale.busy_since is None
    scale = run(scale, BUSY, range(1021, 1050))
    assert scale.target == 2


def test_never_above_the_plan_nor_below_the_floor():
    assert run(Scale(3), BUSY, range(0, 200)).target == 3
    assert run(Scale(1), IDLE, range(0, 2000, 10)).target == 1


def test_scales_in_one_per_idle_period():
    scale = run(Scale(3), IDLE, range(0, 600, 10))
    assert scale.target == 3
    scale = decide(scale, IDLE, BOUNDS, 600.0)
    assert scale.target == 2 and scale.decisions[-1] == Decision(
        600.0, 2, "scale in: no request for 600s (--idle-release 600)"
    )
    scale = run(scale, IDLE, range(610, 1200, 10))
    assert scale.target == 2
    assert decide(scale, IDLE, BOUNDS, 1210.0).target == 1


def test_busy_instances_without_a_queue_are_neither_busy_nor_idle():
    scale = run(Scale(2), [Load(1, 0), Load(1, 0)], range(0, 2000, 10))
    assert scale.target == 2 and scale.decisions == ()


def test_held_keeps_the_target_and_restarts_both_clocks():
    scale = run(Scale(2), BUSY, range(0, 29))
    scale = decide(scale, BUSY, BOUNDS, 29.0, hold="a roll-out is under way")
    assert (scale.target, scale.busy_since, scale.idle_since) == (2, None, None)
    assert run(scale, BUSY, range(30, 59)).target == 2


def test_history_is_bounded_and_round_trips_through_a_dict():
    scale = Scale(1)
    for i in range(HISTORY + 3):
        scale = Scale(scale.target, decisions=(*scale.decisions, Decision(float(i), 1, f"d{i}"))[-HISTORY:])
    assert len(scale.decisions) == HISTORY and scale.decisions[-1].reason == f"d{HISTORY + 2}"
    back = Scale.from_dict(scale.as_dict(), BOUNDS)
    assert back == scale


def test_a_saved_target_outside_new_bounds_is_clamped_and_junk_is_the_floor():
    assert Scale.from_dict({"target": 9}, BOUNDS).target == 3
    assert Scale.from_dict({"target": "x"}, BOUNDS) == Scale(1)
    assert Scale.from_dict(None, BOUNDS) == Scale(1)


def test_nothing_in_rotation_is_no_reason_to_scale_in():
    assert run(Scale(3), [], range(0, 2000, 10)).target == 3
