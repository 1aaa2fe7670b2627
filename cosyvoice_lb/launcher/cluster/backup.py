"""Backups of what a cluster cannot make again: its saved voices and its long-form jobs.

A backup is one directory: ``voices/`` (every whole voice and the names' claims, never a voice
being built or deleted right now), ``jobs/jobs.sqlite3`` (SQLite's online backup: one
consistent copy while runners write, the WAL included), ``jobs/results/`` (the finished audio)
and ``manifest.json`` (what was copied, from where). It is built beside its destination and
renamed into place, so a backup that exists is whole. Taken while the cluster runs.

Restoring needs the cluster down (a runner must not write the store being replaced): voices
missing from the state dir are added (one with the same id is kept as it is), the job store
is replaced (the one there is moved aside, not deleted) and results missing are copied back.

Jobs kept in Redis (``--jobs-redis``) are Redis's to back up (``BGSAVE`` or its append-only
file); their results, on the volume, are copied here all the same.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
import uuid
from collections.abc import Callable
from contextlib import closing
from dataclasses import asdict, dataclass
from pathlib import Path

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.jobs.results import results_dir
from cosyvoice_lb.jobs.store import sqlite_path
from cosyvoice_lb.launcher.errors import ClusterError

MANIFEST = "manifest.json"
STORE_NAME = "jobs.sqlite3"
# a voice being built (.new-ID) or deleted (.gone-ID-…) right now: never half of one in a backup
IN_FLIGHT = (".new-", ".gone-")


class BackupError(ClusterError):
    """What went wrong, in words that say what to do."""


@dataclass(frozen=True)
class Sources:
    """Where one cluster keeps what a backup holds (path arithmetic from its settings)."""

    voices: Path
    results: Path
    store: Path | None  # None: the jobs are in Redis

    @classmethod
    def of(cls, state_dir: Path, settings: Settings) -> Sources:
        return cls(
            voices=Path(settings.voices_dir).expanduser() if settings.voices_dir else state_dir / "voices",
            results=results_dir(state_dir, settings.job_results),
            store=None if settings.jobs_redis else sqlite_path(state_dir),
        )


@dataclass(frozen=True)
class Manifest:
    created_at: float
    voices: int
    jobs: int | None  # None: no store copied (Redis, or none yet)
    results: int
    results_dir: str  # the jobs' records name their audio by this path
    redis: bool

    def lines(self, where: Path) -> list[str]:
        jobs = "jobs: in Redis, not copied (back it up with Redis: BGSAVE)" if self.redis else f"jobs: {self.jobs or 0}"
        return [f"backup written to {where}", f"voices: {self.voices}", jobs, f"job results: {self.results} file(s)"]


def take(sources: Sources, dest: Path, clock: Callable[[], float] = time.time) -> Manifest:
    """Write a backup of ``sources`` to ``dest`` (which must not exist), whole or not at all."""
    if dest.exists():
        raise BackupError(f"{dest} exists: give a new directory (a backup never overwrites one)")
    if not dest.parent.is_dir():
        raise BackupError(f"{dest.parent} is not a directory: create it first")
    building = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    building.mkdir(mode=0o700)
    try:
        voices = _copy_voices(sources.voices, building / "voices")
        jobs = _copy_store(sources.store, building / "jobs" / STORE_NAME) if sources.store else None
        results = _copy_missing(sources.results, building / "jobs" / "results")
        manifest = Manifest(clock(), voices, jobs, results, str(sources.results), sources.store is None)
        write_atomic(building / MANIFEST, json.dumps(asdict(manifest), indent=2) + "\n", mode=0o600)
        os.rename(building, dest)
    except BaseException as exc:
        shutil.rmtree(building, ignore_errors=True)
        if isinstance(exc, (OSError, sqlite3.Error)):
            raise BackupError(f"the backup to {dest} failed, nothing was written: {exc}") from exc
        raise
    return manifest


def restore(backup: Path, sources: Sources, clock: Callable[[], float] = time.time) -> list[str]:
    """Put a backup back (the cluster must be down); the lines say what was done."""
    manifest = read_manifest(backup)
    lines = []
    try:
        voices = _copy_voices(backup / "voices", sources.voices)
        lines.append(f"voices: {voices} added (voices already there are kept as they are)")
        stored = backup / "jobs" / STORE_NAME
        if stored.exists() and sources.store is not None:
            lines += _replace_store(stored, sources.store, clock)
        elif stored.exists():
            lines.append("jobs: the cluster keeps its jobs in Redis: the backup's SQLite store was not restored")
        results = _copy_missing(backup / "jobs" / "results", sources.results)
        lines.append(f"job results: {results} file(s) copied back to {sources.results}")
    except (OSError, sqlite3.Error) as exc:
        raise BackupError(f"restoring {backup} failed part way: {exc}; fix that and run it again") from exc
    if Path(manifest.results_dir) != sources.results:
        lines.append(
            f"note: the backup's jobs name their audio under {manifest.results_dir}, this cluster keeps it in "
            f"{sources.results}: start it with --job-results {manifest.results_dir} to serve those results"
        )
    return lines


def read_manifest(backup: Path) -> Manifest:
    try:
        data = json.loads((backup / MANIFEST).read_text())
        return Manifest(**{k: data[k] for k in Manifest.__dataclass_fields__})
    except FileNotFoundError:
        raise BackupError(f"{backup} is not a backup (no {MANIFEST}): give the directory 'backup' wrote") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BackupError(f"{backup / MANIFEST} cannot be read ({exc}): the backup is damaged") from None


def _copy_voices(source: Path, dest: Path) -> int:
    """Copy every whole voice (and name claim) not already in ``dest``; how many voices."""
    if not source.is_dir():
        return 0
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    copied = 0
    for entry in sorted(source.iterdir()):
        if entry.name.startswith(IN_FLIGHT) or not entry.is_dir():
            continue
        if entry.name == ".names":
            _copy_missing(entry, dest / ".names")
            continue
        target = dest / entry.name
        if target.exists():
            continue
        building = dest / f".new-{entry.name}-{uuid.uuid4().hex[:8]}"
        try:
            shutil.copytree(entry, building)
            os.rename(building, target)  # one step: a reader sees the voice whole or not at all
        except FileNotFoundError:  # deleted while copied: it is not part of the backup
            shutil.rmtree(building, ignore_errors=True)
            continue
        copied += 1
    return copied


def _copy_store(store: Path, dest: Path) -> int | None:
    if not store.exists():
        return None
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _connect(store) as source, _connect(dest) as target:
        source.backup(target)
        count = target.execute("SELECT count(*) FROM jobs").fetchone()[0]
    os.chmod(dest, 0o600)
    return int(count)


def _connect(path: Path) -> closing[sqlite3.Connection]:
    """(``sqlite3``'s own context manager commits but never closes.)"""
    return closing(sqlite3.connect(path, timeout=30))


def _replace_store(stored: Path, store: Path, clock: Callable[[], float]) -> list[str]:
    lines = []
    if store.exists():
        aside = store.with_name(f"{store.name}.before-restore-{int(clock())}")
        for suffix in ("", "-wal", "-shm"):
            old = Path(f"{store}{suffix}")
            if old.exists():
                os.rename(old, f"{aside}{suffix}")
        lines.append(f"jobs: the store there was moved aside to {aside}")
    store.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    count = _copy_store(stored, store)
    lines.append(f"jobs: {count or 0} restored to {store}")
    return lines


def _copy_missing(source: Path, dest: Path) -> int:
    """Copy the files under ``source`` that ``dest`` lacks (each whole: temp name, then rename)."""
    if not source.is_dir():
        return 0
    copied = 0
    for path in sorted(p for p in source.rglob("*") if p.is_file() and not p.name.startswith(".")):
        target = dest / path.relative_to(source)
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        partial = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            shutil.copy2(path, partial)
            os.rename(partial, target)
        except FileNotFoundError:  # swept while copied
            partial.unlink(missing_ok=True)
            continue
        copied += 1
    return copied
