"""bench/batching.py's pure parts: a row per path, mode and level from what a worker printed,
and the ratios the targets are about."""

from __future__ import annotations

import math
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import batching  # noqa: E402  (bench/batching.py)


def result(path: str, mode: str, level: int, tokens: float, audio: float, wall: float = 10.0, **extra) -> dict:
    return {"path": path, "mode": mode, "concurrency": level, "syntheses": level, "failed": [], "wall": wall,
            "audio": audio, "tokens": tokens, "first": [0.5, 0.7, 0.6][:level], "cpu": audio / 4, **extra}  # fmt: skip


def test_a_row_is_rates_per_wall_second_and_first_chunk_percentiles():
    (row,) = batching.rows_of("full", [result("vllm", "stream", 3, tokens=350.0, audio=14.0, wall=10.0)])
    assert row[:6] == ["full", "vllm", "stream", 3, 3, 0]
    assert row[6] == pytest.approx(35.0) and row[7] == pytest.approx(1.4)  # tokens and audio a second
    assert row[8] == pytest.approx(0.6) and row[9] == pytest.approx(0.68)  # p50, p90 of 0.5, 0.6, 0.7
    assert row[10] == pytest.approx(0.25)  # CPU s per audio s


def test_the_ratios_set_vllm_against_threads_and_batched_against_vllm():
    results = [
        result("threads", "whole", 8, tokens=57.0, audio=5.0),
        result("vllm", "whole", 8, tokens=351.0, audio=6.0),
        result("batched", "whole", 8, tokens=340.0, audio=9.0),
        result("batched", "whole", 8, tokens=1.0, audio=90.0, window=5.0),  # (another window: not the default's)
    ]
    (row,) = batching.ratios("full", results, 8)
    assert row[:3] == ["full", "whole", 8]
    assert row[3] == pytest.approx(351 / 57) and row[4] == pytest.approx(1.5)
    assert math.isnan(batching.ratios("full", results[:1], 8)[0][4])  # (a path not run: no ratio)
    assert [batching.label(r) for r in results] == ["threads", "vllm", "batched", "batched (5 ms)"]
