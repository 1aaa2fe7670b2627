"""The job stores, for real: the same tests over an SQLite file in tmp_path and over a real
redis-server on 127.0.0.1 (started here, in memory only), then what each backend's failures
read as (a damaged, read-only or full SQLite file; a Redis that is gone or out of memory)."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import sqlite3
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import pytest
from conftest import free_port_block
from redis_support import RedisServer

from cosyvoice_lb.jobs import model
from cosyvoice_lb.jobs.model import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, Job, Result, UnknownCursor
from cosyvoice_lb.jobs.store import (
    JobStore,
    RedisStore,
    SqliteStore,
    StoreError,
    StoreFailure,
    open_store,
    sqlite_path,
)

T0 = 1_800_000_000.0
TEXT = "One sentence. Another one. And a third. The last."


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "redis"])
def opener(request, tmp_path) -> Iterator[Callable[[], JobStore]]:
    """Opens the test's store: every call is a new client of the same data (a reopen)."""
    opened: list[JobStore] = []
    if request.param == "sqlite":
        path = tmp_path / "state" / "jobs.sqlite3"

        def open_one() -> JobStore:
            opened.append(SqliteStore(path))
            return opened[-1]
    else:
        server = request.getfixturevalue("redis_server")
        prefix = f"test-{uuid.uuid4().hex}:"

        def open_one() -> JobStore:
            opened.append(RedisStore(server.url, prefix=prefix))
            return opened[-1]

    yield open_one
    for store in opened:
        store.close()


@pytest.fixture
def store(opener) -> JobStore:
    return opener()


def add(store: JobStore, owner: str = "token:a", now: float = T0, segments: int = 4, text: str = TEXT) -> Job:
    job = model.new_job(owner, text, segments, now, {"voice": "alloy", "response_format": "wav"})
    store.create(job, text)
    return job


def test_a_job_is_kept_whole_and_only_its_owner_sees_it(store):
    job = add(store)
    assert store.get(job.id, "token:a") == job
    assert store.text(job.id) == TEXT
    assert store.get(job.id, "token:b") is None
    assert store.get("job_" + "n" * 22, "token:a") is None and store.text("job_" + "n" * 22) is None
    with pytest.raises(ValueError, match="exists already"):
        store.create(job, TEXT)
    with pytest.raises(ValueError, match="has its text"):
        store.create(model.new_job("token:a", TEXT, 2, T0), TEXT + "!")


def test_the_list_is_the_owners_newest_first_in_pages(store):
    mine = [add(store, "user:me", T0 + i // 2) for i in range(7)]  # pairs made at the same second
    theirs = [add(store, "user:them", T0 + i) for i in range(3)]
    walked: list[Job] = []
    after = None
    for _ in range(10):
        page = store.list("user:me", 3, after)
        assert page == model.paginate(mine, 3, after)  # the pure definition of a page
        walked += page.data
        if not page.has_more:
            break
        after = page.data[-1].id
    assert walked == sorted(mine, key=model.newest_first, reverse=True)
    assert [j.id for j in store.list("user:them").data] == [j.id for j in reversed(theirs)]
    assert store.list("user:nobody").data == []
    with pytest.raises(UnknownCursor):
        store.list("user:me", 3, theirs[0].id)  # another owner's job is no cursor here


def test_a_claim_takes_the_oldest_queued_job_and_runs_it(store):
    older, newer = add(store, now=T0), add(store, now=T0 + 1)
    claimed = store.claim_next("w1", 30, T0 + 2)
    assert claimed is not None and claimed.id == older.id
    assert (claimed.status, claimed.worker, claimed.lease_until, claimed.attempts) == (RUNNING, "w1", T0 + 32, 1)
    assert store.get(older.id, "token:a") == claimed
    second = store.claim_next("w2", 30, T0 + 2)
    assert second is not None and second.id == newer.id
    assert store.claim_next("w3", 30, T0 + 3) is None
    with pytest.raises(ValueError, match="worker"):
        store.claim_next("", 30, T0)


@pytest.mark.parametrize("shared", [True, False], ids=["one-client", "a-client-each"])
def test_threads_that_claim_at_once_take_each_job_exactly_once(opener, shared):
    first = opener()
    jobs = {add(first, now=T0 + i).id for i in range(20)}
    stores = [first if shared else opener() for _ in range(8)]
    claims: list[list[str]] = [[] for _ in stores]
    start = threading.Barrier(len(stores))

    def work(i: int) -> None:
        start.wait(5)
        for _ in range(30):  # bounded: 20 jobs among 8
            job = stores[i].claim_next(f"w{i}", 60, T0 + 100)
            if job is None:
                return
            claims[i].append(job.id)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    taken = [job_id for ids in claims for job_id in ids]
    assert sorted(taken) == sorted(jobs)  # every job, none twice
    assert first.counts()[RUNNING] == 20 and first.counts()[QUEUED] == 0


def test_an_expired_lease_is_claimed_again_and_its_segments_stay_done(store):
    job = add(store, segments=4)
    assert store.claim_next("w1", 10, T0) is not None
    for index in (0, 2):
        store.segment_done(job.id, index, T0 + 1)
    assert store.renew(job.id, "w1", 10, T0 + 5) is not None  # lease now until T0 + 15
    assert store.claim_next("w2", 10, T0 + 14) is None
    again = store.claim_next("w2", 10, T0 + 15)
    assert again is not None and (again.id, again.worker, again.attempts) == (job.id, "w2", 2)
    assert again.segments_done == 2 and store.done_segments(job.id) == {0, 2}
    assert again.started_at == T0
    assert store.renew(job.id, "w1", 10, T0 + 16) is None  # the dead runner's lease is gone
    assert store.finish(job.id, "w1", FAILED, T0 + 16, error="late") is None
    renewed = store.renew(job.id, "w2", 10, T0 + 16)
    assert renewed is not None and renewed.lease_until == T0 + 26


def test_a_segment_recorded_twice_counts_once(store):
    job = add(store, segments=3)
    assert store.segment_done(job.id, 0, T0) == store.get(job.id, "token:a")  # queued: not recorded
    assert store.done_segments(job.id) == frozenset()
    store.claim_next("w1", 30, T0)
    for index in (1, 1, 0, 1):
        after = store.segment_done(job.id, index, T0 + 1)
    assert after is not None and after.segments_done == 2
    assert store.done_segments(job.id) == {0, 1}
    assert store.get(job.id, "token:a").segments_done == 2
    with pytest.raises(ValueError, match="segment 3 is not one of its 0..2"):
        store.segment_done(job.id, 3, T0 + 1)
    assert store.segment_done("job_" + "n" * 22, 0, T0) is None


def test_a_success_needs_all_its_segments_and_is_kept_with_its_result(store):
    job = add(store, segments=2)
    store.claim_next("w1", 30, T0)
    store.segment_done(job.id, 0, T0 + 1)
    with pytest.raises(ValueError, match="1 of 2 segments are done"):
        store.finish(job.id, "w1", SUCCEEDED, T0 + 2, result=Result("/results/x.wav", 100))
    assert store.get(job.id, "token:a").status == RUNNING  # the refusal wrote nothing
    store.segment_done(job.id, 1, T0 + 2)
    done = store.finish(job.id, "w1", SUCCEEDED, T0 + 3, result=Result("/results/x.wav", 100))
    assert done is not None and store.get(job.id, "token:a") == done
    assert (done.status, done.result_path, done.result_bytes, done.finished_at) == (
        SUCCEEDED,
        "/results/x.wav",
        100,
        T0 + 3,
    )
    assert store.finish(job.id, "w1", FAILED, T0 + 4, error="again") is None


def test_cancel_stops_a_live_job_and_removes_a_finished_one(store):
    waiting, working = add(store, now=T0), add(store, now=T0 + 1)
    store.claim_next("w1", 30, T0 + 2)
    store.claim_next("w2", 30, T0 + 2)
    store.segment_done(working.id, 0, T0 + 3)
    assert store.cancel(working.id, "token:other", T0 + 4) is None  # not theirs
    assert store.get(working.id, "token:a").status == RUNNING
    outcome = store.cancel(working.id, "token:a", T0 + 4)
    assert outcome is not None and outcome.action == "cancelled" and outcome.job.status == CANCELLED
    assert store.renew(working.id, "w2", 30, T0 + 5) is None  # its runner stops
    assert store.segment_done(working.id, 1, T0 + 5).status == CANCELLED
    assert store.done_segments(working.id) == {0}
    removed = store.cancel(working.id, "token:a", T0 + 6)
    assert removed is not None and removed.action == "removed" and removed.job.id == working.id
    assert store.get(working.id, "token:a") is None and store.text(working.id) is None
    assert store.done_segments(working.id) == frozenset()
    assert store.cancel(working.id, "token:a", T0 + 7) is None
    queued_one = add(store, now=T0 + 8)
    assert store.cancel(queued_one.id, "token:a", T0 + 9).action == "cancelled"
    assert store.claim_next("w3", 30, T0 + 10) is None  # a cancelled job is never claimed
    assert store.get(waiting.id, "token:a").status == RUNNING
    assert [j.id for j in store.list("token:a").data] == [queued_one.id, waiting.id]


def test_retention_finds_what_finished_before_and_removes_it(store):
    jobs = [add(store, now=T0 + i, segments=1) for i in range(4)]
    for i, job in enumerate(jobs[:3]):
        store.claim_next("w", 30, T0 + 10)
        store.finish(job.id, "w", FAILED, T0 + 20 + i, error=f"failure {i}")
    assert [j.id for j in store.expired(T0 + 22)] == [jobs[0].id, jobs[1].id]
    assert store.expired(T0 + 20) == []
    assert store.counts() == {QUEUED: 1, RUNNING: 0, SUCCEEDED: 0, FAILED: 3, CANCELLED: 0}
    gone = store.remove(jobs[0].id)
    assert gone is not None and (gone.id, gone.status, gone.error) == (jobs[0].id, FAILED, "failure 0")
    assert store.remove(jobs[0].id) is None
    assert store.get(jobs[0].id, "token:a") is None
    assert [j.id for j in store.expired(T0 + 100)] == [jobs[1].id, jobs[2].id]
    assert store.counts()[FAILED] == 2


def test_jobs_outlive_the_store_that_made_them(opener):
    first = opener()
    done = add(first, now=T0, segments=1)
    half = add(first, now=T0 + 1, segments=3)
    waiting = add(first, owner="user:x", now=T0 + 2)
    first.claim_next("w", 30, T0 + 3)
    first.finish(done.id, "w", FAILED, T0 + 4, error="no voice")
    first.claim_next("w", 30, T0 + 5)
    first.segment_done(half.id, 1, T0 + 6)
    before = [first.get(done.id, "token:a"), first.get(half.id, "token:a"), first.get(waiting.id, "user:x")]
    counts = first.counts()
    first.close()
    again = opener()
    assert [again.get(done.id, "token:a"), again.get(half.id, "token:a"), again.get(waiting.id, "user:x")] == before
    assert again.done_segments(half.id) == {1} and again.text(half.id) == TEXT
    assert again.counts() == counts == {QUEUED: 1, RUNNING: 1, SUCCEEDED: 0, FAILED: 1, CANCELLED: 0}
    resumed = again.claim_next("w-new", 30, T0 + 36)  # the old runner's lease ran out meanwhile
    assert resumed is not None and resumed.id == half.id and resumed.segments_done == 1


# SQLite's own cases


def test_the_sqlite_file_is_in_wal_mode_where_the_state_dir_keeps_it(tmp_path):
    store = open_store(tmp_path, None)
    try:
        assert isinstance(store, SqliteStore) and store.path == tmp_path / "jobs" / "jobs.sqlite3"
        assert store.path == sqlite_path(tmp_path) and store.describe() == str(store.path)
        add(store)
        with sqlite3.connect(store.path) as other:  # another process' view of the same file
            assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert other.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 1
    finally:
        store.close()


def test_a_damaged_sqlite_file_says_to_move_it_aside(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    path.write_bytes(b"this was never a database, " * 200)
    with pytest.raises(StoreError, match="is damaged .* move it aside") as caught:
        SqliteStore(path)
    assert caught.value.kind == "corrupt"


def test_a_file_from_a_newer_schema_is_refused(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    SqliteStore(path).close()
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(StoreError, match="schema 99, made by a newer cosyvoice-lb"):
        SqliteStore(path)


def try_to_open(path: Path) -> str:
    """What opening the store at ``path`` gives, as "kind\nmessage" ("opened" when it opens)."""
    try:
        SqliteStore(path).close()
        return "opened\n"
    except StoreError as exc:
        return f"{exc.kind}\n{exc}"


def open_as_nobody(path: Path) -> str:
    """:func:`try_to_open` by a user who may not write what root made 0444: this one, or (root
    writes anything) a forked child that becomes nobody and reports through a pipe."""
    if os.geteuid() != 0:
        return try_to_open(path)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(write, try_to_open(path).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        # (bounded: a child forked beside other threads could hang on a lock one held)
        ready, _, _ = select.select([pipe], [], [], 30)
        seen = pipe.read().decode() if ready else "hung\nthe child opening the store as nobody did not answer"
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return seen


def test_a_read_only_sqlite_file_says_to_make_it_writable():
    folder = Path(tempfile.mkdtemp(prefix="cvlb-ro-"))  # (tmp_path is root's alone: nobody may reach this)
    try:
        path = folder / "jobs.sqlite3"
        with SqliteStore(path) as made:
            add(made)
        path.chmod(0o444)
        folder.chmod(0o555)
        kind, _, message = open_as_nobody(path).partition("\n")
        assert kind == "readonly", message
        assert f"the job store {path}" in message and "writable" in message
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)


def test_a_full_sqlite_file_says_so_and_keeps_no_half_job(tmp_path):
    store = SqliteStore(tmp_path / "jobs.sqlite3", max_bytes=64 * 1024)
    try:
        small = add(store)
        big = "word " * 40_000
        job = model.new_job("token:a", big, 10, T0)
        with pytest.raises(StoreError, match="the disk is full .* free space") as caught:
            store.create(job, big)
        assert caught.value.kind == "full"
        assert store.get(job.id, "token:a") is None and store.text(job.id) is None
        assert store.get(small.id, "token:a") == small  # what was there stays, and the store goes on
        assert store.counts()[QUEUED] == 1
    finally:
        store.close()


# Redis' own cases


def test_an_unreachable_redis_says_to_check_the_url_without_showing_its_password():
    port = free_port_block(1)
    with pytest.raises(StoreError, match="cannot reach Redis at .* check --jobs-redis") as caught:
        RedisStore(f"redis://:hunter2-secret@127.0.0.1:{port}/0", timeout=0.5)
    assert caught.value.kind == "unreachable"
    assert "hunter2" not in str(caught.value) and ":***@127.0.0.1" in str(caught.value)
    with pytest.raises(StoreError, match="write it as redis://host:port/0"):
        open_store("unused", "http://127.0.0.1/")


def test_open_store_picks_redis_when_given_a_url(redis_server):
    store = open_store("unused", redis_server.url)
    try:
        assert isinstance(store, RedisStore) and store.describe() == redis_server.url
    finally:
        store.close()


def test_a_redis_that_runs_out_of_memory_asks_a_password_or_goes_away_says_what_to_do(tmp_path):
    import redis

    server = RedisServer(tmp_path)
    store = RedisStore(server.url, timeout=1)
    try:
        kept = add(store)
        with redis.Redis.from_url(server.url) as admin:  # noeviction, the default: writes are refused
            admin.config_set("maxmemory", 1)
            with pytest.raises(StoreError, match="out of memory .* maxmemory") as full:
                add(store)
            assert full.value.kind == "full"
            assert store.get(kept.id, "token:a") == kept
            admin.config_set("requirepass", "s3cret-word")
        with pytest.raises(StoreError, match="refused the credentials .* give them in --jobs-redis") as denied:
            RedisStore(server.url, timeout=1)
        assert denied.value.kind == "auth"
        with RedisStore(server.url.replace("//", "//:s3cret-word@"), timeout=1) as allowed:
            assert allowed.get(kept.id, "token:a") == kept and "s3cret" not in allowed.describe()
        server.stop()
        with pytest.raises(StoreError, match="cannot reach Redis") as gone:
            store.get(kept.id, "token:a")
        assert gone.value.kind == "unreachable"
    finally:
        store.close()
        server.stop()


def test_sqlite_keeps_each_status_as_the_text_it_always_wrote(tmp_path):
    store = SqliteStore(tmp_path / "jobs.sqlite3")
    try:
        job = add(store)

        def kept() -> list[tuple[str, str]]:
            with closing(sqlite3.connect(store.path)) as db:
                return db.execute("SELECT status, typeof(status) FROM jobs WHERE id = ?", (job.id,)).fetchall()

        assert kept() == [("queued", "text")]
        store.claim_next("runner-1", 60, T0 + 1)
        assert kept() == [("running", "text")]
        store.finish(job.id, "runner-1", FAILED, T0 + 2, error="it broke")
        assert kept() == [("failed", "text")]
    finally:
        store.close()


def test_redis_keeps_each_status_as_the_text_it_always_wrote(redis_server):
    import redis

    prefix = f"test-{uuid.uuid4().hex}:"
    store = RedisStore(redis_server.url, prefix=prefix)
    raw = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        job = add(store)

        def kept() -> tuple[str, list[str]]:
            record = json.loads(raw.get(f"{prefix}job:{job.id}"))
            return record["status"], sorted(key.removeprefix(prefix) for key in raw.keys(f"{prefix}status:*"))

        assert kept() == ("queued", ["status:queued"])
        store.claim_next("runner-1", 60, T0 + 1)
        assert kept() == ("running", ["status:running"])
        store.finish(job.id, "runner-1", FAILED, T0 + 2, error="it broke")
        assert kept() == ("failed", ["status:failed"])
    finally:
        store.close()
        raw.close()


def test_a_store_failure_is_named_by_its_kind_and_an_unknown_kind_is_other():
    assert StoreError("the disk is full", "full").kind is StoreFailure.FULL  # (a kind given as its text)
    assert StoreError("?", "nothing we know").kind is StoreFailure.OTHER
    assert StoreError("?").kind is StoreFailure.OTHER
    assert [str(kind) for kind in StoreFailure] == [
        "full",
        "readonly",
        "locked",
        "corrupt",
        "unreachable",
        "auth",
        "contention",
        "setup",
        "other",
    ]
