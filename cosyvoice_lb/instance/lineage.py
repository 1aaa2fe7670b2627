"""Processes an instance spawns end with it.

vLLM starts its engine (``EngineCore``, 2-4 GB) as a process of its own with
multiprocessing's spawn. The instance stops it when it exits (``upstream_vllm.shutdown``),
but a SIGKILLed instance runs no code: its engine would live on, reparented, holding its
memory, and the next instance on the slot would load a second one beside it.

A spawned child runs the parent's main script (``app.py``) as ``__mp_main__`` before its
target; ``app.py`` calls :func:`follow_parent` there, so every process the instance spawns
watches its parent and ends within about a second of it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

POLL_SECONDS = 0.5
GRACE_SECONDS = 5.0  # after its TERM, to stop as it would for its parent


def follow_parent(
    poll: float = POLL_SECONDS,
    grace: float = GRACE_SECONDS,
    parent: Callable[[], int] = os.getppid,
    end: Callable[[int], None] | None = None,
) -> threading.Thread:
    """Watch the parent of this process from a daemon thread: once it is gone (this
    process was reparented), TERM this process, and kill it if it still runs ``grace``
    seconds later. ``end(signal)`` replaces the signalling (tests)."""
    first = parent()

    def signal_self(number: int) -> None:
        os.kill(os.getpid(), number)

    send = end or signal_self

    def watch() -> None:
        while parent() == first:
            time.sleep(poll)
        send(signal.SIGTERM)
        time.sleep(grace)
        send(signal.SIGKILL)

    thread = threading.Thread(target=watch, name="follow-parent", daemon=True)
    thread.start()
    return thread
