"""Retention of results: what to delete (pure, :func:`doomed`), and the sweep that lists the
outputs dir and deletes it (:func:`sweep`).

On a box the outputs dir is one directory every instance writes and sweeps. On Kubernetes it
is one pod's directory, ``VOLUME/$POD_NAME``, on a volume every pod shares
(:func:`pod_volume` tells by that layout): one sweeper at a time then covers the whole
volume, under a lock on it (``VOLUME/.sweep.lock``, ``flock``, not waited for: a pod that
cannot take it skips this round), so the directories of pods that are gone are kept within
the bounds too. A pod's instances hold a shared lock on ``.alive`` in its directory while
they run; a directory whose ``.alive`` nobody holds is a gone pod's, removed once emptied.

What is never deleted: a result within both bounds, and a write under way — atomic.py's
temp files (``.NAME.XXXX.tmp``) are deleted only once older than the age bound.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

LOCK = ".sweep.lock"  # at the volume's root: one sweeper at a time
ALIVE = ".alive"  # in a pod's dir: its instances hold a shared lock on it while they run
PROMPTS = ".prompts"  # a pod's prompt uploads (server.py), gone with a gone pod's dir
RESULT_SUFFIX = ".wav"
# A pod's .alive is touched at each instance's start: one touched this recently is a pod whose
# instances are (re)starting, not a gone pod's, though nobody holds it for a moment.
ALIVE_GRACE = 600.0


@dataclass(frozen=True)
class StoredFile:
    name: str
    mtime: float
    size: int


def expired(files: list[StoredFile], now: float, max_age: float, max_bytes: int) -> list[str]:
    """Names to delete: older than ``max_age``, then the oldest until the rest fit ``max_bytes``."""
    doomed = {f.name for f in files if now - f.mtime > max_age}
    kept = sorted((f for f in files if f.name not in doomed), key=lambda f: (f.mtime, f.name))
    total = sum(f.size for f in kept)
    for f in kept:
        if total <= max_bytes:
            break
        doomed.add(f.name)
        total -= f.size
    return sorted(doomed)


def is_temp(name: str) -> bool:
    """atomic.py's temp file (``.NAME.XXXX.tmp``): a write under way, or one a crash left."""
    return name.startswith(".") and name.endswith(".tmp")


@dataclass(frozen=True)
class Listed:
    """One file of the listing: ``pod`` is its directory's name on the volume ("" for the
    outputs dir of a box)."""

    pod: str
    name: str
    mtime: float
    size: int

    @property
    def temp(self) -> bool:
        return is_temp(self.name)


@dataclass(frozen=True)
class Doomed:
    """What a sweep deletes: files as (pod, name), and gone pods' directories left empty."""

    files: tuple[tuple[str, str], ...]
    dirs: tuple[str, ...]


def doomed(files: Sequence[Listed], now: float, max_age: float, max_bytes: int, gone: Collection[str] = ()) -> Doomed:
    """Results past ``max_age``, then the oldest of all (every pod's) until the rest fit
    ``max_bytes``; temp files past ``max_age`` (a younger one is a write under way: never
    deleted, its bytes counted); and the dirs of ``gone`` pods that nothing is left in."""
    stale = {(f.pod, f.name) for f in files if f.temp and now - f.mtime > max_age}
    writing = sum(f.size for f in files if f.temp and (f.pod, f.name) not in stale)
    results = [StoredFile(f"{f.pod}/{f.name}", f.mtime, f.size) for f in files if not f.temp]
    swept_keys = expired(results, now, max_age, max(0, max_bytes - writing))
    swept = {(pod, name) for pod, _, name in (key.partition("/") for key in swept_keys)}
    deleted = stale | swept
    left = {f.pod for f in files if (f.pod, f.name) not in deleted}
    return Doomed(tuple(sorted(deleted)), tuple(sorted(set(gone) - left)))


def pod_volume(directory: Path, environ: Mapping[str, str]) -> Path | None:
    """The shared volume ``directory`` is one pod's dir on: its parent when it is named after
    the pod (``VOLUME/$POD_NAME``, as `k8s render` lays it out); None on a box."""
    pod = environ.get("POD_NAME", "")
    return directory.parent if pod and directory.name == pod else None


def hold_alive(directory: Path) -> int:
    """Open the pod dir's ``.alive`` and hold a shared lock on it (the fd; closing it lets go)."""
    fd = os.open(directory / ALIVE, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.utime(fd)
    return fd


@contextlib.contextmanager
def _exclusive(path: Path, create: bool) -> Iterator[bool]:
    """An exclusive flock on ``path``, not waited for: whether it was taken (held until the end)."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    except FileNotFoundError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)


def _untouched(path: Path, now: float) -> bool:
    try:
        return now - path.stat().st_mtime > ALIVE_GRACE
    except FileNotFoundError:
        return False


def _listing(directory: Path, pod: str) -> tuple[list[Listed], bool]:
    """The results and temp files in one dir, and whether it holds anything else (a dir with
    something unknown in it is never removed)."""
    found, unknown = [], False
    for entry in os.scandir(directory):
        if entry.name in (ALIVE, PROMPTS, LOCK):
            continue
        if not entry.is_file(follow_symlinks=False) or not (is_temp(entry.name) or entry.name.endswith(RESULT_SUFFIX)):
            unknown = True
            continue
        try:
            stat = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # another instance swept it, or the write finished
            continue
        found.append(Listed(pod, entry.name, stat.st_mtime, stat.st_size))
    return found, unknown


def _delete(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def sweep(directory: Path, volume: Path | None, now: float, max_age: float, max_bytes: int) -> list[str]:
    """Keep the outputs within the bounds; returns what was deleted (names on a box; on a
    volume, ``POD/NAME`` and ``POD/`` for a gone pod's dir). On a volume nothing is done when
    another sweeper holds the lock."""
    if volume is None:
        files, _ = _listing(directory, "")
        plan = doomed(files, now, max_age, max_bytes)
        for _, name in plan.files:
            _delete(directory / name)
        return [name for _, name in plan.files]
    with _exclusive(volume / LOCK, create=True) as held:
        if not held:
            return []
        return _sweep_volume(directory, volume, now, max_age, max_bytes)


def _sweep_volume(directory: Path, volume: Path, now: float, max_age: float, max_bytes: int) -> list[str]:
    pods = sorted(e.name for e in os.scandir(volume) if e.is_dir(follow_symlinks=False) and not e.name.startswith("."))
    with contextlib.ExitStack() as stack:
        files: list[Listed] = []
        gone = set()
        for pod in pods:
            try:
                listed, unknown = _listing(volume / pod, pod)
            except OSError:  # removed meanwhile, or not ours to read (lost+found)
                continue
            files += listed
            # Gone: nobody holds its .alive (kept locked here until it is removed), and no
            # instance started there lately. A dir without one (made before, or a pod
            # starting) is never taken for a gone pod's.
            alive = volume / pod / ALIVE
            if pod != directory.name and not unknown and _untouched(alive, now):
                if stack.enter_context(_exclusive(alive, create=False)):
                    gone.add(pod)
        plan = doomed(files, now, max_age, max_bytes, gone)
        for pod, name in plan.files:
            _delete(volume / pod / name)
        for pod in plan.dirs:
            shutil.rmtree(volume / pod, ignore_errors=True)  # its .alive, its prompt uploads, itself
    return [f"{pod}/{name}" for pod, name in plan.files] + [f"{pod}/" for pod in plan.dirs]
