"""Turns at one model: syntheses side by side (``shared``), or one alone (``alone``).

A seeded request runs alone: upstream samples its tokens from torch's one global random
generator, so two syntheses at once draw from each other's sequence and a seed would not
give the same audio twice. A waiting ``alone`` goes before ``shared`` turns asked after it,
so a stream of unseeded requests cannot keep a seeded one out for ever.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Turns:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._shared = 0  # syntheses running side by side
        self._alone = False  # one running alone
        self._waiting = 0  # asking to run alone

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._changed:
            while self._alone or self._waiting:
                self._changed.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._changed:
                self._shared -= 1
                self._changed.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._changed:
            self._waiting += 1
            try:
                while self._alone or self._shared:
                    self._changed.wait()
            finally:
                self._waiting -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._changed:
                self._alone = False
                self._changed.notify_all()

    def turn(self, alone: bool):
        """``alone()`` or ``shared()``."""
        return self.alone() if alone else self.shared()
