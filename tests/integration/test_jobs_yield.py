"""Jobs that yield, on a real cluster: supervisord, nginx, three instances of the simulated
engine and the jobs process at the default --job-slots (auto). While no interactive request
comes a job takes every instance; the moment a client's requests come, its segments out fall
to one (read from the jobs process's own /metrics on its socket), so two instances are free
for them; when the client stops, the job takes every instance again, and it still succeeds
with every segment made exactly once (nginx's access log).
"""

from __future__ import annotations

import http.client
import re
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import pytest
import requests
from conftest import clean_env, cli, free_port_block, wait_for

pytestmark = pytest.mark.integration

SENTENCE = "Sentence {i} of the long chapter is read aloud, and the next one follows it without a pause. "
TEXT = "".join(SENTENCE.format(i=i) for i in range(200))  # ~19,000 characters: about ninety segments
INSTANCES = 3


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=10)
        self.socket_path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.socket_path)


def jobs_metrics(state_dir: Path) -> dict[str, float]:
    """The jobs process's own metrics (GET /metrics on run/jobs.sock), by name."""
    connection = UnixHTTPConnection(state_dir / "run" / "jobs.sock")
    try:
        connection.request("GET", "/metrics")
        body = connection.getresponse().read().decode()
    finally:
        connection.close()
    found = {}
    for line in body.splitlines():
        match = re.match(r"^(cosyvoice_job_[a-z_]+) ([0-9.e+-]+)$", line)
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


@pytest.fixture(scope="module")
def cluster():
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(INSTANCES)
    args = ["up", "--engine", "simulated", "--simulated-ms-per-char", "2", "--simulated-base-ms", "50"]
    args += ["--instances", str(INSTANCES), "--port", str(port), "--base-port", str(base)]
    args += ["--state-dir", str(state_dir), "--segment-chars", "200"]  # (--job-slots: the default, auto)
    http_session = requests.Session()
    http_session.trust_env = False
    try:
        done = cli(*args, env=clean_env(), timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        yield {"state_dir": state_dir, "url": f"http://127.0.0.1:{port}", "http": http_session}
    finally:
        cli("down", "--state-dir", str(state_dir), timeout=120)
        shutil.rmtree(state_dir, ignore_errors=True)


def speech_posts(state_dir: Path) -> list[str]:
    """The segments' requests nginx answered with audio (the client's go to /v1/tts)."""
    log = (state_dir / "logs" / "nginx-access.log").read_text()
    return [line for line in log.splitlines() if '"POST /v1/audio/speech ' in line and '" 200 ' in line]


def job_of(cluster: dict, job_id: str) -> dict:
    answer = cluster["http"].get(f"{cluster['url']}/v1/audio/jobs/{job_id}", timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()


class Client:
    """One interactive client: short requests one after another until stopped."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.statuses: list[int] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with requests.Session() as session:
            session.trust_env = False
            while not self.stop.is_set():
                answer = session.post(self.url + "/v1/tts", json={"text": "Your order has shipped."}, timeout=60)
                self.statuses.append(answer.status_code)

    def __enter__(self) -> Client:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        self.thread.join(60)


def test_a_job_takes_every_instance_while_quiet_and_yields_the_moment_requests_come(cluster):
    state_dir = cluster["state_dir"]
    before = len(speech_posts(state_dir))
    answer = cluster["http"].post(cluster["url"] + "/v1/audio/jobs", json={"input": TEXT, "response_format": "wav"})
    assert answer.status_code == 202, answer.text
    job = answer.json()
    total = job["progress"]["total"]

    def out(wanted_slots: int, most: int):
        return lambda: (
            (m := jobs_metrics(state_dir))
            and (
                m.get("cosyvoice_job_segment_slots") == wanted_slots
                and m.get("cosyvoice_job_segments_in_flight", 99) <= most
            )
        )

    # quiet: every instance's slot, and all of them used
    assert wait_for(lambda: jobs_metrics(state_dir).get("cosyvoice_job_segments_in_flight") == INSTANCES, 60, 0.05), (
        jobs_metrics(state_dir)
    )
    with Client(cluster["url"]) as client:
        # requests come: the job's share falls to one and its segments out drain down to it
        assert wait_for(out(1, 1), 30, 0.05), jobs_metrics(state_dir)
        seen = [jobs_metrics(state_dir) for _ in range(10)]  # (and stays there while they come)
        assert all(m["cosyvoice_job_segment_slots"] == 1 and m["cosyvoice_job_segments_in_flight"] <= 1 for m in seen)
        assert job_of(cluster, job["id"])["status"] == "running"
        assert jobs_metrics(state_dir)["cosyvoice_job_yields_total"] >= 1
    assert client.statuses and set(client.statuses) == {200}, client.statuses
    # quiet again: the job takes every instance back
    assert wait_for(out(INSTANCES, INSTANCES), 30, 0.05), jobs_metrics(state_dir)
    done = wait_for(lambda: (j := job_of(cluster, job["id"]))["status"] not in ("queued", "running") and j, 180)
    assert done and done["status"] == "succeeded", job_of(cluster, job["id"])
    assert done["progress"] == {"done": total, "total": total}
    assert len(speech_posts(state_dir)) - before == total  # every segment exactly once
