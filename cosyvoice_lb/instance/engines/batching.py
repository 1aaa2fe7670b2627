"""Gathering the same work of concurrent syntheses into one run: who waits for whom, and how
a group is cut. No model here: what runs a group is given (``upstream_batch``).

A synthesis thread hands its item to a :class:`Batcher` and blocks until its result is back.
The first thread whose item may go leads: it takes every item waiting under its key, cuts
them into groups of similar length (:func:`groups`: padding costs compute), runs each group
once and hands every result out; the others only wait. An item may go

- at once when every synthesis that could bring an item (``expected()``) has brought one:
  a synthesis alone never waits;
- when ``size`` items wait;
- when the oldest has waited ``window`` seconds: later ones missed this group.

A group that fails as a whole is run again item by item, so one bad item fails its own
synthesis only. Pure Python and threads; the instance's CosyVoice environment runs it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

Run = Callable[[Sequence[Any]], Sequence[Any]]  # payloads -> results, one each, in order
Single = Callable[[Any], Any]  # one payload -> its result


def groups(lengths: Sequence[int], size: int, waste: float) -> list[list[int]]:
    """The indices of ``lengths`` cut into groups of at most ``size``, shortest first, each
    padding at most ``waste`` of its work (padded to its longest: ``1 - sum / (n * max)``).
    Every index is in exactly one group."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    cut: list[list[int]] = []
    for index in order:
        group = cut[-1] if cut else None
        if group is not None and len(group) < size:
            members = [*group, index]
            longest = max(lengths[i] for i in members)
            padded = longest * len(members)
            if padded == 0 or 1 - sum(lengths[i] for i in members) / padded <= waste:
                group.append(index)
                continue
        cut.append([index])
    return cut


@dataclass
class Item:
    payload: Any
    length: int
    since: float
    done: bool = False
    result: Any = None
    error: BaseException | None = None


@dataclass
class Batcher:
    """Items of one stage (flow, HiFT) of concurrent syntheses, run in groups by ``run``.

    ``single`` runs one item alone (a group of one, and each item of a group that failed);
    by default ``run`` with one. ``size`` <= 1 runs every item alone at once. ``heard(n)``
    hears the size of each group run. ``clock`` is seconds (monotonic)."""

    run: Run
    size: int
    window: float
    waste: float = 0.25
    single: Single | None = None
    expected: Callable[[], int] = lambda: 1
    heard: Callable[[int], None] = lambda n: None
    clock: Callable[[], float] = time.monotonic
    _changed: threading.Condition = field(default_factory=threading.Condition)
    _waiting: dict[Hashable, list[Item]] = field(default_factory=dict)

    def submit(self, key: Hashable, payload: Any, length: int) -> Any:
        """``payload``'s result, run in a group of items with the same ``key`` (whatever
        must be alike to batch: flags, dtype, device); raises what its run raised."""
        if self.size <= 1:
            return self._alone([Item(payload, length, self.clock())])[0].result
        item = Item(payload, length, self.clock())
        taken: list[Item] = []
        with self._changed:
            self._waiting.setdefault(key, []).append(item)
            self._changed.notify_all()
            while not item.done:
                waiting = self._waiting.get(key) or []
                if any(i is item for i in waiting) and self._may_go(waiting):
                    taken = self._waiting.pop(key)  # (this thread leads them all)
                    break
                self._changed.wait(self._wait_for(key))
        if taken:
            self._lead(taken)
        if item.error is not None:
            raise item.error
        return item.result

    def _may_go(self, waiting: list[Item]) -> bool:
        """Under the lock: whether the items waiting under one key may go now."""
        everyone = sum(len(items) for items in self._waiting.values()) >= self.expected()
        return everyone or len(waiting) >= self.size or self.clock() - waiting[0].since >= self.window

    def _wait_for(self, key: Hashable) -> float:
        waiting = self._waiting.get(key) or []
        if not waiting:
            return self.window
        return max(0.0005, self.window - (self.clock() - waiting[0].since))

    def _lead(self, items: list[Item]) -> None:
        """Run the items taken, in groups; hand every result out."""
        try:
            for indices in groups([i.length for i in items], self.size, self.waste):
                self._group([items[i] for i in indices])
        finally:
            with self._changed:
                for item in items:
                    if not item.done:  # (a group that raised past its fallback: its items fail)
                        item.done, item.error = True, item.error or RuntimeError("the batch did not run")
                self._changed.notify_all()

    def _group(self, items: list[Item]) -> None:
        if len(items) == 1:
            self._alone(items)
            return
        try:
            results = self.run([i.payload for i in items])
        except Exception:  # noqa: BLE001 - each alone: only a bad item's synthesis fails
            self._alone(items)
            return
        self.heard(len(items))
        for item, result in zip(items, results):
            item.result, item.done = result, True

    def _alone(self, items: list[Item]) -> list[Item]:
        for item in items:
            try:
                item.result = self.single(item.payload) if self.single else self.run([item.payload])[0]
            except Exception as exc:  # noqa: BLE001 - raised in its own thread
                item.error = exc
            item.done = True
            self.heard(1)
        return items
