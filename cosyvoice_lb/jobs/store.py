"""The job store: one interface (:class:`JobStore`), two adapters, and the choice between them.

- :class:`SqliteStore`: an SQLite file in the state dir (``jobs/jobs.sqlite3``), the default:
  one box, any number of processes on it.
- :class:`RedisStore`: a Redis server, with ``--jobs-redis URL``: pods on Kubernetes that share
  one store (their results then live on a volume they share).

Both keep the same jobs the same way (the rules are :mod:`cosyvoice_lb.jobs.model`'s) and raise
:class:`StoreError` with what to do when their backend fails. :mod:`cosyvoice_lb.jobs.base`
documents each operation.
"""

from __future__ import annotations

from pathlib import Path

from cosyvoice_lb.jobs.base import KINDS, Cancelled, JobStore, StoreError, StoreFailure
from cosyvoice_lb.jobs.redis_store import RedisStore
from cosyvoice_lb.jobs.sqlite_store import SqliteStore

__all__ = [
    "KINDS",
    "Cancelled",
    "JobStore",
    "RedisStore",
    "SqliteStore",
    "StoreError",
    "StoreFailure",
    "open_store",
    "sqlite_path",
]


def sqlite_path(state_dir: str | Path) -> Path:
    """Where the default store lives in a state dir (beside the results, out of run/)."""
    return Path(state_dir).expanduser() / "jobs" / "jobs.sqlite3"


def open_store(state_dir: str | Path, redis_url: str | None = None) -> JobStore:
    """Redis when ``redis_url`` is given (``--jobs-redis``), else the state dir's SQLite file."""
    if redis_url:
        return RedisStore(redis_url)
    return SqliteStore(sqlite_path(state_dir))
