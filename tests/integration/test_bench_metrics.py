"""bench/metrics_overhead.py stays working: a tiny run prints its table."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT


def test_the_metrics_bench_prints_what_it_measured():
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "metrics_overhead.py"),
            "--syntheses",
            "50",
            "--requests",
            "5",
            "--scrapes",
            "5",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("$ python bench/metrics_overhead.py --syntheses 50")
    rows = {line.split("  ")[0]: line for line in done.stdout.splitlines()}
    assert re.search(r"µs .*µs .* \d\.\d{3} ", rows["synthesis (pipeline)"])
    assert re.search(r"µs .*µs .* \d\.\d{3} ", rows["API request (/v1/tts)"])
    assert re.search(r"µs .*\(\d+ bytes\)", rows["one scrape of /metrics"])
