"""No bad audio reaches a client, on a real cluster (supervisord, nginx, the health loop, three
instances of the simulated engine and a parked slot for surges): one instance is made to
return NaN, or silence, through its fault file (``--simulated-fault-dir``) while many clients
send the same common text; every answer is decoded and checked, none is bad, the instance
leaves the rotation and is restarted, and the others serve everything. A surge roll-out whose
replacement makes bad audio stops there, and the old instances keep serving."""

from __future__ import annotations

import io
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import soundfile
from conftest import cli, free_port_block, status, wait_for

from cosyvoice_lb.instance.audio.check import check_audio

INSTANCES = 3
TEXT = "Thank you for calling, how can I help you today?"  # what every client sends


@pytest.fixture(scope="module")
def cluster():
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    faults = state_dir / "faults"
    faults.mkdir()
    port, base = free_port_block(1), free_port_block(INSTANCES + 1)
    done = cli(
        "up",
        "--engine",
        "simulated",
        "--simulated-ms-per-char",
        "1",
        "--simulated-fault-dir",
        str(faults),
        "--instances",
        str(INSTANCES),
        "--surge",
        "1",
        "--no-ui",
        "--retries",
        str(INSTANCES),
        "--start-retries",
        "20",  # (a faulty instance is restarted until the test removes its fault)
        "--probe-interval",
        "0.5",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    yield {"state_dir": state_dir, "faults": faults, "base": base, "url": f"http://127.0.0.1:{port}"}
    cli("down", "--state-dir", str(state_dir), timeout=120)
    shutil.rmtree(state_dir, ignore_errors=True)


def health(state_dir: Path) -> dict:
    return json.loads((state_dir / "run" / "health.json").read_text())["instances"]


def serving(state_dir: Path, count: int = INSTANCES) -> bool:
    code, body = status(state_dir)
    return sum(1 for i in body["instances"] if i["ready"] and i["in_rotation"]) == count and not any(
        i["failed"] for i in body["instances"]
    )


class Clients:
    """Many clients sending the same text through nginx, each answer's WAV decoded and checked
    (bounded: at most ``limit`` requests or ``seconds``)."""

    def __init__(self, url: str, threads: int = 6, limit: int = 3000, seconds: float = 60):
        self.url, self.limit, self.deadline = url, limit, time.monotonic() + seconds
        self.ok, self.bad, self.failures, self.ports = 0, [], [], {}
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(threads)]

    def __enter__(self) -> Clients:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def run(self) -> None:
        with requests.Session() as session:
            session.trust_env = False
            while not self.stop.is_set() and time.monotonic() < self.deadline:
                with self.lock:
                    if self.ok + len(self.failures) + len(self.bad) >= self.limit:
                        return
                try:
                    r = session.post(self.url + "/v1/tts", json={"text": TEXT}, timeout=60)
                except requests.RequestException as exc:
                    with self.lock:
                        self.failures.append(repr(exc))
                    continue
                with self.lock:
                    if r.status_code != 200:
                        self.failures.append(f"{r.status_code} {r.text[:200]}")
                        continue
                    fault = judge(r.content)
                    if fault:
                        self.bad.append(f"{r.headers.get('X-Instance-Port')}: {fault}")
                    else:
                        self.ok += 1
                        port = r.headers.get("X-Instance-Port", "")
                        self.ports[port] = self.ports.get(port, 0) + 1


def judge(wav: bytes) -> str:
    """What is wrong with an answer's audio ("" when nothing): the instance's own check, and,
    since 16-bit PCM has no NaN (it is written as full scale), no sample at full scale either:
    the simulated engine's voice peaks at -20 dBFS."""
    audio, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    fault = check_audio(audio, TEXT, 1.0, rate)
    if fault is not None:
        return str(fault)
    peak = float(np.abs(audio).max())
    return f"peak {peak:.3f}: NaN or clipped samples" if peak > 0.5 else ""


@pytest.mark.parametrize("fault, victim", [("nan", 1), ("silence", 2)])
def test_an_instance_making_bad_audio_leaves_the_rotation_and_no_client_hears_it(cluster, fault, victim):
    state_dir, faults = cluster["state_dir"], cluster["faults"]
    name, port = f"instance-{victim}", cluster["base"] + victim
    assert wait_for(lambda: serving(state_dir), 60)
    before = health(state_dir)[name].get("ordered", {}).get("bad_audio", 0)
    log = state_dir / "logs" / f"{name}.log"
    logged = log.stat().st_size
    with Clients(cluster["url"]) as clients:
        time.sleep(1)  # traffic on every instance first
        (faults / str(port)).write_text(fault)
        restarted = wait_for(
            lambda: health(state_dir)[name].get("ordered", {}).get("bad_audio", 0) > before, 30, interval=0.1
        )
        # out of rotation and restarted: the health loop's record says why
        assert restarted, health(state_dir)[name]
        track = health(state_dir)[name]
        assert "made bad audio" in track["reason"] and track["bad_audio"]
        code, body = status(state_dir)
        seen = next(i for i in body["instances"] if i["name"] == name)
        assert seen["bad_audio_restarts"] >= 1 and seen["audio_fault"]
        (faults / str(port)).unlink()  # mended: its next start is sound and it comes back
        assert wait_for(lambda: serving(state_dir), 60), status(state_dir)[1]["problems"]
        time.sleep(1)  # and serves again
    assert clients.bad == [], clients.bad[:5]  # not one answer with bad audio reached a client
    assert clients.failures == [], clients.failures[:5]  # and nginx's retries answered every request
    assert clients.ok > 50 and len(clients.ports) == INSTANCES
    said = log.read_text()[logged:]
    assert "made bad audio" in said  # (its requests' answers refused, or its canary's)
    assert {"nan": "NaN or infinite", "silence": "of silence"}[fault] in said + track["bad_audio"]


def test_a_surge_roll_out_whose_replacement_makes_bad_audio_stops_and_the_old_ones_serve(cluster):
    state_dir, faults, base = cluster["state_dir"], cluster["faults"], cluster["base"]
    assert wait_for(lambda: serving(state_dir), 60)
    parked = f"instance-{INSTANCES}"
    before = {i["name"]: i["pid"] for i in status(state_dir)[1]["instances"] if i["pid"]}
    assert parked not in before
    (faults / str(base + INSTANCES)).write_text("nan")  # the replacement's model is broken
    try:
        with Clients(cluster["url"], threads=4) as clients:
            started = time.monotonic()
            done = cli("restart", "--all", "--surge", "1", "--state-dir", str(state_dir), timeout=300)
            took = time.monotonic() - started
        assert done.returncode != 0, done.stdout
        said = done.stdout + done.stderr
        assert "surge roll-out stopped, 0 of 3 replaced (none)" in said, said
        assert f"{parked} failed: it made bad audio (the warm-up synthesis made bad audio: " in said, said
        assert took < 60  # at its first bad warm-up, not after --start-retries 20 or --startup-timeout
        assert clients.bad == [] and clients.failures == [], (clients.bad + clients.failures)[:5]
        assert clients.ok > 0
        code, body = status(state_dir)
        now = {i["name"]: i for i in body["instances"]}
        assert all(now[n]["pid"] == pid and now[n]["in_rotation"] for n, pid in before.items())  # untouched
        assert wait_for(lambda: status(state_dir)[1]["instances"][INSTANCES]["state"] != "RUNNING", 30)
    finally:
        (faults / str(base + INSTANCES)).unlink(missing_ok=True)
