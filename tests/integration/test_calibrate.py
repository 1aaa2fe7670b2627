"""`cosyvoice-lb calibrate` on a box without a GPU, for real: a one-instance cluster of its own
(espeak) runs 1, 2 and 4 syntheses at once, the knee becomes what --instance-concurrency auto
stands for in `plan`, and the instance's host memory is measured; nothing is left running."""

from __future__ import annotations

import json

import psutil
import pytest
from conftest import cli, free_port_block, port_free

pytestmark = pytest.mark.integration


def ports_with_room() -> tuple[int, int]:
    """A public port and a base port whose +1000 (the trial cluster's) are free too."""
    for _ in range(50):
        port, base = free_port_block(1), free_port_block(1)
        if max(port, base) + 1000 < 65536 and port_free(port + 1000) and port_free(base + 1000):
            return port, base
    raise AssertionError("no free ports with room above them")


def test_calibrate_measures_the_knee_here_and_plan_takes_it(state_dir):
    port, base = ports_with_room()
    where = ["--state-dir", str(state_dir), "--port", str(port), "--base-port", str(base), "--host", "127.0.0.1"]
    done = cli("calibrate", "--engine", "espeak", "--up-to", "4", "--rounds", "2", *where, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    entry = json.loads((state_dir / "run" / "footprint.json").read_text())["espeak"]
    assert entry["device"] == "cpu" and set(entry["throughput"]) == {"1", "2", "4"}
    assert all(rate > 0 for rate in entry["throughput"].values())
    assert entry["knee"] in (1, 2, 4) and entry["host_peak_bytes"] > 50 * 2**20
    assert f"--instance-concurrency auto = {entry['knee']} from now on" in done.stdout
    planned = cli("plan", "--engine", "espeak", "--json", "--state-dir", str(state_dir))
    assert planned.returncode == 0, planned.stderr
    report = json.loads(planned.stdout)
    assert report["concurrency"]["cpu"].startswith(
        f"--instance-concurrency auto = {entry['knee']} measured by calibrate"
    )
    assert {slot["concurrency"] for slot in report["slots"]} == {entry["knee"]}
    assert report["footprint_source"].startswith("calibrated") and report["footprint_source"].endswith("on this CPU")
    trial = str(state_dir / "calibrate")
    assert not [p for p in psutil.process_iter(["cmdline"]) if trial in " ".join(p.info["cmdline"] or [])]
