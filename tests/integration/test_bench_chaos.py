"""bench/chaos.py stays runnable: one short scenario on a real two-instance cluster."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT, clean_env


def test_chaos_runs_a_scenario_and_prints_its_table_and_summary():
    done = subprocess.run([sys.executable, str(ROOT / "bench/chaos.py"), "--only", "kill-instance",
                           "--instances", "2", "--clients", "2"], capture_output=True, text=True, timeout=400,
                          env=clean_env(), cwd=str(ROOT))
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(r"chaos: 1 scenarios, 0 failed requests of [1-9]\d*", lines[-1]), done.stdout + done.stderr
    row = next(line for line in lines if line.startswith("| kill-instance "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "0" and cells[6] != "not back"  # no failed request, and the instance came back
    assert done.returncode == 0, done.stdout + done.stderr
    assert "down: stopped" in done.stderr  # it took its cluster down
