"""Whether a process runs: the one check every side uses (the poison ledger, the routing board,
a roll-out's marker)."""

from __future__ import annotations

import os

PF_EXITING = 0x4  # the kernel's flag of a task in do_exit (include/linux/sched.h)


def alive(pid: int) -> bool:
    """The process runs. A zombie does not (a killed instance stays one until supervisord
    reaps it), nor one that is exiting: its sockets close during the exit, before it is a
    zombie, and nginx retries its request at once -- the retry must see the death.

    0 and negative pids are never alive here: ``kill(0)`` would signal our own group."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: there
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rpartition(")")[2].split()
        return fields[0] not in ("Z", "X") and not int(fields[6]) & PF_EXITING
    except (OSError, IndexError, ValueError):  # no /proc (not Linux): the signal said it exists
        return True
