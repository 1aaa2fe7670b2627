"""Long-form jobs on a real cluster: supervisord, nginx, two instances of the simulated engine,
the jobs process (its API on a unix socket behind nginx, its runner sending the segments back
through nginx), over each store: SQLite in the state dir (with an API token: the runner's own
token passes the instances' gate) and a real redis-server on loopback (no credentials), whose
cluster keeps the jobs' audio outside its state dir (--job-results), as pods sharing it do.

For each: a job of a few thousand characters is posted, polled and fetched (a WAV of the
text's length, Range too); an instance SIGKILLed mid-job (the job still succeeds); the cluster
taken down and brought up mid-job (it resumes: the segments made before are not sent again,
counted in nginx's access log, which survives down/up).
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import requests
import soundfile
from conftest import clean_env, cli, free_port_block, wait_for
from redis_support import RedisServer

pytestmark = pytest.mark.integration

SENTENCE = "Sentence {i} of the long chapter is read aloud, and the next one follows it without a pause. "
TEXT = "".join(SENTENCE.format(i=i) for i in range(60))  # ~5,600 characters: about thirty segments
SECONDS_PER_CHAR = 0.04  # the simulated engine's audio per character
TOKEN = "jobs-cluster-token-0123456789abcdef"
PASSWORD = "redis-secret-0123456789"
SLOTS = 2
POLL_SECONDS = 180


def up(state_dir: Path, port: int, base: int, env: dict[str, str], token_file: Path | None) -> None:
    args = ["up", "--engine", "simulated", "--simulated-ms-per-char", "2", "--simulated-base-ms", "50"]
    args += ["--instances", "2", "--port", str(port), "--base-port", str(base), "--state-dir", str(state_dir)]
    args += ["--job-slots", str(SLOTS), "--segment-chars", "200"]
    args += ["--api-token-file", str(token_file)] if token_file else []
    done = cli(*args, env=env, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def cluster(request, tmp_path_factory):
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(2)
    redis = RedisServer(tmp_path_factory.mktemp("redis")) if request.param == "redis" else None
    redis_url = ""
    if redis:  # (a password: the URL is a secret then, kept off command lines and logs)
        import redis as client

        client.Redis(host="127.0.0.1", port=redis.port).config_set("requirepass", PASSWORD)
        redis_url = f"redis://:{PASSWORD}@127.0.0.1:{redis.port}/0"
    results = tmp_path_factory.mktemp("shared-results") if redis else state_dir / "jobs" / "results"
    env = clean_env(
        **({"COSYVOICE_LB_JOBS_REDIS": redis_url, "COSYVOICE_LB_JOB_RESULTS": str(results)} if redis else {})
    )
    token_file = None
    if request.param == "sqlite":
        token_file = tmp_path_factory.mktemp("tokens") / "tokens"
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)
    http = requests.Session()
    http.trust_env = False
    if token_file:
        http.headers["Authorization"] = f"Bearer {TOKEN}"
    info = {
        "backend": request.param,
        "state_dir": state_dir,
        "url": f"http://127.0.0.1:{port}",
        "base": base,
        "http": http,
        "redis": redis_url,
        "results": results,
        "start": lambda: up(state_dir, port, base, env, token_file),
    }
    try:
        info["start"]()
        yield info
    finally:
        cli("down", "--state-dir", str(state_dir), timeout=120)
        if redis:
            redis.stop()
        shutil.rmtree(state_dir, ignore_errors=True)


def post_job(cluster: dict, text: str = TEXT) -> dict:
    answer = cluster["http"].post(cluster["url"] + "/v1/audio/jobs", json={"input": text, "response_format": "wav"})
    assert answer.status_code == 202, answer.text
    return answer.json()


def job_of(cluster: dict, job_id: str) -> dict:
    answer = cluster["http"].get(f"{cluster['url']}/v1/audio/jobs/{job_id}", timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()


def finished(cluster: dict, job_id: str) -> dict:
    job = wait_for(lambda: (j := job_of(cluster, job_id))["status"] not in ("queued", "running") and j, POLL_SECONDS)
    assert job, f"job {job_id} still not finished after {POLL_SECONDS}s: {job_of(cluster, job_id)}"
    assert job["status"] == "succeeded", job
    return job


def progressed(cluster: dict, job_id: str, done: int) -> dict:
    job = wait_for(lambda: (j := job_of(cluster, job_id))["progress"]["done"] >= done and j, 60, interval=0.1)
    assert job, job_of(cluster, job_id)
    assert job["status"] == "running", job
    return job


def check_audio(cluster: dict, job: dict, text: str = TEXT) -> bytes:
    content = cluster["http"].get(f"{cluster['url']}/v1/audio/jobs/{job['id']}/content", timeout=30)
    assert content.status_code == 200 and content.headers["content-type"] == "audio/wav"
    assert len(content.content) == job["bytes"]
    info = soundfile.info(io.BytesIO(content.content))
    spoken = len(text) * SECONDS_PER_CHAR  # (the crossfades take a little of it back)
    assert 0.85 * spoken <= info.duration <= 1.05 * spoken, (info.duration, spoken)
    return content.content


def speech_posts(cluster: dict) -> int:
    """The segments nginx answered with audio so far (its access log survives down/up)."""
    log = cluster["state_dir"] / "logs" / "nginx-access.log"
    return sum(1 for line in log.read_text().splitlines() if '"POST /v1/audio/speech ' in line and '" 200 ' in line)


def jobs_processes(cluster: dict) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"] or []
        if "cosyvoice_lb.jobs" in argv and str(cluster["state_dir"]) in argv:
            found.append(process)
    return found


def test_a_long_job_through_nginx_succeeds_with_its_whole_audio(cluster):
    before = speech_posts(cluster)
    job = post_job(cluster)
    assert job["status"] == "queued" and job["progress"]["total"] >= len(TEXT) // 200
    done = finished(cluster, job["id"])
    assert done["progress"] == {"done": job["progress"]["total"], "total": job["progress"]["total"]}
    data = check_audio(cluster, done)
    assert (cluster["results"] / job["id"] / "audio.wav").read_bytes() == data  # (--job-results with redis)
    assert speech_posts(cluster) - before == job["progress"]["total"]  # each segment once
    ranged = cluster["http"].get(
        f"{cluster['url']}/v1/audio/jobs/{job['id']}/content", headers={"Range": "bytes=0-43"}, timeout=30
    )
    assert ranged.status_code == 206 and ranged.content == data[:44] and ranged.content.startswith(b"RIFF")
    listed = cluster["http"].get(cluster["url"] + "/v1/audio/jobs?limit=5").json()
    assert job["id"] in [j["id"] for j in listed["data"]]


def test_the_gate_and_the_secret_stay_where_they_belong(cluster):
    (process,) = jobs_processes(cluster)
    log = (cluster["state_dir"] / "logs" / "jobs.log").read_text()
    if cluster["redis"]:
        assert process.environ().get("COSYVOICE_LB_JOBS_REDIS") == cluster["redis"]
        shown = cli("status", "--state-dir", str(cluster["state_dir"]), "--json").stdout
        for where in (" ".join(process.cmdline()), log, shown):
            assert PASSWORD not in where
        holding = [p for p in cluster["state_dir"].rglob("*") if p.is_file() and PASSWORD.encode() in p.read_bytes()]
        assert holding, "the record keeps the URL: a re-render (a roll-out, restart) must keep the same store"
        for path in holding:  # (in the private run dir, and readable by the owner only)
            assert path.parent == cluster["state_dir"] / "run" and path.stat().st_mode & 0o777 == 0o600, path
    else:
        anonymous = requests.post(cluster["url"] + "/v1/audio/jobs", json={"input": "Hello there."}, timeout=10)
        assert anonymous.status_code == 401 and anonymous.json()["error"]["status"] == 401
        runner_token = cluster["state_dir"] / "run" / "jobs-token"
        assert runner_token.stat().st_mode & 0o777 == 0o600 and TOKEN not in log


def test_an_instance_killed_mid_job_does_not_fail_it(cluster):
    job = post_job(cluster)
    progressed(cluster, job["id"], 3)
    pid = requests.get(f"http://127.0.0.1:{cluster['base']}/ping", timeout=10).json()["pid"]
    os.kill(pid, signal.SIGKILL)
    check_audio(cluster, finished(cluster, job["id"]))


def test_down_then_up_mid_job_resumes_without_making_its_segments_again(cluster):
    before = speech_posts(cluster)
    job = post_job(cluster)
    total = job["progress"]["total"]
    made = progressed(cluster, job["id"], total // 3)["progress"]["done"]
    done = cli("down", "--state-dir", str(cluster["state_dir"]), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert jobs_processes(cluster) == []
    time.sleep(0.5)
    cluster["start"]()
    resumed = finished(cluster, job["id"])
    check_audio(cluster, resumed)
    sent = speech_posts(cluster) - before
    # every segment once, but those in flight at the down (answered, not yet recorded) again
    assert total <= sent <= total + SLOTS, (sent, total, made)
