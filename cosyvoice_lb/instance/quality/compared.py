"""One request a model roll-out compares (see ``cohort``), made known to the code that
serves it through a context variable: the speech check checks it whatever ``--asr-sample``
says and writes what it heard into it. Standard library only.
"""

from __future__ import annotations

import contextvars
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

comparing: contextvars.ContextVar[Sample | None] = contextvars.ContextVar("cvlb_cohort", default=None)


@dataclass
class Sample:
    """One compared request: what it came to, when its first audio left and when it ended
    (seconds from its arrival), and its speech check's error and speaker similarity."""

    at: float
    outcome: str = ""
    first_chunk: float | None = None
    total: float | None = None
    error: float | None = None
    similarity: float | None = None
    unchecked: str = "not checked yet"
    queued: float | None = None  # seconds it waited for the engine

    def heard(self, error: float | None, similarity: float | None, unchecked: str) -> None:
        self.error, self.similarity, self.unchecked = error, similarity, unchecked

    def as_dict(self) -> dict:
        return {
            "at": round(self.at, 3),
            "outcome": self.outcome,
            "first_chunk": None if self.first_chunk is None else round(self.first_chunk, 4),
            "total": None if self.total is None else round(self.total, 4),
            "error": self.error,
            "similarity": self.similarity,
            "unchecked": self.unchecked,
            "queued": None if self.queued is None else round(self.queued, 4),
        }


def current() -> Sample | None:
    """The compared request this code runs for (None: an ordinary one)."""
    return comparing.get()


def compared_wait(seconds: float) -> None:
    """The request being compared (if it is) waited ``seconds`` for its engine."""
    sample = comparing.get()
    if sample is not None and sample.queued is None:
        sample.queued = seconds


class ContextPool(ThreadPoolExecutor):
    """A thread pool whose work runs in the context of whoever submitted it (asyncio's
    ``run_in_executor`` copies none): a synthesis knows the request it is compared for."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        return super().submit(contextvars.copy_context().run, fn, *args, **kwargs)
