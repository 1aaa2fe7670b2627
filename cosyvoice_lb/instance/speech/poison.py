"""Poison requests: a request that kills or hangs whichever instance runs it must not walk
through the cluster, and nothing else may be refused as one.

nginx retries a request whose instance died under it on another one (synthesis has no side
effects), and clients retry too; a request that deterministically crashes or hangs the
model would cost an instance restart (a model load: minutes) per try. So every synthesis
leaves a mark in a dir all instances share while it holds the engine (the request's
fingerprint, the instance's pid, how many deaths of it were known when it started, and
nginx's id of the client request, the same on each of its tries) and
removes it when it ends, however it ends, as long as the process lives. A mark whose
process is dead is a death the request was present at.

Presence is not guilt. Most deaths have the service's most common text in flight (a
greeting, a UI's default, the same notice to many users), so the rule asks for evidence
that *this* request kills instances. A death counts against request R only while:

* R has not been spoken to the end since that synthesis began: a success of R on any
  instance after the death's mark was made clears it (a request that kills whichever
  instance runs it never succeeds; a common text succeeds all the time);
* R could have caused it: where the dead instance was running other requests too, the
  death is shared, and it does not count against an R that was spoken recently (a request
  seen to succeed is the least likely culprit; another one there is likelier);
* the stop was not graceful: a drained stop clears its own marks.

R is refused only when ``limit`` (2) such deaths stand *and* they are a repetition: one of
them was a run that started after an earlier death of R was known, or two were tries of one
client request (nginx tries one instance after another, never two at once): the first run
died and the retry died too.
Deaths at the same moment (a box-wide kill, an OOM cascade: every mark made before any
death) are not repetition, so they never refuse a request on their own. A culprit is thus
refused after at most one retry, and stays refused when sent again: it never succeeds, so
its marks stand for ``MAX_AGE``.

Instance side: standard library only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from cosyvoice_lb.common import pids

log = logging.getLogger("cosyvoice_lb.instance")

DEATHS_LIMIT = 2
# Seconds a mark counts as evidence (and a success as a sign of a harmless request): a
# deterministic culprit is retried within seconds.
MAX_AGE = 600.0
SPOKEN = "spoken"  # the subdir of successes: one file per request, its mtime the last one
SWEEP_EVERY = 60.0  # seconds between one process's sweeps of old successes


class Poisoned(Exception):
    """This request killed an instance, and so did its retry: it is not run again."""

    def __init__(self, deaths: int):
        super().__init__(
            f"this request was being synthesized when {deaths} instances crashed or hung (it was run "
            "again after the first, and that run died too), so it is refused rather than risk another: "
            "change the text or the options, and tell the operator (the instances' logs show what happened)"
        )
        self.deaths = deaths


@dataclass(frozen=True)
class Evidence:
    """The deaths that stand against one request."""

    deaths: int = 0  # dead instances whose death counts against it
    repeated: bool = False  # one of them ran after another (see the module's rule)


@dataclass(frozen=True)
class _Mark:
    print_: str
    pid: int
    known: int  # deaths of this request known when it started
    attempt: str  # nginx's id of the client request ("-": none)
    path: str


def fingerprint(*parts: object) -> str:
    """A request's identity: the same input gives the same fingerprint on every instance."""
    digest = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else repr(part).encode("utf-8", "backslashreplace")
        digest.update(len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()[:32]


def _parse(directory: str, name: str) -> _Mark | None:
    """A mark's file name: ``PRINT.PID.KNOWN.ATTEMPT.RANDOM`` (``PRINT.PID.RANDOM`` before
    the known deaths and the attempt were kept: read as a first run of its own)."""
    parts = name.split(".")
    if len(parts) == 3 and parts[1].isdigit():
        return _Mark(parts[0], int(parts[1]), 0, "-", os.path.join(directory, name))
    if len(parts) == 5 and parts[1].isdigit() and parts[2].isdigit():
        return _Mark(parts[0], int(parts[1]), int(parts[2]), parts[3], os.path.join(directory, name))
    return None


def _attempt(value: str) -> str:
    """nginx's request id as a file name part (``-`` for none)."""
    cleaned = "".join(c for c in value if c.isascii() and c.isalnum())[:64]
    return cleaned or "-"


class Ledger:
    """The marks of one instance process in the shared dir."""

    def __init__(
        self,
        directory: str,
        pid: int | None = None,
        alive: Callable[[int], bool] = pids.alive,
        clock: Callable[[], float] = time.time,
        limit: int = DEATHS_LIMIT,
        max_age: float = MAX_AGE,
    ):
        self.dir, self.pid = directory, os.getpid() if pid is None else pid
        self.alive, self.clock, self.limit, self.max_age = alive, clock, limit, max_age
        self.spoken_dir = os.path.join(directory, SPOKEN)
        self.warned: set[str] = set()
        self.swept = clock()
        os.makedirs(self.spoken_dir, exist_ok=True)

    def evidence(self, print_: str) -> Evidence:
        """The deaths that count against ``print_`` now (see the module's rule)."""
        now = self.clock()
        held: dict[int, set[str]] = {}  # dead pid -> the requests it was running
        mine: dict[int, _Mark] = {}  # dead pid -> its latest mark of print_
        made_at: dict[str, float] = {}
        for name in os.listdir(self.dir):
            mark = _parse(self.dir, name)
            if mark is None or mark.pid == self.pid:
                continue
            try:
                made = os.stat(mark.path).st_mtime
            except FileNotFoundError:  # its request just ended
                continue
            if self.alive(mark.pid):
                continue
            if now - made > self.max_age:
                self._remove(mark.path)  # stale evidence: forgotten
                continue
            held.setdefault(mark.pid, set()).add(mark.print_)
            if mark.print_ == print_ and (mark.pid not in mine or made >= made_at[mine[mark.pid].path]):
                mine[mark.pid] = mark
                made_at[mark.path] = made
        if not mine:
            return Evidence()
        spoken = self._spoken(print_)
        recently = spoken is not None and now - spoken <= self.max_age
        counted = [
            mark
            for pid, mark in mine.items()
            if not (spoken is not None and spoken >= made_at[mark.path])  # spoken to the end since: cleared
            and not (len(held[pid]) > 1 and recently)  # shared, and it is known to succeed
        ]
        attempts = [mark.attempt for mark in counted if mark.attempt != "-"]
        repeated = any(mark.known > 0 for mark in counted) or len(set(attempts)) < len(attempts)
        return Evidence(len(counted), repeated)

    def deaths(self, print_: str) -> int:
        """How many deaths count against this request now."""
        return self.evidence(print_).deaths

    def check(self, print_: str) -> int:
        """Poisoned when ``print_`` has done enough harm; else how many deaths count against it."""
        found = self.evidence(print_)
        if found.deaths >= self.limit and found.repeated:
            log.warning(
                "refused request %s: it and its retry were in flight at %d instance deaths", print_, found.deaths
            )
            raise Poisoned(found.deaths)
        return found.deaths

    def enter(self, print_: str, deaths: int | None = None, attempt: str = "") -> str:
        """Mark a synthesis of ``print_`` as running here; ``deaths``: what :meth:`check` said
        just before (else it is checked now: one scan of the dir per request, not two);
        ``attempt``: nginx's id of the client request (the same on each of its tries)."""
        if deaths is None:
            deaths = self.check(print_)
        if deaths and print_ not in self.warned:  # once per request here, not per repeat
            if len(self.warned) > 10000:
                self.warned.clear()
            self.warned.add(print_)
            log.warning("request %s was running when an instance died: running it once more", print_)
        mark = os.path.join(self.dir, f"{print_}.{self.pid}.{deaths}.{_attempt(attempt)}.{uuid.uuid4().hex[:8]}")
        with open(mark, "w"):
            pass
        return mark

    def leave(self, mark: str, spoken: bool = False) -> None:
        """The synthesis behind ``mark`` ended; ``spoken``: to the end, which clears the
        deaths of its request made before (see the module's rule)."""
        self._remove(mark)
        if spoken:
            found = _parse(self.dir, os.path.basename(mark))
            if found is not None:
                self._record_spoken(found.print_)

    def clear_own(self) -> None:
        """At a graceful stop: what was cut by the stop did not kill anything."""
        for name in os.listdir(self.dir):
            mark = _parse(self.dir, name)
            if mark is not None and mark.pid == self.pid:
                self._remove(mark.path)

    def _spoken(self, print_: str) -> float | None:
        try:
            return os.stat(os.path.join(self.spoken_dir, print_)).st_mtime
        except FileNotFoundError:
            return None

    def _record_spoken(self, print_: str) -> None:
        path = os.path.join(self.spoken_dir, print_)
        try:
            os.utime(path)
        except FileNotFoundError:
            try:
                with open(path, "w"):
                    pass
            except OSError:  # a full disk: the success goes unrecorded, nothing else
                return
        except OSError:
            return
        now = self.clock()
        if now - self.swept >= SWEEP_EVERY:
            self.swept = now
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Forget successes older than the evidence they could clear."""
        try:
            entries = list(os.scandir(self.spoken_dir))
        except OSError:
            return
        for entry in entries:
            try:
                if now - entry.stat().st_mtime > self.max_age:
                    self._remove(entry.path)
            except FileNotFoundError:
                pass

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
