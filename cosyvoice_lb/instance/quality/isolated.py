"""A recogniser in a process of its own.

pocketsphinx holds Python's global lock while it decodes (measured: a 4 s answer took
437 ms, and another thread of the instance could not run for 362 ms of it), so a check in
a thread of the instance stalled its event loop and every answer being sent. In a process
of its own, at a lower CPU priority, a check takes nothing from an answer but the CPU a
free core gives it.

The process is spawned at the first check (what the recogniser is made of, ``make``, must
be picklable: a class, or a ``functools.partial``), ends with the instance
(``lineage.follow_parent``: a SIGKILLed instance runs no code), and is started again at the
next check after it died. Everything it says back is data: audio in, text out, or why not.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from cosyvoice_lb.instance.quality.recognizers import Recognizer, RecognizerError

LOAD_SECONDS = 120.0  # the recogniser's model loading in the new process, at most
NICENESS = 10  # added to the process's niceness: syntheses first


def serve(make: Callable[[], Recognizer], conn: Any, niceness: int = NICENESS) -> None:
    """The process's loop: make the recogniser, say its name (or why not), then answer
    each (audio, rate) with (True, text) or (False, why) until the pipe closes."""
    from cosyvoice_lb.instance.lineage import follow_parent

    follow_parent()
    try:
        os.nice(niceness)
    except OSError:
        pass
    try:
        recognizer = make()
    except RecognizerError as exc:
        conn.send((False, str(exc)))
        return
    conn.send((True, getattr(recognizer, "name", "recogniser")))
    while True:
        try:
            audio, rate = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send((True, recognizer.transcribe(audio, rate)))
        except RecognizerError as exc:
            conn.send((False, str(exc)))
        except Exception as exc:  # noqa: BLE001  (one answer's failure, said; the process goes on)
            conn.send((False, f"{type(exc).__name__}: {exc}"))


class Isolated:
    """``make``'s recogniser, run in a spawned process; the same interface
    (``transcribe``, ``name``). ``timeout``: the most one transcription may take."""

    def __init__(self, make: Callable[[], Recognizer], timeout: float = 120.0):
        self.make, self.timeout = make, timeout
        self.name = ""  # (the recogniser's own, said by its process once it loaded)
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Any = None
        self._start()  # (at once: a recogniser that cannot load says so at the first check)

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        mine, theirs = context.Pipe()
        proc = context.Process(target=serve, args=(self.make, theirs), name="speech-check", daemon=True)
        proc.start()
        theirs.close()
        if not mine.poll(LOAD_SECONDS):
            proc.kill()
            raise RecognizerError(f"the recogniser did not load within {LOAD_SECONDS:.0f}s")
        try:
            ok, said = mine.recv()
        except (EOFError, OSError):
            raise RecognizerError(f"the recogniser's process ended while loading (exit {proc.exitcode})") from None
        if not ok:
            raise RecognizerError(said)
        self.name, self._proc, self._conn = said, proc, mine

    def transcribe(self, audio: np.ndarray, rate: int) -> str:
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            try:
                self._conn.send((np.ascontiguousarray(audio, dtype=np.float32), rate))
                if not self._conn.poll(self.timeout):
                    self._proc.kill()  # (stuck: the next check starts a fresh one)
                    raise RecognizerError(f"the recogniser took longer than {self.timeout:.0f}s")
                ok, said = self._conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                raise RecognizerError(
                    f"the recogniser's process ended (exit {self._proc.exitcode}); a new one starts at the next check"
                ) from None
        if not ok:
            raise RecognizerError(said)
        return str(said)

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
