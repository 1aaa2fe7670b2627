"""The long-form job, pure: the record, its transitions, what a caller sees, pages of a list.

A job's life::

    queued ──claim──▶ running ──finish──▶ succeeded | failed
      │                │  ↺ claimed again once its lease expired (its runner died)
      └────cancel──────┴──────▶ cancelled

A runner *claims* a job for a lease (seconds) and renews it while it works; a runner that dies
stops renewing, and once the lease has expired the next claim takes the job over, keeping the
segments already done. A finished job (succeeded, failed, cancelled) changes no more; a DELETE
of one removes it. Nothing here reads the clock or touches a file: every function that needs
the time takes ``now`` (seconds since the epoch), and the stores
(:mod:`cosyvoice_lb.jobs.store`) persist what these functions return, so both stores share
one set of rules.

The text itself is not part of the record (a list of jobs need not carry a book chapter per
job): the store keeps it beside the record, and the record keeps its length.

The public shape (:func:`public`) is what ``GET /v1/audio/jobs/{id}`` answers: the id, the
status, the timestamps (whole seconds, as OpenAI's objects have them), progress in segments,
the error when failed. Never the owner, the runner, the lease or a path on disk.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from cosyvoice_lb.common.names import StrEnum


class JobStatus(StrEnum):
    """Where a job is in its life (above). The value is what the stores keep, the metrics
    label and the API answers."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


# (the short names the rules below and the stores use)
QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = (
    JobStatus.QUEUED,
    JobStatus.RUNNING,
    JobStatus.SUCCEEDED,
    JobStatus.FAILED,
    JobStatus.CANCELLED,
)
STATUSES = tuple(JobStatus)
FINISHED = frozenset({SUCCEEDED, FAILED, CANCELLED})
TRANSITIONS: Mapping[JobStatus, frozenset[JobStatus]] = {
    QUEUED: frozenset({RUNNING, CANCELLED}),
    # running -> running: a claim of a job whose lease expired (its runner died)
    RUNNING: frozenset({RUNNING, SUCCEEDED, FAILED, CANCELLED}),
    SUCCEEDED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}

MAX_TEXT_CHARS = 200_000
MAX_OWNER_CHARS = 256
ID_PREFIX = "job_"
JOB_ID = re.compile(r"^job_[A-Za-z0-9_-]{16,64}$")
DEFAULT_LIMIT = 20
MAX_LIMIT = 100


class TransitionError(ValueError):
    """A change of status the life above does not have."""


class UnknownCursor(ValueError):
    """A page's ``after`` names no job of this owner (another owner's, or one removed since)."""


def new_id() -> str:
    """``job_`` and a random url-safe token: 128 bits, not guessable, not ordered."""
    return ID_PREFIX + secrets.token_urlsafe(16)


def is_job_id(text: str) -> bool:
    return bool(JOB_ID.match(text))


@dataclass(frozen=True)
class Result:
    """The finished audio: where the runner stored it and how big it is."""

    path: str
    bytes: int


@dataclass(frozen=True)
class Job:
    id: str
    owner: str
    created_at: float
    text_chars: int
    segments_total: int
    # the request's settings (voice, response_format, speed, instructions), JSON values
    params: Mapping[str, Any] = field(default_factory=dict)
    status: JobStatus = QUEUED  # (a status given as its text is read as that member)
    # the store fills it in from the segments it holds (a segment recorded twice counts once)
    segments_done: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    updated_at: float | None = None
    worker: str | None = None
    lease_until: float | None = None
    attempts: int = 0
    error: str | None = None
    result_path: str | None = None
    result_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", JobStatus(self.status))

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


# What a store keeps per job, in this order (segments_done is derived, never stored).
RECORD_FIELDS = tuple(f.name for f in fields(Job) if f.name != "segments_done")


def to_record(job: Job) -> dict[str, Any]:
    """The job as flat values a store keeps (``params`` as JSON text)."""
    record = {name: getattr(job, name) for name in RECORD_FIELDS}
    record["params"] = json.dumps(dict(job.params), sort_keys=True, separators=(",", ":"))
    return record


def from_record(record: Mapping[str, Any], segments_done: int = 0) -> Job:
    values = {name: record[name] for name in RECORD_FIELDS}
    values["params"] = json.loads(values["params"]) if isinstance(values["params"], str) else dict(values["params"])
    return Job(**values, segments_done=segments_done)


def check_transition(job_id: str, old: str, new: str) -> None:
    """Refuse a change of status the life above does not have, saying what the job may do."""
    for status in (old, new):
        if status not in TRANSITIONS:
            raise ValueError(f"job {job_id}: no status {status!r}; the statuses are {', '.join(STATUSES)}")
    allows = TRANSITIONS[JobStatus(old)]
    if new not in allows:
        allowed = ", ".join(sorted(allows)) or "nothing, it is finished (remove it instead)"
        raise TransitionError(f"job {job_id}: cannot go from {old} to {new}; a {old} job may become {allowed}")


def _check_params(params: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(params, Mapping):
        raise ValueError(f"params: a mapping of the request's settings, not {type(params).__name__}")
    if "input" in params:
        raise ValueError("params: the text is given apart (text=…), not as params['input']")
    try:
        json.dumps(dict(params), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"params: JSON values only ({exc})") from None
    return dict(params)


def new_job(
    owner: str, text: str, segments_total: int, now: float, params: Mapping[str, Any] | None = None, job_id: str = ""
) -> Job:
    """A queued job for ``text`` (kept apart by the store), split into ``segments_total`` segments."""
    if not isinstance(owner, str) or not owner or len(owner) > MAX_OWNER_CHARS:
        raise ValueError(f"owner: a non-empty string of at most {MAX_OWNER_CHARS} characters")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text: nothing to say (the text is empty)")
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"text: {len(text)} characters, more than a job takes ({MAX_TEXT_CHARS}); split it")
    if isinstance(segments_total, bool) or not isinstance(segments_total, int) or not 1 <= segments_total <= len(text):
        raise ValueError(
            f"segments_total: a whole number from 1 to the text's length ({len(text)}), not {segments_total!r}"
        )
    if not math.isfinite(now):
        raise ValueError(f"now: a time in seconds since the epoch, not {now!r}")
    job_id = job_id or new_id()
    if not is_job_id(job_id):
        raise ValueError(f"job id {job_id!r}: job_ and 16 to 64 url-safe characters")
    return Job(
        id=job_id,
        owner=owner,
        created_at=float(now),
        text_chars=len(text),
        segments_total=segments_total,
        params=_check_params(params or {}),
        updated_at=float(now),
    )


def claimable(job: Job, now: float) -> bool:
    """Queued, or running under a lease that has expired (its runner stopped renewing)."""
    if job.status == QUEUED:
        return True
    return job.status == RUNNING and job.lease_until is not None and job.lease_until <= now


def check_worker(worker: str, lease_seconds: float) -> None:
    if not isinstance(worker, str) or not worker:
        raise ValueError("worker: a non-empty name for the runner (its host and pid, say)")
    number = isinstance(lease_seconds, (int, float)) and not isinstance(lease_seconds, bool)
    if not (number and math.isfinite(lease_seconds) and lease_seconds > 0):
        raise ValueError(f"lease_seconds: a positive number of seconds, not {lease_seconds!r}")


def claim(job: Job, worker: str, lease_seconds: float, now: float) -> Job:
    """The job, running for ``worker`` until ``now + lease_seconds``; its done segments stay."""
    check_worker(worker, lease_seconds)
    if not claimable(job, now):
        raise TransitionError(f"job {job.id}: not claimable ({job.status}, lease until {job.lease_until})")
    check_transition(job.id, job.status, RUNNING)
    return replace(
        job,
        status=RUNNING,
        worker=worker,
        lease_until=now + lease_seconds,
        started_at=job.started_at if job.started_at is not None else now,
        attempts=job.attempts + 1,
        updated_at=now,
    )


def renew(job: Job, worker: str, lease_seconds: float, now: float) -> Job | None:
    """The job with its lease pushed to ``now + lease_seconds``, or None when ``worker`` no
    longer holds it (cancelled, finished, or taken over after the lease expired): stop then."""
    check_worker(worker, lease_seconds)
    if job.status != RUNNING or job.worker != worker:
        return None
    return replace(job, lease_until=now + lease_seconds, updated_at=now)


def check_segment(job: Job, index: int) -> None:
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < job.segments_total:
        raise ValueError(f"job {job.id}: segment {index!r} is not one of its 0..{job.segments_total - 1}")


def finish(
    job: Job, worker: str, status: JobStatus, now: float, error: str | None = None, result: Result | None = None
) -> Job | None:
    """The job succeeded (with its whole result) or failed (with the reason); None when
    ``worker`` no longer holds it (then its result is not the job's: drop it).

    A success needs every segment done and a result that is not empty, a failure a reason and
    no result: a half result never reads as done."""
    if status not in (SUCCEEDED, FAILED):
        raise ValueError(f"job {job.id}: finish as succeeded or failed, not {status!r} (cancel is its own call)")
    if job.status != RUNNING or job.worker != worker:
        return None
    if status == SUCCEEDED:
        if error is not None or result is None or result.bytes <= 0 or not result.path:
            raise ValueError(f"job {job.id}: a success has a result of one or more bytes, and no error")
        if job.segments_done != job.segments_total:
            raise ValueError(
                f"job {job.id}: {job.segments_done} of {job.segments_total} segments are done; "
                "a result made of part of them is not a success"
            )
    elif not error or result is not None:
        raise ValueError(f"job {job.id}: a failure has a reason (error=…) and no result")
    check_transition(job.id, job.status, status)
    return replace(
        job,
        status=status,
        finished_at=now,
        updated_at=now,
        worker=None,
        lease_until=None,
        error=error,
        result_path=result.path if result else None,
        result_bytes=result.bytes if result else None,
    )


def cancel(job: Job, now: float) -> Job:
    """The queued or running job, cancelled (a finished one raises: remove it instead)."""
    check_transition(job.id, job.status, CANCELLED)
    return replace(job, status=CANCELLED, finished_at=now, updated_at=now, worker=None, lease_until=None)


def _seconds(value: float | None) -> int | None:
    return None if value is None else int(value)


def public(job: Job, max_age: float | None = None) -> dict[str, Any]:
    """What the job's owner sees: OpenAI-ish, never the owner, the runner or a path.

    ``max_age`` (the retention, seconds) gives a finished job its ``expires_at``."""
    expires = job.finished_at + max_age if job.finished_at is not None and max_age is not None else None
    return {
        "id": job.id,
        "object": "audio.job",
        "status": job.status,
        "created_at": _seconds(job.created_at),
        "started_at": _seconds(job.started_at),
        "finished_at": _seconds(job.finished_at),
        "expires_at": _seconds(expires),
        "input_characters": job.text_chars,
        "voice": job.params.get("voice"),
        "response_format": job.params.get("response_format"),
        "progress": {"done": job.segments_done, "total": job.segments_total},
        "bytes": job.result_bytes if job.status == SUCCEEDED else None,
        "error": {"message": job.error, "type": "job_failed"} if job.status == FAILED and job.error else None,
    }


@dataclass(frozen=True)
class Page:
    """One page of an owner's jobs, newest first; ``has_more`` says a next page exists."""

    data: list[Job]
    has_more: bool


def check_limit(limit: int | None) -> int:
    """A page's size: ``DEFAULT_LIMIT`` when not given, 1 to ``MAX_LIMIT``."""
    if limit is None:
        return DEFAULT_LIMIT
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit: a whole number from 1 to {MAX_LIMIT}, not {limit!r}")
    return limit


def newest_first(job: Job) -> tuple[float, str]:
    """The list's order, as a key for ``sorted(..., reverse=True)``: newest, then by id."""
    return (job.created_at, job.id)


def paginate(jobs: Iterable[Job], limit: int | None, after: str | None = None) -> Page:
    """The page of ``jobs`` (one owner's) after the job ``after``, newest first: the stores'
    queries give the same pages, and this is their definition."""
    size = check_limit(limit)
    ordered = sorted(jobs, key=newest_first, reverse=True)
    start = 0
    if after is not None:
        ids = [job.id for job in ordered]
        if after not in ids:
            raise UnknownCursor(f"after: no job {after} in this list; start again from the first page")
        start = ids.index(after) + 1
    chunk = ordered[start : start + size + 1]
    return Page(data=chunk[:size], has_more=len(chunk) > size)


def public_page(page: Page, max_age: float | None = None) -> dict[str, Any]:
    """``GET /v1/audio/jobs``'s body: OpenAI's list object."""
    data = [public(job, max_age) for job in page.data]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": page.has_more,
    }
