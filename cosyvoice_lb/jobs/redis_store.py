"""The job store that pods share: Redis (redis-py), named by ``--jobs-redis redis://host:port/db``.

Keys, under a prefix (``cvlb:jobs:`` unless told)::

    job:<id>        the record, JSON (model.to_record)
    text:<id>       the text
    done:<id>       a set of the indexes of the segments made (a segment twice counts once)
    owner:<owner>   a sorted set of the owner's ids, scored by created_at (the list, newest first)
    status:<status> a sorted set of ids per status, scored by created_at (queued),
                    lease_until (running) or finished_at (succeeded, failed, cancelled)

Every change is optimistic: WATCH the job's key, read it, apply the model's rule, then write
the record and its indexes in one MULTI/EXEC, which Redis refuses when another client wrote
the key meanwhile (then it is read again, a bounded number of times). Two runners that claim
the same job both write its key, so one of them loses and moves on to the next candidate:
no job is ever held by two. Redis' own durability (RDB, AOF) is the server's settings; the
store assumes a server that keeps its data.

redis-py is imported when a store is opened: a box on SQLite needs no redis package.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from cosyvoice_lb.jobs import model
from cosyvoice_lb.jobs.base import Cancelled, StoreError, StoreFailure
from cosyvoice_lb.jobs.model import Job, JobStatus, Page, Result, UnknownCursor

T = TypeVar("T")
RETRIES = 200
CANDIDATES = 16
# (a pipeline's queued writes, run in MULTI/EXEC; None: nothing to write) and the call's value
Change = tuple[Callable[[Any], None] | None, T]


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(an unreadable URL)"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def advice(exc: BaseException, where: str, errors: Any) -> StoreError:
    """redis-py's error as what to do about it (``errors``: redis.exceptions)."""
    text = str(exc)
    if isinstance(exc, errors.AuthenticationError) or "NOAUTH" in text or "WRONGPASS" in text:
        return StoreError(
            f"Redis at {where} refused the credentials ({text}): give them in --jobs-redis "
            "(redis://USER:PASSWORD@host:port/0)",
            StoreFailure.AUTH,
        )
    if isinstance(exc, (errors.ConnectionError, errors.TimeoutError)):
        return StoreError(
            f"cannot reach Redis at {where} ({text}): check --jobs-redis and that the server is up and reachable",
            StoreFailure.UNREACHABLE,
        )
    if isinstance(exc, getattr(errors, "OutOfMemoryError", ())) or "OOM" in text or "maxmemory" in text:
        return StoreError(
            f"Redis at {where} is out of memory ({text}): raise its maxmemory or remove old jobs", StoreFailure.FULL
        )
    if isinstance(exc, getattr(errors, "ReadOnlyError", ())) or "READONLY" in text:
        return StoreError(
            f"Redis at {where} is a read-only replica ({text}): point --jobs-redis at the primary",
            StoreFailure.READONLY,
        )
    if "MISCONF" in text:
        return StoreError(
            f"Redis at {where} cannot save to its disk ({text}): fix its disk or its save settings", StoreFailure.FULL
        )
    return StoreError(f"Redis at {where}: {text}")


def score(job: Job) -> float:
    """A job's place in its status' sorted set."""
    if job.status == model.QUEUED:
        return job.created_at
    if job.status == model.RUNNING:
        return job.lease_until if job.lease_until is not None else job.created_at
    return job.finished_at if job.finished_at is not None else job.created_at


class RedisStore:
    """Jobs in the Redis server at ``url`` (checked at open: an unreachable one raises)."""

    def __init__(self, url: str, prefix: str = "cvlb:jobs:", timeout: float = 5.0) -> None:
        self.where = redact(url)
        self.prefix = prefix
        try:
            import redis
            import redis.exceptions
        except ImportError:
            raise StoreError("--jobs-redis needs the redis package: pip install redis", StoreFailure.SETUP) from None
        self._errors_module = redis.exceptions
        try:
            self._redis = redis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=True
            )
        except ValueError as exc:
            raise StoreError(
                f"--jobs-redis {self.where}: {exc}; write it as redis://host:port/0 (rediss:// for TLS)",
                StoreFailure.SETUP,
            ) from None
        with self._errors():
            self._redis.ping()

    def describe(self) -> str:
        return self.where

    def _key(self, kind: str, name: str) -> str:
        return f"{self.prefix}{kind}:{name}"

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except self._errors_module.RedisError as exc:
            raise advice(exc, self.where, self._errors_module) from exc

    def _decode(self, raw: str | None, done: int) -> Job | None:
        return None if raw is None else model.from_record(json.loads(raw), int(done))

    def _load(self, client: Any, job_id: str) -> Job | None:
        """The job through ``client`` (a watching pipeline reads at once)."""
        return self._decode(client.get(self._key("job", job_id)), client.scard(self._key("done", job_id)))

    def _load_many(self, ids: builtins.list[str]) -> builtins.list[Job]:
        pipe = self._redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.get(self._key("job", job_id))
            pipe.scard(self._key("done", job_id))
        values = pipe.execute() if ids else []
        jobs = (self._decode(values[i], values[i + 1]) for i in range(0, len(values), 2))
        return [job for job in jobs if job is not None]

    def _atomic(self, job_id: str, body: Callable[[Any], Change[T]]) -> T:
        """``body`` reads the job through a pipeline that watches its key and says what to write;
        the writes happen only if nobody wrote the key meanwhile (else again, at most RETRIES)."""
        watch_error = self._errors_module.WatchError
        with self._errors():
            for _ in range(RETRIES):
                with self._redis.pipeline() as pipe:
                    try:
                        pipe.watch(self._key("job", job_id))
                        writes, value = body(pipe)
                        if writes is not None:
                            pipe.multi()
                            writes(pipe)
                            pipe.execute()
                        return value
                    except watch_error:
                        continue
        raise StoreError(
            f"Redis at {self.where}: job {job_id} changed under {RETRIES} tries in a row; too many clients "
            "write it at once (fewer runners, or retry)",
            StoreFailure.CONTENTION,
        )

    def _put(self, pipe: Any, old: Job | None, new: Job) -> None:
        pipe.set(self._key("job", new.id), json.dumps(model.to_record(new), separators=(",", ":")))
        if old is not None and old.status != new.status:
            pipe.zrem(self._key("status", old.status), new.id)
        pipe.zadd(self._key("status", new.status), {new.id: score(new)})

    def _delete(self, pipe: Any, job: Job) -> None:
        pipe.delete(self._key("job", job.id), self._key("text", job.id), self._key("done", job.id))
        pipe.zrem(self._key("owner", job.owner), job.id)
        pipe.zrem(self._key("status", job.status), job.id)

    def create(self, job: Job, text: str) -> None:
        if len(text) != job.text_chars or job.status != model.QUEUED:
            raise ValueError(f"job {job.id}: a new job is queued and has its text ({job.text_chars} characters)")

        def body(pipe: Any) -> Change[None]:
            if pipe.exists(self._key("job", job.id)):
                raise ValueError(f"job {job.id} exists already")

            def writes(pipe: Any) -> None:
                self._put(pipe, None, job)
                pipe.set(self._key("text", job.id), text)
                pipe.zadd(self._key("owner", job.owner), {job.id: job.created_at})

            return writes, None

        self._atomic(job.id, body)

    def get(self, job_id: str, owner: str) -> Job | None:
        with self._errors():
            job = self._load_many([job_id])
        return job[0] if job and job[0].owner == owner else None

    def text(self, job_id: str) -> str | None:
        with self._errors():
            value = self._redis.get(self._key("text", job_id))
        return None if value is None else str(value)

    def list(self, owner: str, limit: int | None = None, after: str | None = None) -> Page:
        size = model.check_limit(limit)
        key = self._key("owner", owner)
        with self._errors():
            start = 0
            if after is not None:
                rank = self._redis.zrevrank(key, after)
                if not isinstance(rank, int):  # (None: no such member)
                    raise UnknownCursor(f"after: no job {after} in this list; start again from the first page")
                start = rank + 1
            ids = [str(i) for i in self._redis.zrevrange(key, start, start + size)]
            jobs = self._load_many(ids)
        return Page(data=jobs[:size], has_more=len(ids) > size)

    def _candidates(self, now: float) -> builtins.list[str]:
        expired = self._redis.zrangebyscore(self._key("status", model.RUNNING), "-inf", now, start=0, num=CANDIDATES)
        queued = self._redis.zrange(self._key("status", model.QUEUED), 0, CANDIDATES - 1)
        return [str(i) for i in [*expired, *queued]]

    def claim_next(self, worker: str, lease_seconds: float, now: float) -> Job | None:
        model.check_worker(worker, lease_seconds)

        def body(job_id: str) -> Callable[[Any], Change[Job | None]]:
            def claim(pipe: Any) -> Change[Job | None]:
                job = self._load(pipe, job_id)
                if job is None or not model.claimable(job, now):
                    return None, None  # taken (or gone) since the candidates were read
                claimed = model.claim(job, worker, lease_seconds, now)
                return (lambda p: self._put(p, job, claimed)), claimed

            return claim

        for _ in range(RETRIES):
            with self._errors():
                candidates = self._candidates(now)
            if not candidates:
                return None
            for job_id in candidates:
                claimed = self._atomic(job_id, body(job_id))
                if claimed is not None:
                    return claimed
        return None

    def renew(self, job_id: str, worker: str, lease_seconds: float, now: float) -> Job | None:
        def body(pipe: Any) -> Change[Job | None]:
            job = self._load(pipe, job_id)
            renewed = None if job is None else model.renew(job, worker, lease_seconds, now)
            if job is None or renewed is None:
                return None, None
            return (lambda p: self._put(p, job, renewed)), renewed

        return self._atomic(job_id, body)

    def segment_done(self, job_id: str, index: int, now: float) -> Job | None:
        def body(pipe: Any) -> Change[Job | None]:
            job = self._load(pipe, job_id)
            if job is None:
                return None, None
            model.check_segment(job, index)
            if job.status != model.RUNNING:
                return None, job
            known = bool(pipe.sismember(self._key("done", job_id), index))
            after = replace(job, segments_done=job.segments_done + (0 if known else 1), updated_at=now)

            def writes(p: Any) -> None:
                p.sadd(self._key("done", job_id), index)
                self._put(p, job, after)

            return writes, after

        return self._atomic(job_id, body)

    def done_segments(self, job_id: str) -> frozenset[int]:
        with self._errors():
            return frozenset(int(i) for i in self._redis.smembers(self._key("done", job_id)))

    def finish(
        self,
        job_id: str,
        worker: str,
        status: JobStatus,
        now: float,
        error: str | None = None,
        result: Result | None = None,
    ) -> Job | None:
        def body(pipe: Any) -> Change[Job | None]:
            job = self._load(pipe, job_id)
            finished = None if job is None else model.finish(job, worker, status, now, error, result)
            if job is None or finished is None:
                return None, None
            return (lambda p: self._put(p, job, finished)), finished

        return self._atomic(job_id, body)

    def cancel(self, job_id: str, owner: str, now: float) -> Cancelled | None:
        def body(pipe: Any) -> Change[Cancelled | None]:
            job = self._load(pipe, job_id)
            if job is None or job.owner != owner:
                return None, None
            if job.finished:
                return (lambda p: self._delete(p, job)), Cancelled("removed", job)
            cancelled = model.cancel(job, now)
            return (lambda p: self._put(p, job, cancelled)), Cancelled("cancelled", cancelled)

        return self._atomic(job_id, body)

    def expired(self, before: float) -> builtins.list[Job]:
        with self._errors():
            ids = [
                str(i)
                for status in sorted(model.FINISHED)
                for i in self._redis.zrangebyscore(self._key("status", status), "-inf", f"({before!r}")
            ]
            jobs = self._load_many(ids)
        return sorted(jobs, key=lambda job: (job.finished_at or 0.0, job.id))

    def remove(self, job_id: str) -> Job | None:
        def body(pipe: Any) -> Change[Job | None]:
            job = self._load(pipe, job_id)
            if job is None:
                return None, None
            return (lambda p: self._delete(p, job)), job

        return self._atomic(job_id, body)

    def counts(self) -> dict[str, int]:
        with self._errors():
            pipe = self._redis.pipeline(transaction=False)
            for status in model.STATUSES:
                pipe.zcard(self._key("status", status))
            return {status: int(count) for status, count in zip(model.STATUSES, pipe.execute())}

    def close(self) -> None:
        self._redis.close()

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
