"""bench/gpu.py --smoke end to end on upstream's own code: the small CosyVoice3 model, a real
cluster of 2 instances started with --no-ui, streamed syntheses through nginx, one table
with a row per measurement and a row per setup this box cannot run, and the cluster down
afterwards. (On a GPU box the same script runs the full-size model: bench/README.md.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, clean_env

pytestmark = [pytest.mark.integration, pytest.mark.upstream]


@pytest.fixture(scope="module")
def smoke(upstream, tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu-bench")
    table = work / "table.md"
    args = ["--smoke", "--cosyvoice-root", str(upstream.root), "--python", str(upstream.python)]
    args += ["--model-dir", str(upstream.model_dir), "--work", str(work), "--out", str(table)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=clean_env(),
        cwd=str(ROOT),
    )
    return done, table.read_text() if table.exists() else "", work


def rows(text: str) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def test_the_smoke_run_measures_every_row_it_can_and_says_why_not_the_others(smoke):
    done, table, _ = smoke
    assert done.returncode == 0, done.stderr[-3000:]
    assert table and table in done.stdout + "\n"  # (printed and written alike)
    measured = [r for r in rows(table) if not r[3].startswith("skipped")]
    assert [(r[0], r[1], r[2]) for r in measured] == [
        ("plain", "1", "1"),
        ("plain", "2", "1"),
        ("plain", "2", "2"),
        ("plain", "1", "2"),
    ]
    for setup, _, _, requests, rate, p50, p99, memory in measured:
        ok, sent = map(int, requests.split("/"))
        assert sent >= 1 and ok == sent  # every synthesis answered 200
        assert float(rate) > 0 and float(p50) > 0
        count = int(p99.split("(n=")[1].rstrip(")"))
        assert count == ok and float(p99.split()[0]) >= float(p50)
        assert memory == "—" or memory.lstrip("≈").isdigit()
    skipped = {r[0]: r[3] for r in rows(table) if r[3].startswith("skipped")}
    assert set(skipped) == {"fp16", "plain + MPS", "fp16 + MPS", "vllm", "vllm + batched flow/HiFT"}
    assert all(len(why) > len("skipped: ") for why in skipped.values())
    assert "`python bench/gpu.py --smoke" in table


def test_the_voice_was_saved_once_and_no_cluster_is_left(smoke):
    done, _, work = smoke
    saved = list((work / "voices").glob("*/voice.json"))
    assert len(saved) == 1 and '"name": "gpu-bench"' in saved[0].read_text()
    ups = done.stderr.count("cosyvoice-lb up ")
    assert ups == 1, done.stderr[-2000:]
    state_dirs = [
        line.split("--state-dir ")[1].split()[0] for line in done.stderr.splitlines() if "--state-dir" in line
    ]
    assert state_dirs and not any(Path(d).exists() for d in state_dirs)  # (down, then removed)
