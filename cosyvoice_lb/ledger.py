"""Poison requests: a request that kills or hangs whichever instance runs it must not walk
through the cluster.

nginx retries a request whose instance died under it on another one (synthesis has no side
effects), and clients retry too; a request that deterministically crashes or hangs the
model would cost an instance restart (a model load: minutes) per try. So every synthesis
leaves a mark in a dir all instances share while it runs (holds the engine) — the request's fingerprint and
the instance's pid — and removes it when it ends, however it ends, as long as the process
lives. A mark whose process is dead is a death the request was present at. A request
present at ``limit`` deaths (default 2: the first run and one retry) is refused before it
reaches the model, with an error that says why.

A graceful stop (drain) clears its own marks: being cut by a stop is no evidence.

Instance side: standard library only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable

log = logging.getLogger("cosyvoice_lb.instance")

DEATHS_LIMIT = 2
# Seconds a mark counts as evidence: a deterministic culprit is retried within seconds, and
# a common text that happened to run at two unrelated deaths is not refused for long.
MAX_AGE = 600.0


class Poisoned(Exception):
    """This request was in flight at too many instance deaths: it is not run again."""

    def __init__(self, deaths: int):
        super().__init__(
            f"this request was being synthesized when {deaths} instances crashed or hung, so it is "
            "refused rather than risk another: change the text or the options, and tell the operator "
            "(the instances' logs show what happened)"
        )
        self.deaths = deaths


def fingerprint(*parts: object) -> str:
    """A request's identity: the same input gives the same fingerprint on every instance."""
    digest = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else repr(part).encode("utf-8", "backslashreplace")
        digest.update(len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()[:32]


def pid_alive(pid: int) -> bool:
    """The process runs (a zombie does not: a killed instance stays one until supervisord
    reaps it, and nginx retries its request at once)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):  # no /proc (not Linux): the signal said it exists
        return True


class Ledger:
    """The marks of one instance process in the shared dir."""

    def __init__(
        self,
        directory: str,
        pid: int | None = None,
        alive: Callable[[int], bool] = pid_alive,
        clock: Callable[[], float] = time.time,
        limit: int = DEATHS_LIMIT,
        max_age: float = MAX_AGE,
    ):
        self.dir, self.pid = directory, os.getpid() if pid is None else pid
        self.alive, self.clock, self.limit, self.max_age = alive, clock, limit, max_age
        self.warned: set[str] = set()
        os.makedirs(directory, exist_ok=True)

    def deaths(self, print_: str) -> int:
        """How many dead processes this request was in flight in (recently)."""
        dead = set()
        now = self.clock()
        for name in os.listdir(self.dir):
            parts = name.split(".")
            if len(parts) != 3 or not parts[1].isdigit():
                continue
            path = os.path.join(self.dir, name)
            try:
                old = now - os.stat(path).st_mtime > self.max_age
            except FileNotFoundError:  # its request just ended
                continue
            pid = int(parts[1])
            if old and not self.alive(pid):
                self._remove(path)  # stale evidence: forgotten
            elif parts[0] == print_ and pid != self.pid and not self.alive(pid):
                dead.add(pid)
        return len(dead)

    def check(self, print_: str) -> int:
        """Poisoned when ``print_`` has done enough harm; else how many deaths it was at."""
        deaths = self.deaths(print_)
        if deaths >= self.limit:
            log.warning("refused request %s: in flight at %d instance deaths", print_, deaths)
            raise Poisoned(deaths)
        return deaths

    def enter(self, print_: str, deaths: int | None = None) -> str:
        """Mark a synthesis of ``print_`` as running here; ``deaths``: what :meth:`check` said
        just before (else it is checked now: one scan of the dir per request, not two)."""
        if deaths is None:
            deaths = self.check(print_)
        if deaths and print_ not in self.warned:  # once per request here, not per repeat
            if len(self.warned) > 10000:
                self.warned.clear()
            self.warned.add(print_)
            log.warning("request %s was running when an instance died: running it once more", print_)
        mark = os.path.join(self.dir, f"{print_}.{self.pid}.{uuid.uuid4().hex[:8]}")
        with open(mark, "w"):
            pass
        return mark

    def leave(self, mark: str) -> None:
        self._remove(mark)

    def clear_own(self) -> None:
        """At a graceful stop: what was cut by the stop did not kill anything."""
        for name in os.listdir(self.dir):
            if name.split(".")[1:2] == [str(self.pid)]:
                self._remove(os.path.join(self.dir, name))

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
