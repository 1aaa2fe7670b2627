"""Long-form jobs in the cluster's observability, on a real cluster (supervisord, nginx, two
instances of the simulated engine, the jobs process): after a job ran through nginx, its
metrics are at GET /metrics on the jobs socket and in the cluster's /metrics (scrape token),
and `status --json` / `status` say the jobs from the jobs process's report."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import requests
from conftest import cli, simulated_cluster, wait_for
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

TEXT = "".join(f"Sentence {i} of the chapter is read aloud, and then the next one. " for i in range(15))
POLL_SECONDS = 120


@pytest.fixture(scope="module")
def cluster():
    args = ["--simulated-ms-per-char", "1", "--simulated-base-ms", "20", "--segment-chars", "200", "--job-slots", "2"]
    http = requests.Session()
    http.trust_env = False
    with simulated_cluster(*args) as cluster:
        yield {**cluster, "http": http}


def unix_get(path: Path, target: str) -> tuple[int, str]:
    """GET ``target`` on the unix socket ``path`` (HTTP/1.0: the answer ends with the connection)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(str(path))
        conn.sendall(f"GET {target} HTTP/1.0\r\nHost: jobs\r\n\r\n".encode())
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_finished_job_is_in_the_metrics_and_the_status(cluster):
    http, url = cluster["http"], cluster["url"]
    posted = http.post(url + "/v1/audio/jobs", json={"input": TEXT, "response_format": "wav"}, timeout=10)
    assert posted.status_code == 202, posted.text
    job_id, total = posted.json()["id"], posted.json()["progress"]["total"]
    assert total >= 4
    job = wait_for(
        lambda: (j := http.get(f"{url}/v1/audio/jobs/{job_id}", timeout=10).json())["status"] == "succeeded" and j,
        POLL_SECONDS,
    )
    assert job, http.get(f"{url}/v1/audio/jobs/{job_id}", timeout=10).json()

    status, text = unix_get(cluster["state_dir"] / "run" / "jobs.sock", "/metrics")
    assert status == 200
    own = samples(text)
    assert own[("cosyvoice_jobs", (("status", "succeeded"),))] == 1
    assert own[("cosyvoice_job_segments_done_total", ())] == total
    assert own[("cosyvoice_job_duration_seconds_count", (("status", "succeeded"),))] == 1

    scrape = {"Authorization": "Bearer " + (cluster["state_dir"] / "monitoring" / "scrape-token").read_text().strip()}
    deadline = time.monotonic() + 10  # (the report is rewritten every 2 s)
    while True:
        found = samples(http.get(url + "/metrics", headers=scrape, timeout=10).text)
        if found.get(("cosyvoice_jobs", (("status", "succeeded"),))) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert found[("cosyvoice_jobs", (("status", "succeeded"),))] == 1
    assert found[("cosyvoice_job_segments_done_total", ())] == total
    assert ("cosyvoice_lb_instance_up", (("name", "instance-0"),)) in found

    shown = json.loads(cli("status", "--state-dir", str(cluster["state_dir"]), "--json").stdout)
    jobs = shown["jobs"]
    assert jobs["state"] == "RUNNING" and jobs["queued"] == 0 and jobs["running"] == 0, jobs
    assert jobs["updated_seconds_ago"] < 10 and not [p for p in shown["problems"] if p.startswith("jobs")]
    words = cli("status", "--state-dir", str(cluster["state_dir"])).stdout
    assert "jobs: 0 queued, 0 running" in words
