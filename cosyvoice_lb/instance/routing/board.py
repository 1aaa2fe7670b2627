"""The routing board: one small shared file per cluster (``run/routing.board``) where every
instance publishes its load and the health loop marks who is in rotation; each instance
reads the others' rows when it decides whether to take a request (``routing``).

A fixed layout in a memory-mapped file, so a read is a few memory loads, not a syscall
per peer: a header (magic, routing mode, slack), then one row per slot, written only by
that slot's instance (its pid, readiness, load, seconds per character, the interactive
requests it has taken and holds, which the job runner yields to, and a ring of the requests
it declined) except the rotation byte, which the health loop writes. Fields are
8-byte aligned; a reader may see one field newer than another, which an estimate
tolerates. The health loop creates the file (0600) and sets the header; an instance opens
it when it is there and never creates it.

Standard library only (instances import it).
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from cosyvoice_lb.common import pids
from cosyvoice_lb.instance.routing.rule import Backlog, Peer

MAGIC = b"CVLBRT01"
HEADER = 64
ROWS = 256  # slots a board holds (a slot past them is routed by least connections alone)
RING = 32  # the requests a row remembers declining (a request's tries take milliseconds)
ROW = 64 + 8 * RING
SIZE = HEADER + ROWS * ROW
# header: magic 8s @0, work B @8, slack d @16
# row: pid q @0, until d @8, per_char d @16, ready B @24, busy B @25, rotation B @26,
#      ring position I @28, interactive taken Q @32, interactive now Q @40, ring RING*Q @64
_HEAD = struct.Struct("<8sB7xd")
_ROW = struct.Struct("<qddBBB")
_RING_POS = 28
_INTERACTIVE = struct.Struct("<QQ")
_INTERACTIVE_AT = 32


class Board:
    """One open board. ``alive`` tells whether a pid still runs (injected in tests)."""

    def __init__(self, memory: mmap.mmap, alive: Callable[[int], bool] = pids.alive):
        self.memory, self.alive = memory, alive

    # --- opening -------------------------------------------------------------------------

    @classmethod
    def create(cls, path: Path) -> Board:
        """The health loop's: the board at ``path``, made (empty, 0600) when it is missing or
        not a board; an existing one keeps its rows (running instances publish there)."""
        board = cls.open(path)
        if board is not None:
            return board
        from cosyvoice_lb.common.atomic import write_atomic  # (the launcher's: an instance never creates the board)

        write_atomic(path, _HEAD.pack(MAGIC, 0, 0.0).ljust(SIZE, b"\0"), mode=0o600)
        board = cls.open(path)
        if board is None:
            raise OSError(f"the routing board {path} could not be read back")
        return board

    @classmethod
    def open(cls, path: Path | str) -> Board | None:
        """The board, or None when there is none (yet) or the file is not one."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != SIZE:
                return None
            memory = mmap.mmap(fd, SIZE)
        except OSError:
            return None
        finally:
            os.close(fd)
        if memory[:8] != MAGIC:
            memory.close()
            return None
        return cls(memory)

    def close(self) -> None:
        self.memory.close()

    # --- the header (the health loop writes it) -----------------------------------------

    def configure(self, work: bool, slack: float) -> None:
        _HEAD.pack_into(self.memory, 0, MAGIC, int(work), slack)

    def work(self) -> tuple[bool, float]:
        """(routing by work is on, slack seconds)."""
        _, work, slack = _HEAD.unpack_from(self.memory, 0)
        return bool(work), slack

    def set_rotation(self, slots: Iterable[int]) -> None:
        """Mark exactly ``slots`` in rotation."""
        chosen = {s for s in slots if 0 <= s < ROWS}
        for slot in range(ROWS):
            self.memory[self._row(slot) + 26] = 1 if slot in chosen else 0

    def rotation(self) -> set[int]:
        """The slots marked in rotation."""
        return {slot for slot in range(ROWS) if self.memory[self._row(slot) + 26]}

    # --- an instance's row --------------------------------------------------------------

    @staticmethod
    def _row(slot: int) -> int:
        return HEADER + slot * ROW

    def publish(self, slot: int, pid: int, ready: bool, load: Backlog, per_char: float) -> None:
        if not 0 <= slot < ROWS:
            return
        at = self._row(slot)
        struct.pack_into("<qdd", self.memory, at, pid, load.until, per_char)
        self.memory[at + 24] = int(ready)
        self.memory[at + 25] = int(load.busy)
        _INTERACTIVE.pack_into(self.memory, at + _INTERACTIVE_AT, max(0, load.interactive), max(0, load.asking))

    def mark_declined(self, slot: int, key: int) -> None:
        if not 0 <= slot < ROWS:
            return
        at = self._row(slot)
        (position,) = struct.unpack_from("<I", self.memory, at + _RING_POS)
        struct.pack_into("<Q", self.memory, at + 64 + 8 * (position % RING), key)
        struct.pack_into("<I", self.memory, at + _RING_POS, (position + 1) % RING)

    def row(self, slot: int) -> tuple[int, Backlog, float, bool, bool]:
        """(pid, load, seconds per character, ready, in rotation) of one slot."""
        at = self._row(slot)
        pid, until, per_char, ready, busy, rotation = _ROW.unpack_from(self.memory, at)
        interactive, asking = _INTERACTIVE.unpack_from(self.memory, at + _INTERACTIVE_AT)
        return pid, Backlog(until, bool(busy), interactive, asking), per_char, bool(ready), bool(rotation)

    def declined(self, slot: int, key: int) -> bool:
        at = self._row(slot) + 64
        return key in struct.unpack_from(f"<{RING}Q", self.memory, at)

    def _in_rotation(self, slot: int) -> list[int]:
        """The other slots in rotation (the rotation byte first: most rows are empty)."""
        return sorted(self.rotation() - {slot})

    def peers(self, slot: int, key: int) -> list[Peer]:
        """The other slots in rotation, ready and alive, each with whether it declined
        request ``key`` already."""
        found = []
        for other in self._in_rotation(slot):
            pid, load, _, ready, _ = self.row(other)
            if pid and ready and self.alive(pid):
                found.append(Peer(other, load, self.declined(other, key)))
        return found

    def interactive(self) -> tuple[int, int]:
        """Over every instance's row: the interactive requests taken (a sum that changes
        whenever one comes) and those in flight or waiting now (a dead instance's not)."""
        taken = asking = 0
        for slot in range(ROWS):
            at = self._row(slot)
            (pid,) = struct.unpack_from("<q", self.memory, at)
            if pid:
                count, now = _INTERACTIVE.unpack_from(self.memory, at + _INTERACTIVE_AT)
                taken += count
                asking += now if now and self.alive(pid) else 0
        return taken, asking

    def rates(self, slot: int) -> list[float]:
        """The seconds per character the other slots in rotation measured (0: not yet)."""
        return [self.row(other)[2] for other in self._in_rotation(slot)]


class Opener:
    """An instance's way to its board: looked at again at most every ``retry`` seconds, so
    a board the health loop makes after the instance started (or replaces) is picked up. A
    replaced board's map is left to the garbage collector, never closed under a thread that
    may still be writing to it."""

    def __init__(self, path: str, retry: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.path, self.retry, self.clock = path, retry, clock
        self.board: Board | None = None
        self.inode: int | None = None
        self.checked = -float("inf")
        self._lock = threading.Lock()

    def __call__(self) -> Board | None:
        now = self.clock()
        if not self.path or now - self.checked < self.retry:
            return self.board
        with self._lock:
            if now - self.checked < self.retry:
                return self.board
            self.checked = now
            try:
                inode: int | None = os.stat(self.path).st_ino
            except OSError:
                inode = None
            if inode != self.inode:
                self.board = Board.open(self.path) if inode is not None else None
                self.inode = inode if self.board is not None else None
            return self.board
