"""The long-form job's rules, pure: every status change (allowed or refused), claims and leases,
what a finish needs, what a caller sees, and pages of a list."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from cosyvoice_lb.jobs import model
from cosyvoice_lb.jobs.model import (
    CANCELLED,
    FAILED,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    Job,
    JobStatus,
    Result,
    TransitionError,
    UnknownCursor,
)

T0 = 1_700_000_000.25
# The life, written out: what each status may become (and nothing else).
LIFE = {
    QUEUED: {RUNNING, CANCELLED},
    RUNNING: {RUNNING, SUCCEEDED, FAILED, CANCELLED},
    SUCCEEDED: set(),
    FAILED: set(),
    CANCELLED: set(),
}
PARAMS = {"voice": "alloy", "response_format": "mp3", "speed": 1.0, "instructions": None}


def queued(owner: str = "token:abc", segments: int = 3, now: float = T0) -> Job:
    return model.new_job(owner, "Hello there. " * segments, segments, now, PARAMS)


def running(worker: str = "w1", lease: float = 30.0, now: float = T0 + 1) -> Job:
    return model.claim(queued(), worker, lease, now)


def in_status(status: str) -> Job:
    """A job in ``status``, reached by the functions themselves."""
    job = queued()
    if status == QUEUED:
        return job
    if status == CANCELLED:
        return model.cancel(job, T0 + 1)
    job = model.claim(job, "w1", 30, T0 + 1)
    if status == RUNNING:
        return job
    if status == FAILED:
        finished = model.finish(job, "w1", FAILED, T0 + 2, error="the voice is gone")
    else:
        done = replace(job, segments_done=job.segments_total)
        finished = model.finish(done, "w1", SUCCEEDED, T0 + 2, result=Result("/r/a.mp3", 1234))
    assert finished is not None
    return finished


@pytest.mark.parametrize(("old", "new"), list(itertools.product(model.STATUSES, repeat=2)))
def test_every_change_of_status_is_allowed_or_refused_as_the_life_says(old, new):
    if new in LIFE[old]:
        model.check_transition("job_x", old, new)
    else:
        with pytest.raises(TransitionError, match=f"job_x: cannot go from {old} to {new}"):
            model.check_transition("job_x", old, new)


def test_a_refusal_says_what_the_job_may_do_instead():
    with pytest.raises(TransitionError, match="a queued job may become cancelled, running"):
        model.check_transition("job_x", QUEUED, SUCCEEDED)
    with pytest.raises(TransitionError, match="nothing, it is finished"):
        model.check_transition("job_x", SUCCEEDED, RUNNING)
    with pytest.raises(ValueError, match="no status 'done'"):
        model.check_transition("job_x", QUEUED, "done")


def test_the_table_and_the_written_life_agree():
    assert {status: set(allowed) for status, allowed in model.TRANSITIONS.items()} == LIFE
    assert model.FINISHED == {s for s, allowed in LIFE.items() if not allowed}


def test_a_new_job_is_queued_with_a_random_id_and_its_texts_length():
    a, b = queued(), queued()
    assert a.status == QUEUED and a.id != b.id and model.is_job_id(a.id)
    assert a.text_chars == len("Hello there. " * 3) and a.segments_total == 3 and a.segments_done == 0
    assert a.created_at == T0 and a.started_at is None and a.finished_at is None and a.attempts == 0
    assert dict(a.params) == PARAMS


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"owner": ""}, "owner"),
        ({"owner": "x" * 257}, "owner"),
        ({"text": "   "}, "the text is empty"),
        ({"text": "a" * (model.MAX_TEXT_CHARS + 1)}, "more than a job takes"),
        ({"segments_total": 0}, "segments_total"),
        ({"segments_total": 99}, "segments_total"),
        ({"segments_total": True}, "segments_total"),
        ({"params": {"input": "again"}}, "the text is given apart"),
        ({"params": {"speed": float("nan")}}, "JSON values only"),
        ({"params": {"voice": object()}}, "JSON values only"),
        ({"job_id": "job_short"}, "16 to 64 url-safe"),
        ({"now": float("inf")}, "now"),
    ],
)
def test_a_new_job_refuses_what_it_cannot_keep(kwargs, message):
    values = {"owner": "o", "text": "Some text to say.", "segments_total": 2, "now": T0, "params": {}}
    with pytest.raises(ValueError, match=message):
        model.new_job(**{**values, **kwargs})


def test_a_record_round_trips_every_field():
    job = replace(in_status(FAILED), segments_done=2)
    record = model.to_record(job)
    assert set(record) == set(model.RECORD_FIELDS) and "segments_done" not in record
    assert json.loads(record["params"]) == PARAMS
    assert model.from_record(json.loads(json.dumps(record)), 2) == job


def test_a_claim_runs_the_job_under_a_lease_and_counts_the_attempt():
    job = running(worker="w1", lease=30, now=T0 + 1)
    assert (job.status, job.worker, job.lease_until, job.started_at, job.attempts) == (
        RUNNING,
        "w1",
        T0 + 31,
        T0 + 1,
        1,
    )
    assert not model.claimable(job, T0 + 30.9)
    with pytest.raises(TransitionError, match="not claimable"):
        model.claim(job, "w2", 30, T0 + 2)


def test_an_expired_lease_is_claimed_again_keeping_the_first_start_and_the_done_segments():
    job = replace(running(now=T0 + 1), segments_done=2)
    assert model.claimable(job, T0 + 31)
    again = model.claim(job, "w2", 10, T0 + 40)
    assert (again.worker, again.lease_until, again.started_at, again.attempts) == ("w2", T0 + 50, T0 + 1, 2)
    assert again.segments_done == 2


@pytest.mark.parametrize("status", [SUCCEEDED, FAILED, CANCELLED])
def test_a_finished_job_is_never_claimable(status):
    assert not model.claimable(in_status(status), T0 + 10**9)


def test_a_renewal_pushes_the_lease_only_for_its_holder():
    job = running(worker="w1", now=T0 + 1)
    renewed = model.renew(job, "w1", 30, T0 + 20)
    assert renewed is not None and renewed.lease_until == T0 + 50
    assert model.renew(job, "w2", 30, T0 + 20) is None
    assert model.renew(model.cancel(job, T0 + 5), "w1", 30, T0 + 20) is None


@pytest.mark.parametrize(("worker", "lease"), [("", 30), ("w", 0), ("w", -1), ("w", float("nan")), ("w", True)])
def test_a_claim_needs_a_worker_and_a_positive_lease(worker, lease):
    with pytest.raises(ValueError, match="worker|lease_seconds"):
        model.claim(queued(), worker, lease, T0)
    with pytest.raises(ValueError, match="worker|lease_seconds"):
        model.check_worker(worker, lease)


def test_segments_are_the_jobs_own():
    job = queued(segments=3)
    for index in (0, 2):
        model.check_segment(job, index)
    for index in (-1, 3, True, "1"):
        with pytest.raises(ValueError, match="is not one of its 0..2"):
            model.check_segment(job, index)


def test_a_success_needs_every_segment_and_a_whole_result():
    job = running()
    with pytest.raises(ValueError, match="2 of 3 segments are done"):
        model.finish(replace(job, segments_done=2), "w1", SUCCEEDED, T0 + 5, result=Result("/r/a", 10))
    done = replace(job, segments_done=3)
    for result in (None, Result("/r/a", 0), Result("", 10)):
        with pytest.raises(ValueError, match="a result of one or more bytes"):
            model.finish(done, "w1", SUCCEEDED, T0 + 5, result=result)
    with pytest.raises(ValueError, match="and no error"):
        model.finish(done, "w1", SUCCEEDED, T0 + 5, error="x", result=Result("/r/a", 10))
    ok = model.finish(done, "w1", SUCCEEDED, T0 + 5, result=Result("/r/a", 10))
    assert ok is not None
    assert (ok.status, ok.finished_at, ok.result_path, ok.result_bytes, ok.worker, ok.lease_until) == (
        SUCCEEDED,
        T0 + 5,
        "/r/a",
        10,
        None,
        None,
    )


def test_a_failure_needs_a_reason_and_no_result():
    job = running()
    with pytest.raises(ValueError, match="a failure has a reason"):
        model.finish(job, "w1", FAILED, T0 + 5)
    with pytest.raises(ValueError, match="a failure has a reason"):
        model.finish(job, "w1", FAILED, T0 + 5, error="disk full", result=Result("/r/half", 10))
    failed = model.finish(job, "w1", FAILED, T0 + 5, error="disk full")
    assert failed is not None and (failed.status, failed.error, failed.result_path) == (FAILED, "disk full", None)


def test_a_finish_by_a_runner_that_lost_the_job_is_none_and_cancel_is_not_a_finish():
    job = running(worker="w1")
    assert model.finish(job, "w2", FAILED, T0 + 5, error="x") is None
    assert model.finish(model.cancel(job, T0 + 3), "w1", FAILED, T0 + 5, error="x") is None
    with pytest.raises(ValueError, match="cancel is its own call"):
        model.finish(job, "w1", CANCELLED, T0 + 5)


@pytest.mark.parametrize("status", model.STATUSES)
def test_cancel_takes_a_queued_or_running_job_and_refuses_a_finished_one(status):
    job = in_status(status)
    if status in (QUEUED, RUNNING):
        cancelled = model.cancel(job, T0 + 9)
        assert (cancelled.status, cancelled.finished_at, cancelled.worker, cancelled.lease_until) == (
            CANCELLED,
            T0 + 9,
            None,
            None,
        )
    else:
        with pytest.raises(TransitionError):
            model.cancel(job, T0 + 9)


def test_the_public_shape_of_each_status():
    keys = {
        "id",
        "object",
        "status",
        "created_at",
        "started_at",
        "finished_at",
        "expires_at",
        "input_characters",
        "voice",
        "response_format",
        "progress",
        "bytes",
        "error",
    }
    for status in model.STATUSES:
        shown = model.public(in_status(status), max_age=3600)
        assert set(shown) == keys and shown["object"] == "audio.job" and shown["status"] == status
        assert shown["created_at"] == int(T0) and isinstance(shown["created_at"], int)
        assert shown["voice"] == "alloy" and shown["response_format"] == "mp3"
    ok = model.public(in_status(SUCCEEDED), max_age=3600)
    assert ok["progress"] == {"done": 3, "total": 3} and ok["bytes"] == 1234 and ok["error"] is None
    assert (ok["started_at"], ok["finished_at"], ok["expires_at"]) == (int(T0 + 1), int(T0 + 2), int(T0 + 2 + 3600))
    failed = model.public(in_status(FAILED))
    assert failed["error"] == {"message": "the voice is gone", "type": "job_failed"} and failed["bytes"] is None
    assert failed["expires_at"] is None
    fresh = model.public(queued())
    assert fresh["progress"] == {"done": 0, "total": 3} and fresh["started_at"] is None and fresh["expires_at"] is None


def test_the_public_shape_never_shows_the_owner_the_runner_or_a_path():
    job = replace(in_status(SUCCEEDED), owner="user:secret-owner", worker="host-42:777")
    text = json.dumps(model.public(job, 60))
    for hidden in ("secret-owner", "host-42", "/r/a.mp3", "lease", "attempts", "owner", "worker"):
        assert hidden not in text


def many(count: int, owner: str = "o", same_time_every: int = 1) -> list[Job]:
    """``count`` jobs, ``same_time_every`` of them at each created_at (ties order by id)."""
    return [model.new_job(owner, "text", 1, T0 + i // same_time_every) for i in range(count)]


@pytest.mark.parametrize(("count", "limit", "ties"), [(0, 5, 1), (7, 3, 1), (10, 5, 1), (11, 4, 3), (5, 100, 5)])
def test_pages_walk_the_list_newest_first_each_job_once(count, limit, ties):
    jobs = many(count, same_time_every=ties)
    expected = sorted(jobs, key=lambda j: (-j.created_at, tuple(-ord(c) for c in j.id)))
    seen: list[Job] = []
    after = None
    for _ in range(count + 2):
        page = model.paginate(reversed(jobs), limit, after)
        assert len(page.data) <= limit
        seen += page.data
        if not page.has_more:
            break
        after = page.data[-1].id
    assert seen == expected


def test_a_page_has_more_only_when_a_job_follows():
    jobs = many(4)
    assert model.paginate(jobs, 4).has_more is False
    assert model.paginate(jobs, 3).has_more is True
    last = model.paginate(jobs, 3, model.paginate(jobs, 3).data[-1].id)
    assert [j.id for j in last.data] == [jobs[0].id] and last.has_more is False


def test_a_cursor_of_no_such_job_and_a_bad_limit_are_refused():
    with pytest.raises(UnknownCursor, match="start again from the first page"):
        model.paginate(many(3), 2, "job_" + "x" * 22)
    for limit in (0, model.MAX_LIMIT + 1, "5", True, 2.0):
        with pytest.raises(ValueError, match="limit: a whole number from 1 to 100"):
            model.check_limit(limit)
    assert model.check_limit(None) == model.DEFAULT_LIMIT


def test_the_public_list_is_openais_list_object():
    jobs = many(3)
    body = model.public_page(model.paginate(jobs, 2))
    assert body["object"] == "list" and body["has_more"] is True
    assert [d["id"] for d in body["data"]] == [jobs[2].id, jobs[1].id]
    assert (body["first_id"], body["last_id"]) == (jobs[2].id, jobs[1].id)
    empty = model.public_page(model.paginate([], None))
    assert empty == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


def test_a_status_is_kept_and_shown_as_the_text_it_always_was():
    assert [str(s) for s in JobStatus] == ["queued", "running", "succeeded", "failed", "cancelled"]
    job = model.new_job("token:a", "Hello there.", 1, T0)
    assert job.status is JobStatus.QUEUED
    record = model.to_record(job)
    assert record["status"] == "queued" and json.dumps({"status": record["status"]}) == '{"status": "queued"}'
    assert model.public(job)["status"] == "queued"
    back = model.from_record({**record, "status": "running"})  # (as a store reads it back: text)
    assert back.status is JobStatus.RUNNING
