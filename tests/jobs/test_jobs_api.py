"""The jobs API in process over a real SQLite store: what a POST answers and queues (and what
it refuses before queueing anything), owners, pages, DELETE, and a finished job's audio with
HTTP Range."""

from __future__ import annotations

import hashlib
import io
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile
from starlette.testclient import TestClient

from cosyvoice_lb.instance.access.auth import SESSION_COOKIE, SHARED_OWNER, Policy, PolicyFile, digest
from cosyvoice_lb.instance.speech.voices import Registry
from cosyvoice_lb.jobs import model
from cosyvoice_lb.jobs.service import Config, build_app
from cosyvoice_lb.jobs.store import SqliteStore

ANN, BOB = "ann-token-0123456789abcdef", "bob-token-0123456789abcdef"
AS_ANN, AS_BOB = {"Authorization": f"Bearer {ANN}"}, {"Authorization": f"Bearer {BOB}"}
TEXT = " ".join(f"Sentence number {i} of a long text, told slowly." for i in range(40))


@pytest.fixture
def store(tmp_path):
    store = SqliteStore(tmp_path / "jobs" / "jobs.sqlite3")
    yield store
    store.close()


def config(tmp_path, **extra) -> Config:
    return Config(state_dir=tmp_path, max_chars=extra.pop("max_chars", 5000), segment_chars=200, **extra)


@pytest.fixture
def open_client(tmp_path, store):
    """No policy: every caller is the one shared owner."""
    with TestClient(build_app(store, config(tmp_path)), raise_server_exceptions=True) as client:
        yield client


@pytest.fixture
def gated(tmp_path, store):
    """A policy of two tokens: two owners."""
    path = tmp_path / "access.json"
    path.write_text(Policy(frozenset({digest(ANN), digest(BOB)}), {}, b"s" * 32).to_json())
    app = build_app(store, config(tmp_path), PolicyFile(str(path)))
    with TestClient(app, raise_server_exceptions=True) as client:
        yield client


def everyone(store) -> list[model.Job]:
    return [job for owner in (SHARED_OWNER, "token:" + digest(ANN)[:16]) for job in store.list(owner, 100).data]


def test_a_post_answers_202_with_the_job_queued_and_its_segments_counted(open_client, store):
    answer = open_client.post("/v1/audio/jobs", json={"input": TEXT, "voice": "alloy", "response_format": "flac"})
    assert answer.status_code == 202, answer.text
    job = answer.json()
    assert job["object"] == "audio.job" and job["status"] == "queued" and model.is_job_id(job["id"])
    assert answer.headers["location"] == f"/v1/audio/jobs/{job['id']}"
    assert job["input_characters"] == len(TEXT) and job["response_format"] == "flac" and job["voice"] == "alloy"
    # the runner's splitter at --segment-chars 200: a text of ~2000 characters is ten or more
    assert job["progress"]["done"] == 0 and job["progress"]["total"] >= len(TEXT) // 200
    kept = store.get(job["id"], SHARED_OWNER)
    assert kept is not None and store.text(job["id"]) == TEXT
    # one seed for all the segments, chosen at the POST and kept with the job
    assert isinstance(kept.params["seed"], int) and kept.params["speed"] == 1.0
    assert open_client.get(f"/v1/audio/jobs/{job['id']}").json() == job


BAD_BODIES = [
    ({"input": "Hello <|endofprompt|> there."}, 400, "special tokens"),
    ({"input": "... !!! ???"}, 422, "no word"),
    ({"input": ""}, 400, "empty"),
    ({"voice": "alloy"}, 400, "missing"),
    ({"input": "Hello.", "speed": 9}, 400, "speed"),
    ({"input": "Hello.", "response_format": "ogg"}, 400, "response_format"),
    ({"input": "Hello.", "colour": "blue"}, 400, "unknown field"),
    ({"input": "Hello.", "stream_format": "sse"}, 400, "does not stream"),
    ({"input": "Hello.", "seed": -1}, 400, "seed"),
    ({"input": "Hello.", "voice": "no-such-saved-voice"}, 404, "no saved voice"),
    ({"input": "x" * 5001}, 413, "--max-job-chars 5000"),
]


@pytest.mark.parametrize("body,status,says", BAD_BODIES)
def test_a_bad_request_is_refused_before_anything_is_queued(open_client, store, body, status, says):
    answer = open_client.post("/v1/audio/jobs", json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert says in error["message"] and error["status"] == status
    assert answer.headers["x-should-retry"] == "false"
    assert everyone(store) == []


def test_a_body_that_is_not_a_json_object_is_refused(open_client, store):
    for raw, says in ((b"", "no body"), (b"{not json", "not valid JSON"), (b"[1, 2]", "a JSON object")):
        answer = open_client.post("/v1/audio/jobs", content=raw, headers={"content-type": "application/json"})
        assert answer.status_code == 400 and says in answer.json()["error"]["message"]
    assert everyone(store) == []


def test_a_saved_voice_of_the_cluster_is_taken(tmp_path, store):
    voice = Registry(tmp_path / "voices").create(
        "narrator", np.zeros(16000 * 4, np.float32) + 0.1, 16000, "the transcript", "yes"
    )
    with TestClient(build_app(store, config(tmp_path))) as client:
        for name in ("narrator", voice.id):
            assert client.post("/v1/audio/jobs", json={"input": TEXT, "voice": name}).status_code == 202


def test_each_token_sees_its_own_jobs_only(gated, store):
    assert gated.post("/v1/audio/jobs", json={"input": TEXT}).status_code == 401  # (the gate: no credentials)
    mine = gated.post("/v1/audio/jobs", json={"input": TEXT}, headers=AS_ANN).json()
    theirs = gated.post("/v1/audio/jobs", json={"input": TEXT}, headers=AS_BOB).json()
    assert store.get(mine["id"], "token:" + digest(ANN)[:16]) is not None
    assert gated.get(f"/v1/audio/jobs/{mine['id']}", headers=AS_ANN).status_code == 200
    for path in (f"/v1/audio/jobs/{mine['id']}", f"/v1/audio/jobs/{mine['id']}/content"):
        assert gated.get(path, headers=AS_BOB).status_code == 404
    assert gated.delete(f"/v1/audio/jobs/{mine['id']}", headers=AS_BOB).status_code == 404
    assert [j["id"] for j in gated.get("/v1/audio/jobs", headers=AS_ANN).json()["data"]] == [mine["id"]]
    assert [j["id"] for j in gated.get("/v1/audio/jobs", headers=AS_BOB).json()["data"]] == [theirs["id"]]
    assert gated.get(f"/v1/audio/jobs/{mine['id']}", headers=AS_ANN).json()["status"] == "queued"  # (untouched)


def test_the_list_comes_a_page_at_a_time_newest_first(tmp_path, store):
    clock = iter(range(1000, 2000)).__next__
    with TestClient(build_app(store, config(tmp_path), clock=lambda: float(clock()))) as client:
        made = [client.post("/v1/audio/jobs", json={"input": f"Job {i} says hello."}).json()["id"] for i in range(5)]
        first = client.get("/v1/audio/jobs?limit=2").json()
        assert first["object"] == "list" and [j["id"] for j in first["data"]] == made[::-1][:2]
        assert first["has_more"] and first["last_id"] == made[3]
        second = client.get(f"/v1/audio/jobs?limit=2&after={first['last_id']}").json()
        third = client.get(f"/v1/audio/jobs?limit=2&after={second['last_id']}").json()
        assert [j["id"] for j in second["data"] + third["data"]] == made[::-1][2:] and not third["has_more"]
        for query, param in (("limit=0", "limit"), ("limit=abc", "limit"), ("after=job_nope0000000000000", "after")):
            answer = client.get(f"/v1/audio/jobs?{query}")
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param


def test_delete_cancels_a_queued_job_then_removes_it(open_client, store, tmp_path):
    job = open_client.post("/v1/audio/jobs", json={"input": TEXT}).json()
    (tmp_path / "jobs" / "results" / job["id"]).mkdir(parents=True)
    cancelled = open_client.delete(f"/v1/audio/jobs/{job['id']}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    content = open_client.get(f"/v1/audio/jobs/{job['id']}/content")
    assert content.status_code == 409 and "cancelled" in content.json()["error"]["message"]
    removed = open_client.delete(f"/v1/audio/jobs/{job['id']}")
    assert removed.json() == {"id": job["id"], "object": "audio.job.deleted", "deleted": True}
    assert not (tmp_path / "jobs" / "results" / job["id"]).exists()
    assert open_client.get(f"/v1/audio/jobs/{job['id']}").status_code == 404
    assert open_client.delete(f"/v1/audio/jobs/{job['id']}").status_code == 404


def finish_by_hand(store, job_id: str, path, data: bytes) -> None:
    """What the runner does at the end: every segment recorded, the file, the success."""
    now = time.time()
    job = store.claim_next("test-runner", 30.0, now)
    assert job is not None and job.id == job_id
    for index in range(job.segments_total):
        store.segment_done(job_id, index, now)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    store.finish(job_id, "test-runner", "succeeded", now, result=model.Result(str(path), len(data)))


def test_the_content_is_409_until_done_then_the_audio_with_range(open_client, store, tmp_path):
    job = open_client.post("/v1/audio/jobs", json={"input": TEXT, "response_format": "wav"}).json()
    early = open_client.get(f"/v1/audio/jobs/{job['id']}/content")
    assert early.status_code == 409 and "is queued (0 of" in early.json()["error"]["message"]
    buffer = io.BytesIO()
    soundfile.write(buffer, np.sin(np.arange(24000 * 2) / 10).astype(np.float32) * 0.3, 24000, format="WAV")
    data = buffer.getvalue()
    finish_by_hand(store, job["id"], tmp_path / "jobs" / "results" / job["id"] / "audio.wav", data)
    done = open_client.get(f"/v1/audio/jobs/{job['id']}").json()
    assert done["status"] == "succeeded" and done["bytes"] == len(data) and done["expires_at"] > done["finished_at"]
    whole = open_client.get(f"/v1/audio/jobs/{job['id']}/content")
    assert whole.status_code == 200 and whole.content == data and whole.headers["content-type"] == "audio/wav"
    assert soundfile.info(io.BytesIO(whole.content)).duration == pytest.approx(2.0)
    part = open_client.get(f"/v1/audio/jobs/{job['id']}/content", headers={"Range": "bytes=100-199"})
    assert part.status_code == 206 and part.content == data[100:200]
    assert part.headers["content-range"] == f"bytes 100-199/{len(data)}"
    (tmp_path / "jobs" / "results" / job["id"] / "audio.wav").unlink()
    assert open_client.get(f"/v1/audio/jobs/{job['id']}/content").status_code == 404


def test_a_job_the_full_disk_failed_answers_507_for_its_content(open_client, store):
    job = open_client.post("/v1/audio/jobs", json={"input": TEXT}).json()
    claimed = store.claim_next("test-runner", 30.0, time.time())
    assert claimed is not None
    reason = "the disk is full: free space on /somewhere, then send the job again"
    store.finish(job["id"], "test-runner", "failed", time.time(), error=reason)
    answer = open_client.get(f"/v1/audio/jobs/{job['id']}/content")
    assert answer.status_code == 507 and reason in answer.json()["error"]["message"]
    failed = open_client.get(f"/v1/audio/jobs/{job['id']}").json()
    assert failed["status"] == "failed" and failed["error"]["message"] == reason


def test_a_store_that_fails_answers_503_with_what_to_do(tmp_path, store):
    store.close()  # (a closed store fails every call as a broken one does)
    with TestClient(build_app(store, config(tmp_path))) as client:
        answer = client.get("/v1/audio/jobs")
        assert answer.status_code in (503, 507), answer.text
        assert answer.json()["error"]["message"]


def test_unknown_routes_and_methods_answer_in_the_one_error_shape(open_client):
    assert open_client.get("/v1/audio/jobs/job_x/else").status_code == 404
    answer = open_client.put("/v1/audio/jobs")
    assert answer.status_code == 405 and answer.json()["error"]["status"] == 405


def test_the_owner_is_the_token_or_the_user_a_session_proves():
    policy = Policy(frozenset({digest(ANN)}), {"carol": "$2b$04$" + "a" * 53}, b"s" * 32)
    now = 1000.0
    assert policy.owner({"authorization": f"Bearer {ANN}"}, now) == "token:" + digest(ANN)[:16]
    assert policy.owner({"authorization": f"bearer  {ANN} "}, now) == "token:" + digest(ANN)[:16]
    user_session = policy.session("u:carol:" + hashlib.sha256(policy.users["carol"].encode()).hexdigest(), now)
    assert policy.owner({"cookie": f"{SESSION_COOKIE}={user_session}"}, now) == "user:carol"
    token_session = policy.session("t:" + digest(ANN), now)
    assert policy.owner({"cookie": f"other=1; {SESSION_COOKIE}={token_session}"}, now) == "token:" + digest(ANN)[:16]
    # no credential, a wrong one, a forged or expired session: no owner
    for headers in ({}, {"authorization": f"Bearer {BOB}"}, {"cookie": f"{SESSION_COOKIE}=forged.value"}):
        assert policy.owner(headers, now) == ""
    assert policy.owner({"cookie": f"{SESSION_COOKIE}={user_session}"}, now + 30 * 86400) == ""


def test_job_slots_auto_takes_every_serving_slot_and_yields_down_to_a_quarter():
    from cosyvoice_lb.common.settings import Settings
    from cosyvoice_lb.jobs.__main__ import job_share, job_slots
    from cosyvoice_lb.launcher.plan.planner import Roles, Slot

    slots = tuple(Slot(index=i, port=7860 + i, gpu=None, memory=0, concurrency=c) for i, c in enumerate((4, 4, 4, 2)))
    assert job_slots(Settings(), slots, Roles(serving=3, spares=1)) == 12  # the 3 serving instances' 4 each
    share = job_share(Settings(), slots, Roles(serving=3, spares=1), Path("/nonexistent/routing.board"))
    assert share is not None
    # a quarter while interactive requests come; less one instance's 4 while no board can be read
    assert (share.share.floor, share.share.ceiling, share.share.fallback) == (3, 12, 8)
    assert share() == 8  # (no board here)
    assert job_slots(Settings(), slots[:1], Roles(serving=1)) == 4
    assert job_slots(Settings(job_slots="5"), slots, Roles(serving=3)) == 5  # N: fixed, no share
    assert job_share(Settings(job_slots="5"), slots, Roles(serving=3), Path("x")) is None


def test_the_auto_share_reads_the_board_through_the_reader_it_is_given():
    from cosyvoice_lb.common.settings import Settings
    from cosyvoice_lb.jobs.__main__ import job_share
    from cosyvoice_lb.jobs.yielding import Demand
    from cosyvoice_lb.launcher.plan.planner import Roles, Slot

    slots = tuple(Slot(index=i, port=7860 + i, gpu=None, memory=0, concurrency=4) for i in range(4))
    reads: list[float] = []

    def demand() -> Demand:
        reads.append(1)
        return Demand(taken=1, asking=1)  # an interactive request in flight

    share = job_share(
        Settings(), slots, Roles(serving=4), Path("/nonexistent/routing.board"), demand=demand, clock=lambda: 5.0
    )
    assert share is not None and share() == 4 and reads == [1]  # the floor: a quarter of 16
    assert share.share.last_busy == 5.0  # (at the clock given)


def test_the_redis_url_comes_from_the_environment_first():
    from cosyvoice_lb.common.settings import Settings
    from cosyvoice_lb.jobs.__main__ import redis_url

    recorded = Settings(jobs_redis="redis://recorded:6379/0")
    assert redis_url(recorded, {"COSYVOICE_LB_JOBS_REDIS": "redis://:pw@env:6379/1"}) == "redis://:pw@env:6379/1"
    assert redis_url(recorded, {}) == "redis://recorded:6379/0" and redis_url(Settings(), {}) == ""


def test_retention_removes_finished_jobs_past_their_age_and_their_audio(open_client, store, tmp_path):
    from cosyvoice_lb.jobs.__main__ import Retention

    old, new = (open_client.post("/v1/audio/jobs", json={"input": TEXT}).json()["id"] for _ in range(2))
    for job_id in (old, new):
        (tmp_path / "jobs" / "results" / job_id).mkdir(parents=True)
        (tmp_path / "jobs" / "results" / job_id / "seg-00001.wav").write_bytes(b"x")
    open_client.delete(f"/v1/audio/jobs/{old}")  # (cancelled now: finished)
    keeper = Retention(store, tmp_path / "jobs" / "results", max_age=3600.0)
    assert keeper.sweep(time.time() + 60) == 0  # not old enough yet
    assert keeper.sweep(time.time() + 3700) == 1
    assert store.get(old, SHARED_OWNER) is None and not (tmp_path / "jobs" / "results" / old).exists()
    assert store.get(new, SHARED_OWNER) is not None and (tmp_path / "jobs" / "results" / new).exists()


def test_job_results_is_where_the_api_serves_and_removes_the_audio(tmp_path, store):
    from cosyvoice_lb.common.settings import Settings
    from cosyvoice_lb.jobs.__main__ import outputs_budget, results_root, service_config
    from cosyvoice_lb.jobs.results import results_dir
    from cosyvoice_lb.launcher.state.layout import Layout

    assert results_dir(tmp_path) == results_dir(tmp_path, "") == tmp_path / "jobs" / "results"
    shared = tmp_path / "volume" / ".jobs"
    assert results_dir(tmp_path, str(shared)) == shared
    settings, layout = Settings(job_results=str(shared)), Layout(tmp_path)
    assert results_root(settings, layout) == service_config(settings, layout).results == shared
    assert outputs_budget(settings, layout, {}).results == shared  # (--outputs-max-size counts it)
    assert results_root(Settings(), layout) == tmp_path / "jobs" / "results"
    with TestClient(build_app(store, service_config(settings, layout))) as client:
        moved, left = (client.post("/v1/audio/jobs", json={"input": TEXT}).json()["id"] for _ in range(2))
        finish_by_hand(store, moved, shared / moved / "audio.wav", b"RIFF" + b"\0" * 100)
        finish_by_hand(store, left, tmp_path / "jobs" / "results" / left / "audio.wav", b"RIFF" + b"\0" * 100)
        assert client.get(f"/v1/audio/jobs/{moved}/content").content == b"RIFF" + b"\0" * 100
        assert client.get(f"/v1/audio/jobs/{left}/content").status_code == 404  # (outside the results dir)
        assert client.delete(f"/v1/audio/jobs/{moved}").json()["deleted"] is True
        assert not (shared / moved).exists()
