"""What a job store does, whatever keeps it: the interface both adapters implement, and the
one error they raise.

Every operation is atomic: a claim, a renewal, a segment, a finish or a cancel reads the job
and writes it back in one transaction, so two runners (threads, processes, pods) never both
hold a job, and a reader sees a job before a change or after it. The rules of each change are
:mod:`cosyvoice_lb.jobs.model`'s; the stores only keep what those functions return.

Owners: ``get``, ``list`` and ``cancel`` take the caller's owner and see only that owner's
jobs (another owner's job reads as missing, so the API answers 404 for it as for a job that
never was). The runner's calls (``claim_next``, ``renew``, ``segment_done``, ``finish``)
and retention's (``expired``, ``remove``) take none.

Errors: a backend's failure (a full disk, a read-only or damaged file, a lock held too long,
Redis unreachable or out of memory) is a :class:`StoreError` whose message says what to do,
and whose ``kind`` (a :class:`StoreFailure`) names the case for code (a runner fails its job
on ``FULL``). A call that breaks a rule (an unknown segment, a success without its result) is
a ``ValueError``.
"""

from __future__ import annotations

import builtins
from typing import Literal, NamedTuple, Protocol

from cosyvoice_lb.common.names import StrEnum
from cosyvoice_lb.jobs.model import Job, JobStatus, Page, Result


class StoreFailure(StrEnum):
    """StoreError.kind: what went wrong, for code that must tell the cases apart."""

    FULL = "full"  # the disk, or Redis' memory
    READONLY = "readonly"
    LOCKED = "locked"
    CORRUPT = "corrupt"
    UNREACHABLE = "unreachable"
    AUTH = "auth"
    CONTENTION = "contention"
    SETUP = "setup"  # the store cannot be opened as configured
    OTHER = "other"


KINDS = tuple(StoreFailure)


class StoreError(RuntimeError):
    """The store could not do what was asked; the message says what to do about it."""

    def __init__(self, message: str, kind: StoreFailure = StoreFailure.OTHER) -> None:
        super().__init__(message)
        self.kind = StoreFailure(kind) if kind in KINDS else StoreFailure.OTHER


class Cancelled(NamedTuple):
    """What a DELETE did: ``"cancelled"`` a queued or running job (its runner stops at its next
    segment or renewal), or ``"removed"`` a finished one (``job`` names the result to delete)."""

    action: Literal["cancelled", "removed"]
    job: Job


class JobStore(Protocol):
    """Where jobs live. ``now`` is seconds since the epoch, given by the caller."""

    def describe(self) -> str:
        """Where the store is, for logs and messages (a path, or Redis' URL without its password)."""
        ...

    def create(self, job: Job, text: str) -> None:
        """Keep a new (queued) job and its text; a job of the same id raises ValueError."""
        ...

    def get(self, job_id: str, owner: str) -> Job | None:
        """The job, or None when there is none of that id for ``owner``."""
        ...

    def text(self, job_id: str) -> str | None:
        """The job's text (for its runner), or None when the job is gone."""
        ...

    def list(self, owner: str, limit: int | None = None, after: str | None = None) -> Page:
        """``owner``'s jobs, newest first, the page after the job ``after`` (UnknownCursor when
        ``owner`` has no such job)."""
        ...

    def claim_next(self, worker: str, lease_seconds: float, now: float) -> Job | None:
        """Take one job for ``worker``: a running one whose lease expired (its runner died) or
        else the oldest queued one; None when there is none. Never the same job to two."""
        ...

    def renew(self, job_id: str, worker: str, lease_seconds: float, now: float) -> Job | None:
        """Push ``worker``'s lease on the job on; None when it holds the job no more (stop)."""
        ...

    def segment_done(self, job_id: str, index: int, now: float) -> Job | None:
        """Record that segment ``index`` is made (once, however often told) while the job runs;
        the job after it (a cancelled one says stop), or None when it is gone."""
        ...

    def done_segments(self, job_id: str) -> frozenset[int]:
        """The indexes of the segments already made (a runner that takes a job over skips them)."""
        ...

    def finish(
        self,
        job_id: str,
        worker: str,
        status: JobStatus,
        now: float,
        error: str | None = None,
        result: Result | None = None,
    ) -> Job | None:
        """Succeed (every segment done, the result) or fail (the reason) ``worker``'s job; None
        when it holds the job no more (its result is then not the job's)."""
        ...

    def cancel(self, job_id: str, owner: str, now: float) -> Cancelled | None:
        """A DELETE: cancel a queued or running job, remove a finished one; None when ``owner``
        has no such job."""
        ...

    def expired(self, before: float) -> builtins.list[Job]:
        """The finished jobs that finished before ``before``, oldest first (for retention)."""
        ...

    def remove(self, job_id: str) -> Job | None:
        """Forget the job (its text and segments too); the job removed, or None."""
        ...

    def counts(self) -> dict[str, int]:
        """How many jobs are in each status (every status, zeros included)."""
        ...

    def close(self) -> None: ...
