"""bench/run.py's routing table: pooled percentiles, the ratio to round-robin on the same
arrivals, each run's ratio (the spread), declines per request; and the summary line."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import run  # noqa: E402
from cosyvoice_lb.common.settings import Settings  # noqa: E402
from load import Result  # noqa: E402  (bench/load.py)


def results(latencies_ms, failed: int = 0) -> list[Result]:
    answered = [Result(0.0, ms / 1000, 200, "short") for ms in latencies_ms]
    return answered + [Result(0.0, 1.0, 503, "short")] * failed


def point(setup: str, runs: list[list[float]], declined: int = 0, load_pct: int = 70, mix: str = "80/20"):
    p = run.Point(mix, load_pct, setup, 25.0, [])
    for i, latencies in enumerate(runs):
        p.add(results(latencies), declined if i == 0 else 0)
    return p


def test_rows_pool_the_runs_and_compare_each_with_round_robins_same_run():
    work = point("work", [[100.0] * 99 + [400.0], [100.0] * 99 + [600.0]], declined=50)
    rr = point("round-robin", [[100.0] * 99 + [800.0], [100.0] * 99 + [1000.0]])
    rows = {r["setup"]: r for r in run.routing_rows([work, rr])}
    row = rows["work"]
    assert row["requests"] == 200 and row["failed"] == 0 and row["hops_per_request"] == 0.25
    pooled = np.percentile([100.0] * 198 + [400.0, 600.0], 99)
    assert row["p99_ms"] == pytest.approx(pooled)
    assert row["p99_runs_ms"] == " / ".join(f"{np.percentile([100.0] * 99 + [v], 99):.0f}" for v in (400, 600))
    per_run = [
        np.percentile([100.0] * 99 + [a], 99) / np.percentile([100.0] * 99 + [b], 99)
        for a, b in ((400, 800), (600, 1000))
    ]
    assert (row["ratio_min"], row["ratio_max"]) == pytest.approx((min(per_run), max(per_run)))
    assert row["ratio_rr"] == pytest.approx(pooled / np.percentile([100.0] * 198 + [800.0, 1000.0], 99))
    assert rows["round-robin"]["ratio_rr"] == pytest.approx(1.0)
    assert row["beyond_p99"] == 2  # the two slow ones at or above the pooled p99


def test_failed_requests_are_counted_and_left_out_of_the_latencies():
    p = run.Point("uniform", 50, "work", 10.0, [])
    p.add(results([50.0, 60.0], failed=3))
    (row,) = run.routing_rows([p])
    assert (row["requests"], row["failed"]) == (5, 3)
    assert row["p50_ms"] == pytest.approx(55.0)
    assert math.isnan(row["ratio_rr"]) and row["ratio_runs"] == ""  # no round-robin to compare with


def test_the_summary_reports_the_default_routing_with_its_spread():
    rows = run.routing_rows(
        [
            point("work", [[100.0] * 99 + [450.0], [100.0] * 99 + [500.0]]),
            point("least_conn", [[100.0] * 99 + [600.0], [100.0] * 99 + [700.0]]),
            point("round-robin", [[100.0] * 99 + [1000.0], [100.0] * 99 + [1000.0]]),
            point("work", [[1.0] * 100], mix="uniform"),
        ]
    )
    report = run.Report(
        overhead=[{"p50_ms": 1.0, "p99_ms": 2.0, "throughput_rps": 10.0}] * 2,
        scale=[{"instances": 4, "efficiency_pct": 99.0}],
        routing=rows,
        startup=[],
    )
    line = run.summary_lines(report)[2]
    work = next(r for r in rows if r["setup"] == "work" and r["mix"] == "80/20")
    assert line.startswith(f"routing: p99 ratio vs round-robin {work['ratio_rr']:.2f} at 70% load (runs ")
    assert run.SETUPS[0].replace("_", "-") == Settings().routing  # the cluster's default is the one reported
    assert "least_conn" in line
