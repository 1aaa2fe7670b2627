"""Every program's log lines on the launcher's own stdout, for `up --foreground` in a
container: ``kubectl logs`` and a log shipper reading container output (Fluent Bit) see the
instances', nginx's, the health loop's, the panel's and supervisord's lines as they are
written, while the files stay for `cosyvoice-lb logs` on a box.

Each line goes out once and whole, as ``[POD] NAME | LINE`` (``POD`` from the Downward
API's ``POD_NAME`` when set, ``NAME`` the log's: instance-0, nginx-access, health, ...). A
log that supervisord rotates is read to its end before the new file is opened. The relay
takes its writer, so tests drive it step by step.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

# How often the logs dir is looked at for new lines (and new logs).
RELAY_POLL = 0.2
# A line longer than this goes out in pieces of it (no log line should come near it).
MAX_LINE = 16384


@dataclass
class _Follower:
    """One log file read as it grows; ``pending`` is a last line not yet ended."""

    path: Path
    handle: BinaryIO
    pending: bytes = b""

    @classmethod
    def open(cls, path: Path, at_end: bool) -> _Follower:
        handle = open(path, "rb")
        if at_end:
            handle.seek(0, os.SEEK_END)
        return cls(path, handle)

    def lines(self) -> list[bytes]:
        """The lines ended since the last call (a rotated file is read to its end first)."""
        out = self._read()
        if self._replaced():
            out += self._read()  # what was written before the rename
            if self.pending:
                out.append(self.pending)
                self.pending = b""
            self.handle.close()
            self.handle = open(self.path, "rb")
            out += self._read()
        return out

    def _read(self) -> list[bytes]:
        data = self.pending + self.handle.read()
        *whole, self.pending = data.split(b"\n")
        while len(self.pending) > MAX_LINE:
            whole.append(self.pending[:MAX_LINE])
            self.pending = self.pending[MAX_LINE:]
        return whole

    def _replaced(self) -> bool:
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return False  # between the rename and the new file: the next look opens it
        return now.st_ino != os.fstat(self.handle.fileno()).st_ino or now.st_size < self.handle.tell()

    def close(self) -> None:
        self.handle.close()


@dataclass
class LogRelay:
    """Relays the ``*.log`` files of ``logs`` (rotated backups, ``*.log.1``, are not followed).
    Logs there when the relay starts are followed from their end (their old lines were a
    previous run's); logs that appear later, from their first line."""

    logs: Path
    write: Callable[[bytes], None]
    pod: str = ""
    followers: dict[str, _Follower] = field(default_factory=dict)
    started: bool = False

    def step(self) -> int:
        """Relay what was written since the last step; how many lines went out."""
        sent = 0
        for path in sorted(self.logs.glob("*.log")) if self.logs.is_dir() else []:
            name = path.name[: -len(".log")]
            if name not in self.followers:
                try:
                    self.followers[name] = _Follower.open(path, at_end=not self.started)
                except OSError:
                    continue
        self.started = True
        for name, follower in self.followers.items():
            try:
                lines = follower.lines()
            except OSError:
                continue
            if lines:
                prefix = (f"[{self.pod}] " if self.pod else "") + f"{name} | "
                self.write(b"".join(prefix.encode() + line.rstrip(b"\r") + b"\n" for line in lines))
                sent += len(lines)
        return sent

    def close(self) -> None:
        for follower in self.followers.values():
            follower.close()
        self.followers.clear()


def write_stdout(data: bytes) -> None:
    """Whole lines to fd 1, unbuffered; a closed stdout loses them (the files keep them)."""
    try:
        while data:
            data = data[os.write(1, data) :]
    except OSError:
        pass


class RelayThread:
    """The relay in a daemon thread, from :meth:`start` until :meth:`stop` (which relays the
    last lines, those of the drain included, before it returns)."""

    def __init__(
        self,
        logs: Path,
        pod: str | None = None,
        write: Callable[[bytes], None] = write_stdout,
        poll: float = RELAY_POLL,
    ):
        self.relay = LogRelay(logs, write, os.environ.get("POD_NAME", "") if pod is None else pod)
        self.poll = poll
        self.done = threading.Event()
        self.lock = threading.Lock()  # one step at a time: the thread's, or stop's last one
        self.thread = threading.Thread(target=self._run, name="log-relay", daemon=True)

    def start(self) -> RelayThread:
        self.relay.step()  # the logs already there are followed from their end
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.done.wait(self.poll):
            with self.lock:
                self.relay.step()

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)
        with self.lock:
            self.relay.step()
            self.relay.close()
