"""Who may fetch a file from Gradio's folder, kept on disk beside the files: it outlives the
instance's process, and a file it cannot vouch for is served to nobody.

Gradio names a file by a digest of its content (``<folder>/<digest>/<name>``), uploads and
results alike, so the path alone cannot say which is which. A record says it:

    <folder>/.owners/<digest>/<name>/<who>        its content: when it was granted (epoch s)

``who`` is a session's key (a digest of its route cookie: the cookie itself is never
written), ``anonymous`` (an upload sent without a cookie: served back to nobody) or
``public`` (a result, once an answer named it; only a file made since this process started,
so an answer naming an older file, in an error message say, publishes nothing). A file with a
session's record is an upload: served to the sessions that sent it, each for ``kept`` seconds
after; one with only ``public`` is a result, served as Gradio serves results; a file with no
record (an upload from before records were kept, or one whose records were lost) is served
to nobody.

Instance side: standard library only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from cosyvoice_lb.common.atomic import write_atomic

RECORDS = ".owners"
PUBLIC = "public"
ANONYMOUS = "anonymous"
KEPT_SECONDS = 3600  # an upload's life: as long as Gradio keeps the files it made (delete_cache)


def key_of(session: str) -> str:
    """The record name of a session (a digest: a record never holds the cookie itself)."""
    return hashlib.sha256(session.encode("utf-8")).hexdigest()[:32] if session else ANONYMOUS


def may_serve(records: Mapping[str, float], session: str, now: float, kept: float) -> bool:
    """Whether a file with these records (who -> when granted) is served to ``session``."""
    owners = {who: when for who, when in records.items() if who != PUBLIC}
    if not owners:
        return PUBLIC in records
    granted = owners.get(key_of(session)) if session else None
    return granted is not None and 0 <= now - granted < kept


def expired(records: Mapping[str, float], now: float, kept: float) -> bool:
    """Whether an upload's every grant is over (a result's records never expire)."""
    owners = [when for who, when in records.items() if who != PUBLIC]
    return bool(owners) and all(now - when >= kept for when in owners)


class FileOwners:
    """The records of one Gradio folder (see the module's docstring). ``clock``: epoch seconds."""

    def __init__(self, folder: str, kept: float = KEPT_SECONDS, clock: Callable[[], float] = time.time):
        self.root = os.path.realpath(folder)
        self.records = os.path.join(self.root, RECORDS)
        self.kept, self.clock = kept, clock
        self.since = clock() - 2  # (files made before this process are not its results; 2 s: mtime's grain)

    def relative(self, path: str) -> str | None:
        """``path`` (resolved) relative to the folder; None outside it, or inside the records."""
        full = os.path.realpath(path)
        if not full.startswith(os.path.join(self.root, "")):
            return None
        rel = full[len(self.root) + 1 :]
        return None if rel.split(os.sep)[0] == RECORDS else rel

    def read(self, rel: str) -> dict[str, float]:
        """The records of a file (who -> when granted); {} when it has none."""
        found: dict[str, float] = {}
        try:
            names = os.listdir(os.path.join(self.records, rel))
        except (FileNotFoundError, NotADirectoryError):
            return found
        for name in names:
            if name.startswith("."):  # (a record being written)
                continue
            try:
                with open(os.path.join(self.records, rel, name), encoding="utf-8") as handle:
                    found[name] = float(handle.read().strip() or 0)
            except (OSError, ValueError):
                found[name] = 0.0  # (unreadable: counts as granted long ago)
        return found

    def write(self, rel: str, who: str) -> None:
        write_atomic(Path(self.records, rel, who), f"{self.clock():.3f}\n", mode=0o600, durable=False)

    def grant(self, path: str, session: str) -> None:
        """``session`` sent the upload at ``path`` (a session of "": nobody is served it)."""
        rel = self.relative(path)
        if rel is not None:
            os.makedirs(self.records, mode=0o700, exist_ok=True)
            self.write(rel, key_of(session))

    def publish(self, path: str) -> None:
        """An answer named ``path``: a result, served to whoever has its link, unless it is an
        upload (a file with records already keeps them)."""
        rel = self.relative(path)
        try:
            found = os.stat(os.path.join(self.root, rel)) if rel is not None else None
        except OSError:
            found = None
        if rel is None or found is None or not stat.S_ISREG(found.st_mode) or found.st_mtime < self.since:
            return
        if not self.read(rel):
            os.makedirs(self.records, mode=0o700, exist_ok=True)
            self.write(rel, PUBLIC)

    def serves(self, path: str, session: str) -> bool:
        """Whether the file at ``path`` exists and is served to ``session``."""
        rel = self.relative(path)
        if rel is None or not os.path.isfile(os.path.join(self.root, rel)):
            return False
        return may_serve(self.read(rel), session, self.clock(), self.kept)

    def sweep(self) -> int:
        """Remove expired uploads with their records, and the records of files that are gone.
        Returns how many uploads it removed."""
        now, removed = self.clock(), 0
        for where, _dirs, names in os.walk(self.records, topdown=False):
            rel = os.path.relpath(where, self.records)
            if where == self.records or not any(not n.startswith(".") for n in names):
                if where != self.records and not os.listdir(where):
                    os.rmdir(where)  # (a digest's dir, its names gone)
                continue
            target = os.path.join(self.root, rel)
            gone = not os.path.isfile(target)
            if not gone and expired(self.read(rel), now, self.kept):
                os.unlink(target)
                removed, gone = removed + 1, True
                try:
                    os.rmdir(os.path.dirname(target))  # its digest's dir, when nothing else is in it
                except OSError:
                    pass
            if gone:
                shutil.rmtree(where, ignore_errors=True)
        return removed
