"""The job store of one box: an SQLite file in the state dir (the standard library's sqlite3).

WAL mode, so readers (the API) never wait for the writer (a runner) and a crash of any process
leaves the last committed change; ``synchronous=FULL``, so a committed change survives the
box's. Every write is one ``BEGIN IMMEDIATE`` transaction: it takes the file's write lock
first, so two processes that claim at once are serialized by SQLite itself and never take the
same job. A lock held by another process is waited for up to ``busy_timeout`` seconds. One
connection per store, shared by its threads under a lock.

The schema is made at open; ``PRAGMA user_version`` says which schema a file has, and a file
from a newer version is refused rather than misread. The text of a job is a table of its own
(a list never reads it); segments are rows keyed by (job, index), so recording one twice
counts once.

``max_bytes`` caps the file (``PRAGMA max_page_count``): past it a write fails as on a full
disk, and the store says so (``StoreError`` of kind ``FULL``).
"""

from __future__ import annotations

import builtins
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cosyvoice_lb.jobs import model
from cosyvoice_lb.jobs.base import Cancelled, StoreError, StoreFailure
from cosyvoice_lb.jobs.model import Job, JobStatus, Page, Result, UnknownCursor

SCHEMA_VERSION = 1
COLUMNS = {
    "id": "TEXT PRIMARY KEY",
    "owner": "TEXT NOT NULL",
    "created_at": "REAL NOT NULL",
    "text_chars": "INTEGER NOT NULL",
    "segments_total": "INTEGER NOT NULL",
    "params": "TEXT NOT NULL",
    "status": "TEXT NOT NULL",
    "started_at": "REAL",
    "finished_at": "REAL",
    "updated_at": "REAL",
    "worker": "TEXT",
    "lease_until": "REAL",
    "attempts": "INTEGER NOT NULL",
    "error": "TEXT",
    "result_path": "TEXT",
    "result_bytes": "INTEGER",
}
assert tuple(COLUMNS) == model.RECORD_FIELDS, "the table's columns are the record's fields"
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS jobs (" + ", ".join(f"{name} {kind}" for name, kind in COLUMNS.items()) + ")",
    "CREATE TABLE IF NOT EXISTS texts (id TEXT PRIMARY KEY REFERENCES jobs(id) ON DELETE CASCADE, text TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS segments (id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,"
    " idx INTEGER NOT NULL, done_at REAL NOT NULL, PRIMARY KEY (id, idx)) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS jobs_by_owner ON jobs (owner, created_at DESC, id DESC)",
    "CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, created_at, id)",
    "CREATE INDEX IF NOT EXISTS jobs_by_lease ON jobs (status, lease_until)",
    "CREATE INDEX IF NOT EXISTS jobs_by_finish ON jobs (status, finished_at)",
)
SELECT = "SELECT j.*, (SELECT COUNT(*) FROM segments s WHERE s.id = j.id) AS segments_done FROM jobs j"
UPDATE = "UPDATE jobs SET " + ", ".join(f"{name} = :{name}" for name in COLUMNS if name != "id") + " WHERE id = :id"
INSERT = f"INSERT INTO jobs ({', '.join(COLUMNS)}) VALUES ({', '.join(':' + name for name in COLUMNS)})"
PAGE_SIZE = 4096


def advice(exc: BaseException, path: Path, busy_timeout: float) -> StoreError:
    """The backend's error as what to do about it."""
    text = str(exc)
    lowered = text.lower()
    where = f"the job store {path}"
    if "full" in lowered or "no space" in lowered:
        return StoreError(f"{where}: the disk is full ({text}); free space on {path.parent}", StoreFailure.FULL)
    if "readonly" in lowered or "read-only" in lowered or "permission" in lowered:
        return StoreError(
            f"{where} is read-only ({text}): make it and its folder writable by the user running cosyvoice-lb",
            StoreFailure.READONLY,
        )
    if "locked" in lowered or "busy" in lowered:
        return StoreError(
            f"{where} stayed locked past {busy_timeout:g} s ({text}): another process holds a long write; "
            "look for a stuck process using this state dir",
            StoreFailure.LOCKED,
        )
    if "not a database" in lowered or "malformed" in lowered or "corrupt" in lowered:
        return StoreError(
            f"{where} is damaged ({text}): move it aside (its jobs are lost) or restore it from a backup, then start again",
            StoreFailure.CORRUPT,
        )
    if "unable to open" in lowered or isinstance(exc, OSError):
        return StoreError(
            f"{where} cannot be opened ({text}): check that {path.parent} exists and is writable", StoreFailure.READONLY
        )
    return StoreError(f"{where}: {text}")


class SqliteStore:
    """Jobs in the SQLite file ``path`` (made, with its folder, when missing)."""

    def __init__(self, path: str | Path, busy_timeout: float = 10.0, max_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.busy_timeout = busy_timeout
        self._lock = threading.RLock()
        self._db: sqlite3.Connection | None = None
        try:
            with self._errors():
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._db = sqlite3.connect(
                    str(self.path), timeout=busy_timeout, isolation_level=None, check_same_thread=False
                )
                self._db.row_factory = sqlite3.Row
                self._setup(max_bytes)
        except BaseException:
            self.close()
            raise

    def _setup(self, max_bytes: int | None) -> None:
        db = self._connection()
        db.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"the job store {self.path} has schema {version}, made by a newer cosyvoice-lb than this one "
                f"(schema {SCHEMA_VERSION}): upgrade, or move the file aside",
                StoreFailure.SETUP,
            )
        mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreError(
                f"the job store {self.path}: WAL mode refused ({mode}); keep it on a local disk", StoreFailure.SETUP
            )
        db.execute("PRAGMA synchronous = FULL")
        db.execute("PRAGMA foreign_keys = ON")
        if max_bytes is not None:
            db.execute(f"PRAGMA max_page_count = {max(1, int(max_bytes) // PAGE_SIZE)}")
        with self._write() as db:
            for statement in SCHEMA:
                db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def describe(self) -> str:
        return str(self.path)

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError(f"the job store {self.path} is closed", StoreFailure.SETUP)
        return self._db

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except (sqlite3.Error, OSError) as exc:
            raise advice(exc, self.path, self.busy_timeout) from exc

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._errors():
            yield self._connection()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One transaction that holds the write lock from its start (BEGIN IMMEDIATE)."""
        with self._lock, self._errors():
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    @staticmethod
    def _job(row: sqlite3.Row | None) -> Job | None:
        return None if row is None else model.from_record(dict(row), row["segments_done"])

    def _one(self, db: sqlite3.Connection, where: str, *args: object) -> Job | None:
        return self._job(db.execute(f"{SELECT} WHERE {where}", args).fetchone())

    def _load(self, db: sqlite3.Connection, job_id: str) -> Job | None:
        return self._one(db, "j.id = ?", job_id)

    def create(self, job: Job, text: str) -> None:
        if len(text) != job.text_chars or job.status != model.QUEUED:
            raise ValueError(f"job {job.id}: a new job is queued and has its text ({job.text_chars} characters)")
        with self._write() as db:
            if db.execute("SELECT 1 FROM jobs WHERE id = ?", (job.id,)).fetchone():
                raise ValueError(f"job {job.id} exists already")
            db.execute(INSERT, model.to_record(job))
            db.execute("INSERT INTO texts (id, text) VALUES (?, ?)", (job.id, text))

    def get(self, job_id: str, owner: str) -> Job | None:
        with self._read() as db:
            return self._one(db, "j.id = ? AND j.owner = ?", job_id, owner)

    def text(self, job_id: str) -> str | None:
        with self._read() as db:
            row = db.execute("SELECT text FROM texts WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else str(row[0])

    def list(self, owner: str, limit: int | None = None, after: str | None = None) -> Page:
        size = model.check_limit(limit)
        where, args = "j.owner = ?", [owner]
        with self._read() as db:
            if after is not None:
                cursor = db.execute("SELECT created_at, id FROM jobs WHERE id = ? AND owner = ?", (after, owner))
                row = cursor.fetchone()
                if row is None:
                    raise UnknownCursor(f"after: no job {after} in this list; start again from the first page")
                where += " AND (j.created_at < ? OR (j.created_at = ? AND j.id < ?))"
                args += [row[0], row[0], row[1]]
            rows = db.execute(
                f"{SELECT} WHERE {where} ORDER BY j.created_at DESC, j.id DESC LIMIT ?", (*args, size + 1)
            ).fetchall()
        jobs = [model.from_record(dict(row), row["segments_done"]) for row in rows]
        return Page(data=jobs[:size], has_more=len(jobs) > size)

    def claim_next(self, worker: str, lease_seconds: float, now: float) -> Job | None:
        model.check_worker(worker, lease_seconds)
        with self._write() as db:
            job = self._one(
                db, "j.status = ? AND j.lease_until <= ? ORDER BY j.lease_until LIMIT 1", model.RUNNING, now
            ) or self._one(db, "j.status = ? ORDER BY j.created_at, j.id LIMIT 1", model.QUEUED)
            if job is None:
                return None
            claimed = model.claim(job, worker, lease_seconds, now)
            db.execute(UPDATE, model.to_record(claimed))
            return claimed

    def renew(self, job_id: str, worker: str, lease_seconds: float, now: float) -> Job | None:
        with self._write() as db:
            job = self._load(db, job_id)
            renewed = None if job is None else model.renew(job, worker, lease_seconds, now)
            if renewed is not None:
                db.execute(UPDATE, model.to_record(renewed))
            return renewed

    def segment_done(self, job_id: str, index: int, now: float) -> Job | None:
        with self._write() as db:
            job = self._load(db, job_id)
            if job is None:
                return None
            model.check_segment(job, index)
            if job.status != model.RUNNING:
                return job
            db.execute("INSERT OR IGNORE INTO segments (id, idx, done_at) VALUES (?, ?, ?)", (job_id, index, now))
            db.execute("UPDATE jobs SET updated_at = ? WHERE id = ?", (now, job_id))
            return self._load(db, job_id)

    def done_segments(self, job_id: str) -> frozenset[int]:
        with self._read() as db:
            return frozenset(row[0] for row in db.execute("SELECT idx FROM segments WHERE id = ?", (job_id,)))

    def finish(
        self,
        job_id: str,
        worker: str,
        status: JobStatus,
        now: float,
        error: str | None = None,
        result: Result | None = None,
    ) -> Job | None:
        with self._write() as db:
            job = self._load(db, job_id)
            finished = None if job is None else model.finish(job, worker, status, now, error, result)
            if finished is not None:
                db.execute(UPDATE, model.to_record(finished))
            return finished

    def cancel(self, job_id: str, owner: str, now: float) -> Cancelled | None:
        with self._write() as db:
            job = self._one(db, "j.id = ? AND j.owner = ?", job_id, owner)
            if job is None:
                return None
            if job.finished:
                db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
                return Cancelled("removed", job)
            cancelled = model.cancel(job, now)
            db.execute(UPDATE, model.to_record(cancelled))
            return Cancelled("cancelled", cancelled)

    def expired(self, before: float) -> builtins.list[Job]:
        finished = sorted(model.FINISHED)
        marks = ", ".join("?" for _ in finished)
        with self._read() as db:
            rows = db.execute(
                f"{SELECT} WHERE j.status IN ({marks}) AND j.finished_at < ? ORDER BY j.finished_at, j.id",
                (*finished, before),
            ).fetchall()
        return [model.from_record(dict(row), row["segments_done"]) for row in rows]

    def remove(self, job_id: str) -> Job | None:
        with self._write() as db:
            job = self._load(db, job_id)
            if job is not None:
                db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            return job

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = dict.fromkeys(model.STATUSES, 0)
        with self._read() as db:
            for status, count in db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status"):
                counts[status] = count
        return counts

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def __enter__(self) -> SqliteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
