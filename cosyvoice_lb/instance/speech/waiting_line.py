"""The line in front of an instance's engine slots (:class:`cosyvoice_lb.instance.speech.admission.Admission`
keeps it under its lock): who waits, and who gets the next slot that comes free.

Standard library only (the instance runs in the model's environment).
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from dataclasses import dataclass, field


@dataclass(eq=False)
class Waiter:
    """One request waiting for an engine slot; ``granted`` (under the admission's lock) once
    a slot is its own, then ``event`` is set."""

    cost: float
    background: bool = False
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    granted: bool = False
    event: threading.Event = field(default_factory=threading.Event)


class Line:
    """The order in which waiters get the slots that come free: every interactive waiter,
    oldest first, before any background one, oldest first. Not locked: the admission's
    lock guards it."""

    def __init__(self) -> None:
        self.interactive: deque[Waiter] = deque()
        self.background: deque[Waiter] = deque()

    def __len__(self) -> int:
        return len(self.interactive) + len(self.background)

    def join(self, waiter: Waiter) -> None:
        (self.background if waiter.background else self.interactive).append(waiter)

    def leave(self, waiter: Waiter) -> None:
        queue = self.background if waiter.background else self.interactive
        if waiter in queue:
            queue.remove(waiter)

    def next(self) -> Waiter | None:
        """The waiter the next free slot goes to (out of the line), or None."""
        for queue in (self.interactive, self.background):
            if queue:
                return queue.popleft()
        return None

    def costs(self) -> list[float]:
        """The interactive waiters' estimated seconds, in order: what a new interactive
        request would wait behind."""
        return [waiter.cost for waiter in self.interactive]
