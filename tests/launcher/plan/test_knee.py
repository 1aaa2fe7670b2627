"""What `calibrate` makes of its sweep (launcher/plan/knee.py): the knee `auto` then stands
for, the memory each synthesis more costs, and how the planner takes them."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.sizes import GiB, MiB
from cosyvoice_lb.launcher.plan.footprint import budget_for, concurrency_reasons
from cosyvoice_lb.launcher.plan.knee import Point, knee, levels, measured_knee, per_synthesis, sweep_entry
from cosyvoice_lb.launcher.state.layout import Layout


def test_levels_double_up_to_the_most_which_is_always_measured():
    assert levels(8) == [1, 2, 4, 8]
    assert levels(6) == [1, 2, 4, 6]
    assert levels(1) == [1]


def test_the_knee_is_the_fewest_at_once_within_a_tenth_of_the_best():
    # measured on this kind of box, vLLM on the small model: 1.4, 3.3, 3.3 audio-s/s at 1, 4, 8
    points = [Point(1, 14.0, 10.0), Point(4, 33.0, 10.0), Point(8, 33.0, 10.0)]
    assert knee(points) == 4
    # throughput that falls past a point (contention): the knee is before it
    assert knee([Point(1, 10, 10), Point(2, 19, 10), Point(4, 20, 10), Point(8, 15, 10)]) == 2
    assert knee([Point(1, 10, 10), Point(2, 10, 10)]) == 1  # (nothing gained: one at a time)


@given(st.lists(st.tuples(st.integers(1, 64), st.floats(0.1, 100), st.floats(0.1, 100)), min_size=1, max_size=8))
def test_the_knee_is_a_measured_level_and_nothing_fewer_reaches_the_bar(raw):
    points = [Point(c, a, w) for c, a, w in raw]
    chosen = knee(points)
    best = max(p.throughput for p in points)
    assert chosen in {p.concurrency for p in points}
    assert all(p.throughput < 0.9 * best for p in points if p.concurrency < chosen)


def test_memory_per_synthesis_is_the_growth_from_the_fewest_to_the_most():
    assert per_synthesis([Point(1, 1, 1, 6 * GiB), Point(8, 1, 1, 13 * GiB)]) == GiB
    assert per_synthesis([Point(1, 1, 1, 6 * GiB), Point(8, 1, 1, 5 * GiB)]) == 0  # (it did not grow)
    assert per_synthesis([Point(1, 1, 1, 0), Point(8, 1, 1, 0)]) == 0  # (nothing read)


def test_a_knee_counts_only_on_the_kind_of_device_it_was_measured_on():
    entry = sweep_entry([Point(1, 1, 1), Point(2, 3, 1)], "cpu", "2026-12-06 12:00")
    assert entry["knee"] == 2 and entry["throughput"] == {"1": 1.0, "2": 3.0}
    assert measured_knee(entry, "cpu") == 2 and measured_knee(entry, "gpu") is None
    assert measured_knee(None, "cpu") is None and measured_knee({"device": "cpu"}, "cpu") is None


def calibrated(tmp_path, key: str, entry: dict) -> Layout:
    layout = Layout(tmp_path)
    layout.footprint_json.parent.mkdir(parents=True, exist_ok=True)
    layout.footprint_json.write_text(json.dumps({key: entry}))
    return layout


def test_the_planner_plans_a_cpu_box_with_what_calibrate_measured_there(tmp_path):
    entry = {
        **sweep_entry([Point(1, 10, 10), Point(2, 19, 10), Point(4, 20, 10)], "cpu", "2026-12-06 12:00"),
        "per_synthesis_bytes": 300 * MiB,
        "host_bytes": 700 * MiB,
        "host_peak_bytes": 636 * MiB,
    }
    layout = calibrated(tmp_path, "espeak", entry)
    settings = Settings(engine="espeak", state_dir=str(tmp_path))
    budget, source = budget_for(settings, layout)
    assert budget.cpu_concurrency == 2 and budget.host_footprint == 700 * MiB and budget.host_per_synthesis == 300 * MiB
    assert source == "calibrated 2026-12-06 12:00 on this CPU"
    assert (
        concurrency_reasons(settings)["cpu"] == "--instance-concurrency auto = 2 measured by calibrate 2026-12-06 12:00"
    )
    assert budget.concurrency == 1  # (on a GPU: not measured there, the documented default)
    given = budget_for(Settings(engine="espeak", state_dir=str(tmp_path), instance_concurrency="3"), layout)[0]
    assert given.cpu_concurrency == 3  # (a number given is used as given)
