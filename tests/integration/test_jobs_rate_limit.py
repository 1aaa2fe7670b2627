"""A long-form job under --rate-limit, on a real cluster (supervisord, nginx, two instances of
the simulated engine, the jobs process). The job's POST pays the client's rate once; its
segments, which the runner sends back through nginx far faster than the client's rate, carry
the cluster's segment key and are not limited again: none is answered 429, each is made once,
and the job succeeds. The limit itself still holds for a client's own burst."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import requests
from conftest import simulated_cluster

pytestmark = pytest.mark.integration

SENTENCE = "Sentence {i} of the chapter is read aloud, and the next one follows it. "
TEXT = "".join(SENTENCE.format(i=i) for i in range(40))  # ~2,900 characters: about thirty segments
RATE = "2r/s"
POLL_SECONDS = 120


@pytest.fixture(scope="module")
def cluster():
    args = ["--simulated-ms-per-char", "1", "--simulated-base-ms", "10", "--job-slots", "2"]
    args += ["--segment-chars", "100", "--rate-limit", RATE, "--rate-burst", "4"]
    with simulated_cluster(*args) as cluster:
        yield cluster


def speech_answers(cluster) -> list[str]:
    """The status nginx answered each POST /v1/audio/speech with, in order."""
    log = (cluster["state_dir"] / "logs" / "nginx-access.log").read_text().splitlines()
    return [line.split('" ', 1)[1].split()[0] for line in log if '"POST /v1/audio/speech ' in line]


def test_a_jobs_segments_are_not_limited_again(cluster):
    http = requests.Session()
    http.trust_env = False
    before = len(speech_answers(cluster))
    posted = http.post(cluster["url"] + "/v1/audio/jobs", json={"input": TEXT, "response_format": "wav"}, timeout=30)
    assert posted.status_code == 202, posted.text
    job, total = posted.json(), posted.json()["progress"]["total"]
    assert total >= 25, total
    deadline = time.monotonic() + POLL_SECONDS
    while job["status"] in ("queued", "running") and time.monotonic() < deadline:
        time.sleep(1.0)  # (under the client's rate: the polls are the client's own requests)
        answer = http.get(f"{cluster['url']}/v1/audio/jobs/{job['id']}", timeout=10)
        assert answer.status_code == 200, answer.text
        job = answer.json()
    assert job["status"] == "succeeded", job
    answers = speech_answers(cluster)[before:]
    assert answers.count("429") == 0, answers
    assert answers.count("200") == total, (answers, total)  # each segment once, at many per second


def test_the_clients_own_burst_is_still_limited(cluster):
    def speak(_: int) -> int:
        with requests.Session() as s:
            s.trust_env = False
            body = {"input": "Hello there.", "response_format": "wav"}
            return s.post(cluster["url"] + "/v1/audio/speech", json=body, timeout=60).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(speak, range(16)))
    assert 429 in codes and 200 in codes, codes
