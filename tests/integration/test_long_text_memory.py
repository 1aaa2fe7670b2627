"""Long texts leave no memory behind: a real cluster of two espeak instances behind nginx
takes ten 20,000-character texts; each instance's RSS stays under the plan's per-instance
host footprint throughout and comes back to within 150 MiB of where it was after warm-up.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path

import psutil
import pytest
import requests
from conftest import cli, free_port_block, wait_for

from cosyvoice_lb.common.sizes import parse_size
from cosyvoice_lb.launcher.plan.footprint import ENGINE_FOOTPRINTS

pytestmark = pytest.mark.integration
MiB = 2**20
SETTLED = 150 * MiB  # what an instance may keep over its warmed-up RSS after the long texts
PLANNED = parse_size(ENGINE_FOOTPRINTS["espeak"]["host"])
SENTENCE = "Sentence {i} of the long text is spoken, joined and sent back; the next one follows it. "
LONG = "".join(SENTENCE.format(i=i) for i in range(400))[:20_000]


@pytest.fixture(scope="module")
def cluster():
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(2)
    done = cli(
        "up",
        "--instances",
        "2",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        "--request-timeout",
        "300",
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    session = requests.Session()
    session.trust_env = False
    pids = [session.get(f"http://127.0.0.1:{base + i}/ping", timeout=10).json()["pid"] for i in (0, 1)]
    yield {"url": f"http://127.0.0.1:{port}", "http": session, "processes": [psutil.Process(p) for p in pids]}
    cli("down", "--state-dir", str(state_dir), timeout=120)
    shutil.rmtree(state_dir, ignore_errors=True)


def test_long_texts_return_their_memory_and_stay_within_the_plan(cluster):
    http, url, processes = cluster["http"], cluster["url"], cluster["processes"]
    assert len(LONG) == 20_000
    # Warm-up: every code path a long text takes has run once (imports, first buffers).
    for text in ("Warm up.", LONG[:2_000]):
        assert http.post(url + "/v1/tts", json={"text": text}, timeout=300).status_code == 200
    baseline = [p.memory_info().rss for p in processes]
    peaks = list(baseline)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            for i, p in enumerate(processes):
                peaks[i] = max(peaks[i], p.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for _ in range(10):
            response = http.post(url + "/v1/tts", json={"text": LONG}, timeout=600)
            assert response.status_code == 200, response.text[:300]
            assert float(response.headers["X-Audio-Seconds"]) > 600  # the whole text was spoken
    finally:
        done.set()
        sampler.join()
    assert all(p.is_running() for p in processes)  # (the same processes: none was restarted)
    for i, p in enumerate(processes):
        assert peaks[i] <= PLANNED, f"instance-{i} peaked at {peaks[i] / MiB:.0f} MiB, planned {PLANNED / MiB:.0f}"
    # (the last text's pages go back once its coordinator has let go of them)
    settled = wait_for(lambda: all(p.memory_info().rss <= b + SETTLED for p, b in zip(processes, baseline)), 30)
    rss = [f"{p.memory_info().rss / MiB:.0f}" for p in processes]
    assert settled, f"RSS {rss} MiB after ten long texts, baseline {[f'{b / MiB:.0f}' for b in baseline]} MiB"
