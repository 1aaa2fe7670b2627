"""Jobs' results count toward ``--outputs-max-size``: the instances keep their outputs dir
under it, and the jobs process removes the oldest finished jobs' audio while the outputs and
the jobs' results together are past it.

Only finished jobs' files go, oldest finished first; a running job's segments are never
touched (they count, and may leave less room for finished results). A job whose audio was
removed so keeps its record and reads as expired: its folder holds only ``expired.json``
with the reason (``GET`` says it, ``/content`` answers 410 with it) until ``--job-max-age``
removes the job.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.jobs.base import JobStore
from cosyvoice_lb.jobs.results import tree_size

EXPIRED = "expired.json"


@dataclass(frozen=True)
class Held:
    """A finished job's files: its id and their bytes, oldest finished first."""

    job_id: str
    bytes: int


def to_free(held: Iterable[Held], used: int, budget: int) -> list[str]:
    """The finished jobs whose files go, oldest first, until ``used`` bytes (outputs and every
    job's files) are within ``budget``; none when they are already."""
    chosen = []
    for item in held:
        if used <= budget:
            break
        if item.bytes > 0:
            chosen.append(item.job_id)
            used -= item.bytes
    return chosen


def expired_reason(folder: Path) -> str | None:
    """Why a job's audio was removed, when it was (None otherwise)."""
    try:
        found = json.loads((folder / EXPIRED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return str(found.get("reason", "")) if isinstance(found, dict) else None


def files_size(folder: Path) -> int:
    """The bytes of a job's files, its expired mark aside."""
    try:
        mark = (folder / EXPIRED).stat().st_size
    except OSError:
        mark = 0
    return tree_size(folder) - mark


def expire(folder: Path, reason: str) -> None:
    """Mark the job expired, then remove its other files (a crash between leaves it marked,
    and the next sweep removes the rest)."""
    write_atomic(folder / EXPIRED, json.dumps({"reason": reason}).encode(), mode=0o600, durable=False)
    for entry in list(os.scandir(folder)):
        if entry.name == EXPIRED:
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        except OSError:
            pass


@dataclass
class Budget:
    """``--outputs-max-size`` over ``outputs`` (the instances' dir) and ``results`` (the jobs'; counted
    once when they lie inside ``outputs``, as on a pod's shared volume)."""

    outputs: Path
    results: Path
    max_bytes: int
    shown: str = ""  # the setting as given, for the reason

    def enforce(self, store: JobStore, now: float) -> list[str]:
        """Expire the oldest finished jobs' audio while past the budget; the ids expired."""
        used = tree_size(self.outputs) + (0 if self.results.is_relative_to(self.outputs) else tree_size(self.results))
        if used <= self.max_bytes:
            return []
        held = [Held(job.id, files_size(self.results / job.id)) for job in store.expired(now)]
        chosen = to_free(held, used, self.max_bytes)
        reason = (
            f"its audio was removed to keep the outputs and the jobs' results under --outputs-max-size "
            f"{self.shown or self.max_bytes}: make the job again, or raise --outputs-max-size"
        )
        for job_id in chosen:
            expire(self.results / job_id, reason)
        return chosen
