"""Long-form jobs meeting faults on a real cluster, over each store (SQLite; a real
redis-server on loopback): supervisord, nginx, three instances of the simulated engine with
its faults on, the jobs process.

- A poison segment (a sentence that kills whichever instance runs it) fails its job with the
  reason, after at most the instances' one retry; the runner, the other jobs and the cluster
  go on (a job beside it succeeds, the jobs process is never restarted).
- A full results disk (a small tmpfs mounted where the results go; mounting needs root, else
  the test is skipped) fails the job with "the disk is full", its content answers 507 with
  the reason and no result file reads as done; once the failed job is removed, the next one
  fits and succeeds.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest
import requests
from conftest import clean_env, cli, free_port_block, status, wait_for
from redis_support import RedisServer

pytestmark = pytest.mark.integration

INSTANCES = 3
SENTENCE = "Sentence {i} of the chapter is read aloud, and then the next one follows. "
TEXT = "".join(SENTENCE.format(i=i) for i in range(12))  # ~900 characters: five segments
POISON = "Now say CRASH-NOW please, and the instance that reads it dies. "
DISK = "16m"  # the results' tmpfs: short jobs fit, an 11,000-character one (~21 MB of WAV) does not
POLL_SECONDS = 180


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def cluster(request, tmp_path_factory):
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))  # short: supervisord's socket
    results = state_dir / "jobs" / "results"
    results.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(results)], capture_output=True)
    redis = RedisServer(tmp_path_factory.mktemp("redis")) if request.param == "redis" else None
    env = clean_env(**({"COSYVOICE_LB_JOBS_REDIS": f"redis://127.0.0.1:{redis.port}/0"} if redis else {}))
    port, base = free_port_block(1), free_port_block(INSTANCES)
    args = ["up", "--engine", "simulated", "--simulated-faults", "--simulated-ms-per-char", "1"]
    args += ["--simulated-base-ms", "20", "--instances", str(INSTANCES), "--retries", str(INSTANCES)]
    args += ["--hang-timeout", "2", "--probe-interval", "0.5", "--request-timeout", "60"]
    args += ["--job-slots", "2", "--segment-chars", "200"]
    args += ["--port", str(port), "--base-port", str(base), "--state-dir", str(state_dir)]
    http = requests.Session()
    http.trust_env = False
    try:
        done = cli(*args, env=env, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        yield {"url": f"http://127.0.0.1:{port}", "state_dir": state_dir, "http": http, "disk": not mounted.returncode}
    finally:
        cli("down", "--state-dir", str(state_dir), timeout=120)
        if not mounted.returncode:
            subprocess.run(["umount", "-l", str(results)], capture_output=True)
        if redis:
            redis.stop()
        shutil.rmtree(state_dir, ignore_errors=True)


def post_job(cluster: dict, text: str) -> dict:
    answer = cluster["http"].post(cluster["url"] + "/v1/audio/jobs", json={"input": text, "response_format": "wav"})
    assert answer.status_code == 202, answer.text
    return answer.json()


def finished(cluster: dict, job_id: str) -> dict:
    def done():
        job = cluster["http"].get(f"{cluster['url']}/v1/audio/jobs/{job_id}", timeout=10).json()
        return job["status"] not in ("queued", "running") and job

    job = wait_for(done, POLL_SECONDS, interval=0.2)
    assert job, f"job {job_id} did not finish in {POLL_SECONDS} s"
    return job


def programs(state_dir: Path) -> dict:
    code, body = status(state_dir)
    assert code == 0, body
    return body


def jobs_pid(state_dir: Path) -> int:
    (process,) = [
        p
        for p in psutil.process_iter(["cmdline"])
        if {"cosyvoice_lb.jobs", str(state_dir)} <= set(p.info["cmdline"] or [])
    ]
    return process.pid


def restarts(state_dir: Path) -> int:
    return sum(i["restarts"] for i in programs(state_dir)["instances"])


def all_serving(state_dir: Path) -> bool:
    code, body = status(state_dir)
    return code == 0 and all(i["ready"] and i["in_rotation"] for i in body["instances"])


def test_a_poison_segment_fails_its_job_and_nothing_else(cluster):
    state_dir = cluster["state_dir"]
    before, runner = restarts(state_dir), jobs_pid(state_dir)
    poisoned = post_job(cluster, TEXT + POISON + TEXT)
    beside = post_job(cluster, TEXT)
    failed = finished(cluster, poisoned["id"])
    assert failed["status"] == "failed", failed
    message = failed["error"]["message"]
    assert message.startswith('segment 7 of 13 (it begins "Now say CRASH-NOW'), failed  # which one, in its words
    assert "instances crashed or hung" in message and "change the text" in message, failed
    assert finished(cluster, beside["id"])["status"] == "succeeded"
    assert wait_for(lambda: all_serving(state_dir), 60), programs(state_dir)
    assert restarts(state_dir) - before <= 2  # one try and the instances' one retry, not one per job retry
    assert jobs_pid(state_dir) == runner  # the runner never died of it
    content = cluster["http"].get(f"{cluster['url']}/v1/audio/jobs/{poisoned['id']}/content", timeout=10)
    assert content.status_code == 409 and "failed" in content.json()["error"]["message"], content.text
    short = cluster["http"].post(cluster["url"] + "/v1/tts", json={"text": "Still speaking."}, timeout=60)
    assert short.status_code == 200 and short.content[:4] == b"RIFF"


def test_a_full_results_disk_fails_the_job_with_507_and_keeps_no_half_result(cluster):
    if not cluster["disk"]:
        pytest.skip("mounting a small tmpfs is not permitted here (needs root)")
    big = post_job(cluster, TEXT * 12)
    failed = finished(cluster, big["id"])
    assert failed["status"] == "failed", failed
    message = failed["error"]["message"]
    assert message.startswith("the disk is full"), failed
    content = cluster["http"].get(f"{cluster['url']}/v1/audio/jobs/{big['id']}/content", timeout=10)
    assert content.status_code == 507 and "the disk is full" in content.json()["error"]["message"], content.text
    folder = cluster["state_dir"] / "jobs" / "results" / big["id"]
    assert not [p.name for p in folder.glob("audio.*")], sorted(p.name for p in folder.iterdir())
    removed = cluster["http"].delete(f"{cluster['url']}/v1/audio/jobs/{big['id']}", timeout=10)
    assert removed.status_code == 200, removed.text
    again = post_job(cluster, TEXT[:400])
    done = finished(cluster, again["id"])
    assert done["status"] == "succeeded", done
    audio = cluster["http"].get(f"{cluster['url']}/v1/audio/jobs/{again['id']}/content", timeout=10)
    assert audio.status_code == 200 and audio.content[:4] == b"RIFF"
