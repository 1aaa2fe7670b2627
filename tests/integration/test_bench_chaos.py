"""bench/chaos.py stays runnable, and faults never cost ordinary traffic: a short run on a
real two-instance cluster whose clients all send one common sentence."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT, clean_env


def test_two_unrelated_deaths_with_the_common_text_in_flight_fail_no_request():
    """A SIGKILLed instance, then a SIGSTOPped one the health loop kills: each death has the
    common text in flight, and no client's request of it is refused or lost."""
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench/chaos.py"),
            "--traffic",
            "common",
            "--only",
            "kill-instance,stop-instance",
            "--instances",
            "2",
            "--clients",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(),
        cwd=str(ROOT),
    )
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(r"chaos: 2 scenarios, 0 failed requests of [1-9]\d*", lines[-1]), done.stdout + done.stderr
    for name in ("kill-instance", "stop-instance"):
        row = next(line for line in lines if line.startswith(f"| {name} "))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "common" and cells[3] == "0" and cells[7] != "not back", row
    assert done.returncode == 0, done.stdout + done.stderr
    assert "down: stopped" in done.stderr  # it took its cluster down
