"""bench/concurrency.py's pure parts: the turn schedule, the percentile summary, the metric
deltas that give the compute floor, the shapes and the tables (no cluster here)."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from concurrency import (  # noqa: E402
    Floor,
    Spread,
    Throughput,
    delta,
    first_chunk_rows,
    parse_metrics,
    percentile,
    shapes_of,
    table,
    turns,
)

SCRAPE = """\
# HELP cosyvoice_first_chunk_compute_seconds A stream's first chunk inside the engine.
# TYPE cosyvoice_first_chunk_compute_seconds histogram
cosyvoice_first_chunk_compute_seconds_bucket{le="0.5",part="llm"} {llm_le}
cosyvoice_first_chunk_compute_seconds_bucket{le="+Inf",part="llm"} {count}
cosyvoice_first_chunk_compute_seconds_count{part="llm"} {count}
cosyvoice_first_chunk_compute_seconds_sum{part="llm"} {llm}
cosyvoice_first_chunk_compute_seconds_bucket{le="+Inf",part="audio"} {count}
cosyvoice_first_chunk_compute_seconds_count{part="audio"} {count}
cosyvoice_first_chunk_compute_seconds_sum{part="audio"} {audio}
# HELP cosyvoice_first_package_seconds Arrival to first chunk.
# TYPE cosyvoice_first_package_seconds histogram
cosyvoice_first_package_seconds_count{route="api"} {count}
cosyvoice_first_package_seconds_sum{route="api"} {first}
cosyvoice_first_package_seconds_count{route="ui"} 7.0
cosyvoice_first_package_seconds_sum{route="ui"} 70.0
# HELP cosyvoice_audio_duration_seconds Audio made.
# TYPE cosyvoice_audio_duration_seconds histogram
cosyvoice_audio_duration_seconds_sum{route="api"} {audio_api}
cosyvoice_audio_duration_seconds_sum{route="openai"} 1.5
"""


def scrape(count, llm, audio, first, audio_api=0.0, llm_le=0):
    text = SCRAPE
    for key, value in dict(count=count, llm=llm, audio=audio, first=first, audio_api=audio_api, llm_le=llm_le).items():
        text = text.replace("{" + key + "}", repr(float(value)))
    return parse_metrics(text)


def test_turns_alternate_the_kinds_round_after_round():
    assert turns(3, ("cluster", "own")) == ["cluster", "own"] * 3
    assert turns(2, ("cluster", "own", "layer")) == ["cluster", "own", "layer", "cluster", "own", "layer"]
    assert turns(0, ("cluster", "own")) == []


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0], [0.2, 1.7, 0.9, 0.4, 3.3, 0.8, 2.2]])
def test_percentiles_are_numpys_linear_ones(values):
    ordered = sorted(values)
    for q in (50, 90):
        assert percentile(ordered, q) == pytest.approx(float(np.percentile(values, q)))


def test_a_spread_counts_failures_apart_and_leaves_them_out_of_the_percentiles():
    spread = Spread.of([0.8, None, 0.6, float("nan"), 1.0])
    assert (spread.count, spread.failed) == (3, 2)
    assert spread.p50 == pytest.approx(0.8) and spread.p90 == pytest.approx(0.96)
    assert spread.mean == pytest.approx(0.8)
    empty = Spread.of([None])
    assert (empty.count, empty.failed) == (0, 1) and math.isnan(empty.p50)


def test_the_floor_is_the_means_between_two_scrapes_of_the_instance():
    before = scrape(count=2, llm=0.9, audio=0.5, first=2.0, llm_le=1)
    after = scrape(count=6, llm=2.5, audio=1.3, first=5.2, llm_le=4)
    floor = Floor.of(before, after)
    assert floor.count == 4
    assert floor.llm == pytest.approx(0.4) and floor.audio == pytest.approx(0.2)
    assert floor.total == pytest.approx(0.6)
    assert floor.first_package == pytest.approx(0.8)  # the api route's, not the ui's
    assert delta(before, after, "cosyvoice_first_chunk_compute_seconds_bucket", part="llm", le="0.5") == 3


def test_a_floor_without_streams_is_nan_not_a_division_by_zero():
    same = scrape(count=3, llm=1.0, audio=0.5, first=1.8)
    floor = Floor.of(same, same)
    assert floor.count == 0 and math.isnan(floor.total)


def test_audio_made_sums_every_route_of_every_instance():
    before = scrape(count=0, llm=0, audio=0, first=0, audio_api=10.0)
    after = scrape(count=0, llm=0, audio=0, first=0, audio_api=35.5)
    assert delta(before, after, "cosyvoice_audio_duration_seconds_sum") == pytest.approx(25.5)
    assert delta({}, after, "cosyvoice_audio_duration_seconds_sum") == pytest.approx(37.0)


def test_shapes_parse_and_refuse_zero():
    assert shapes_of("1x1, 1X4,2x2") == [(1, 1), (1, 4), (2, 2)]
    with pytest.raises(ValueError):
        shapes_of("0x2")
    with pytest.raises(ValueError):
        shapes_of("2")


def test_tables_are_markdown_with_the_floor_measured_apart_subtracted_from_the_means():
    floor = Floor(llm=0.4, audio=0.3, count=12, first_package=0.72)
    spreads = {
        "cluster": Spread(12, 0, 0.75, 0.8, 0.76),
        "own": Spread(11, 1, 1.6, 1.9, 1.5),
        "floor": Spread(12, 0, 0.68, 0.71, 0.69),
    }
    text = table(
        ["path", "count", "failed", "p50 s", "p90 s", "mean s", "mean − floor s"], first_chunk_rows(spreads, floor)
    )
    lines = text.splitlines()
    assert lines[0] == "| path | count | failed | p50 s | p90 s | mean s | mean − floor s |"
    assert lines[1] == "|---|---|---|---|---|---|---|"
    assert lines[2].startswith("| cluster: nginx → instance")
    assert lines[2].endswith("| 12 | 0 | 0.750 | 0.800 | 0.760 | 0.070 |")
    assert lines[3].endswith("| 11 | 1 | 1.600 | 1.900 | 1.500 | 0.810 |")
    assert lines[4].startswith("| the floor, measured apart: upstream's modules alone") and lines[4].endswith(
        "| 0.000 |"
    )
    assert lines[5] == "| compute floor, the instance's own timer (llm + audio) | 12 | 0 | – | – | 0.700 | 0.010 |"
    # without the floor measured apart, the instance's timer is the reference
    assert first_chunk_rows({"cluster": Spread(12, 0, 0.75, 0.8, 0.76)}, floor)[0][-1] == pytest.approx(0.06)


def test_a_throughput_row_is_audio_seconds_per_wall_second():
    row = Throughput(instances=2, each=2, ok=30, failed=1, seconds=20.0, audio=90.0, cpu=36.0).row()
    assert row == ["2 × 2", 4, 30, 1, 20.0, 90.0, 4.5, 1.8, 0.4]  # 1.8 cores busy, 0.4 CPU s per audio s
    assert table(["a", "b"], [[math.nan, 2]]).splitlines()[-1] == "| – | 2 |"
