"""Model roll-outs that compare first, on a real cluster (supervisord, nginx, the health loop)
of the flite engine, its speech heard by the real pocketsphinx, under a steady load of one
common text:

* a broken new model (the simulated engine: a quiet tone of the right length, which passes
  every audio check and says nothing) mirrored at 50%: shown worse on the speech check,
  ``promote`` refuses; clients get byte for byte what they got before, and the serving side
  synthesises each request once; ``abort`` leaves no process, file or nginx line behind;
* a good new model (flite's ``awb`` voice) given a 30% share: clients hear it, it passes,
  and ``promote`` moves every instance onto it with a surge roll-out while not one client
  request fails.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import requests
import soundfile
from conftest import Load, cli, free_port_block, status, wait_for

from cosyvoice_lb.instance.audio.check import check_audio

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not shutil.which("flite"), reason="flite is not installed"),
]
# (what pocketsphinx hears word for word from flite's slt, awb and rms alike: measured)
TEXT = "The weather is nice today. Please call me back tomorrow morning."
SPEECH = {"model": "tts-1", "input": TEXT, "voice": "alloy", "response_format": "wav"}


def send(url: str) -> requests.Response:
    return requests.post(url + "/v1/audio/speech", json=SPEECH, timeout=60)


def judged(response: requests.Response) -> str:
    """What is wrong with an answer's audio ("" when nothing)."""
    audio, rate = soundfile.read(io.BytesIO(response.content), dtype="float32")
    return str(check_audio(audio, TEXT, 1.0, rate) or "")


def served(ports: list[int]) -> int:
    """Speech requests the instances on ``ports`` answered, all outcomes (their /metrics)."""
    total = 0.0
    for port in ports:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        total += sum(float(v) for v in re.findall(r"^cosyvoice_requests_total\{[^}]*\} (\S+)$", text, re.M))
    return int(total)


def comparison(state_dir: Path) -> dict:
    done = cli("canary", "status", "--json", "--state-dir", str(state_dir), timeout=60)
    return json.loads(done.stdout)


def judged_enough(state_dir: Path, need: int):
    def enough() -> dict | None:
        found = comparison(state_dir)
        checked = min(found["serving"]["checked"], found["canary"]["checked"])
        sides = min(found["serving"]["judged"], found["canary"]["judged"])
        return found if sides >= need and (checked >= need or found["canary"]["ok"] == 0) else None

    return enough


def canary_processes(state_dir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = proc.info["cmdline"] or []
        if "--canary" in line and any(str(state_dir) in part for part in line):
            found.append(proc)
    return found


def shown_in_the_panel(state_dir: Path, url: str) -> None:
    """The panel shows the comparison and its verdict; its Promote button is refused, and says why."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    playwright = pytest.importorskip("playwright.sync_api")
    if chromium is None:
        pytest.skip("no chromium here")
    token = (state_dir / "admin-token").read_text().splitlines()[-1]
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1200})
            page.goto(url + "/admin", wait_until="networkidle", timeout=90000)
            page.get_by_label("Admin token").fill(token)
            page.get_by_role("button", name="Log in").click()
            page.wait_for_url("**/admin")
            page.locator("#canary-verdict").filter(has_text="verdict: fail").wait_for(timeout=20000)
            assert "instance-2" in page.locator("#canary-what").inner_text()
            rows = dict(
                (r[0], r[1:]) for r in (row.split("\t") for row in page.locator("#canary tbody tr").all_inner_texts())
            )
            assert float(rows["ASR error mean"][1]) > 0.8, rows
            assert page.locator("#canary-findings li.no").filter(has_text="speech check").count() == 1
            page.on("dialog", lambda dialog: dialog.accept())  # "Promote the canary?"
            page.locator("#canary-promote").click()
            page.locator("#canary-action").filter(has_text="promote: failed").wait_for(timeout=60000)
            assert "not promoted" in page.locator("#canary-action").inner_text()
        finally:
            browser.close()


@pytest.fixture
def cluster():
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(3)
    up = [
        "up", "--engine", "flite", "--instances", "2", "--surge", "1", "--no-ui", "--probe-interval", "0.5",
        "--host", "127.0.0.1", "--port", str(port), "--base-port", str(base), "--state-dir", str(state_dir),
    ]  # fmt: skip
    done = cli(*up, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    try:
        yield state_dir, f"http://127.0.0.1:{port}", base, up
    finally:
        cli("down", "--state-dir", str(state_dir), timeout=120)
        shutil.rmtree(state_dir, ignore_errors=True)


def test_a_broken_model_is_shown_worse_refused_and_aborted_without_a_trace(cluster):
    state_dir, url, base, up = cluster
    common = ["--state-dir", str(state_dir)]
    reference = send(url)
    assert reference.status_code == 200, reference.text
    digest = hashlib.sha256(reference.content).hexdigest()  # flite is deterministic: one answer

    def same_as_before(response: requests.Response) -> str:
        return "" if hashlib.sha256(response.content).hexdigest() == digest else "another answer than before"

    done = cli("canary", "start", "--engine", "simulated", "--mirror", "50", "--min-requests", "8", *common)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "canary ready: instance-2" in done.stdout
    code, body = status(state_dir)
    assert code == 0, body["problems"]  # (a canary out of the serving rotation is no problem)
    assert body["canary"]["slots"] == ["instance-2"]
    assert [i["name"] for i in body["instances"] if i["canary"]] == ["instance-2"]
    assert "canary in progress" in cli("status", *common).stdout
    refused = cli("restart", "instance-2", *common)
    assert refused.returncode != 0 and "canary abort" in refused.stderr
    canary_pid = [p.pid for p in canary_processes(state_dir)]
    again = cli(*up, timeout=180)  # the same settings again: the canary stays as it was
    assert again.returncode == 0, again.stdout + again.stderr
    assert [p.pid for p in canary_processes(state_dir)] == canary_pid and len(canary_pid) == 1
    assert "mirror /_cvlb/canary" in (state_dir / "nginx" / "nginx.conf").read_text()
    before = served([base, base + 1])
    with Load(url, threads=3, limit=400, seconds=120, send=send, judge=same_as_before) as clients:
        found = wait_for(judged_enough(state_dir, 8), 100, interval=2)
    assert found, comparison(state_dir)
    sent = clients.ok + len(clients.failures) + len(clients.bad)
    assert clients.bad == [] and clients.failures == [], (clients.bad[:3], clients.failures[:3])
    # Each client request synthesised once on the serving side: the copies went to the canary only.
    assert served([base, base + 1]) - before == sent
    assert found["canary"]["requests"] > 0 and found["canary"]["requests"] < sent

    assert found["verdict"] == "fail", found
    failed = {f["name"]: f["said"] for f in found["findings"] if not f["passed"]}
    assert "speech check" in failed, found["findings"]
    assert found["canary"]["error_mean"] > 0.8 and found["serving"]["error_mean"] < 0.4, found
    text = cli("canary", "status", *common).stdout
    assert "ASR error mean" in text and "verdict: fail" in text

    shown_in_the_panel(state_dir, url)
    refused = cli("canary", "promote", *common, timeout=120)
    assert refused.returncode != 0 and "not promoted" in refused.stderr and "speech check" in refused.stderr
    assert json.loads((state_dir / "run" / "cluster.json").read_text())["settings"]["engine"] == "flite"

    done = cli("canary", "abort", *common, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (state_dir / "run" / "canary.json").exists()
    assert "mirror" not in (state_dir / "nginx" / "nginx.conf").read_text()
    assert wait_for(lambda: "cvlb_canary" not in (state_dir / "nginx" / "upstreams.conf").read_text(), 20)
    assert not re.search(r"--canary(?![-\w])", (state_dir / "run" / "supervisord.conf").read_text())
    assert canary_processes(state_dir) == []
    code, body = status(state_dir)
    assert code == 0, body["problems"]
    parked = {i["name"]: i["parked"] for i in body["instances"]}
    assert parked == {"instance-0": False, "instance-1": False, "instance-2": True}
    assert not body["canary"]
    after = cli("canary", "status", *common)
    assert after.returncode != 0 and "no canary in progress" in after.stderr


def test_a_good_model_is_promoted_under_load_with_no_failed_request(cluster):
    state_dir, url, base, _ = cluster
    common = ["--state-dir", str(state_dir)]
    done = cli(
        "canary", "start", "--set", "openai_voices=alloy=awb", "--share", "30", "--min-requests", "8",
        # (latency is not what this test is about: one instance beside two on a shared 2-core
        # box, every compared answer transcribed too, is noise at these counts)
        "--max-latency-ratio", "100", *common,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    with Load(url, threads=3, limit=600, seconds=240, send=send, judge=judged) as clients:
        found = wait_for(judged_enough(state_dir, 8), 100, interval=2)
        assert found, comparison(state_dir)
        assert found["verdict"] == "pass", [f for f in found["findings"] if not f["passed"]]
        promoted = cli("canary", "promote", *common, timeout=240)
        time.sleep(1)  # (a little load on the promoted instances too)
    assert promoted.returncode == 0, promoted.stdout + promoted.stderr
    assert "promoted" in promoted.stdout and "surge" in promoted.stdout + promoted.stderr
    assert clients.failures == [] and clients.bad == [], (clients.failures[:3], clients.bad[:3])
    assert clients.ok > 20
    record = json.loads((state_dir / "run" / "cluster.json").read_text())
    assert record["settings"]["openai_voices"] == "alloy=awb"
    assert not (state_dir / "run" / "canary.json").exists() and canary_processes(state_dir) == []
    code, body = status(state_dir)
    assert code == 0 and body["pool"]["in_rotation"] == 2, body
    # every serving instance now speaks the promoted voice (awb says it in 3.8 s, slt in 4.4 s)
    for _ in range(4):
        answer = send(url)
        assert answer.status_code == 200, answer.text
        audio, rate = soundfile.read(io.BytesIO(answer.content), dtype="float32")
        assert abs(audio.size / rate - 3.805) < 0.1, audio.size / rate
