"""Text as a client writes it, for a streaming session (text in, audio out).

A voice agent sends its reply as its LLM makes it, a few characters at a time. Two ways to
speak it as it comes:

- :class:`Sentences`: sentence by sentence (every engine). A sentence is spoken once it is
  known to be complete: at ``! ?``, the full-width ends and line breaks at once; at ``. ;`` and
  ``...`` once the next character shows it was an end (``3.14`` and ``e.g. this`` are not:
  the sentence rules of ``audio.segments``); a sentence longer than ``max_chars`` goes in
  pieces cut at a clause break or a space.
- :class:`TextFeed`: the text itself, as an iterator of pieces that ends when the client's
  text does, for an engine that reads text while it speaks (upstream's bistream). Pieces end
  at a word's end, so the tokenizer never sees half a word.

Instance side: standard library only.
"""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Iterator
from typing import Any

from cosyvoice_lb.instance.audio.segments import sentence_spans, split_text

# Ends that need nothing after them to be ends (the full-width ones, ! and ?, closers after them).
_ENDS_AT_ONCE = re.compile(r"(?:[!?。｡！？；…]+[\"'”’」』）)\]】》〕»]*|[\n\r\u2028\u2029])\s*$")
# Where a piece of text may end for a tokenizer: after a space, a punctuation mark or a CJK character.
_WORD_END = re.compile(r"[\s\W\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]", re.UNICODE)


class Sentences:
    """Complete sentences out of text fed in pieces (pure). ``feed`` returns the sentences
    the new text completed, ``finish`` the rest; sentences are stripped, never empty."""

    def __init__(self, max_chars: int = 300):
        self.max_chars = max(1, max_chars)
        self.pending = ""

    def feed(self, delta: str) -> list[str]:
        self.pending += delta
        spans = sentence_spans(self.pending)
        if not spans:
            return []
        done = spans[:-1]
        start, end = spans[-1]
        if _ENDS_AT_ONCE.search(self.pending):
            done, start = spans, len(self.pending)
        out = [self.pending[a:b] for a, b in done]
        rest = self.pending[start:] if done or start == len(self.pending) else self.pending
        if len(rest.strip()) > self.max_chars:  # a run-on sentence: its pieces but the last
            pieces = split_text(rest.strip(), self.max_chars)
            out += pieces[:-1]
            rest = pieces[-1]
        self.pending = rest
        return [sentence.strip() for sentence in out if sentence.strip()]

    def finish(self) -> list[str]:
        rest, self.pending = self.pending, ""
        return [rest[a:b] for a, b in sentence_spans(rest)]


def word_pieces(pending: str, final: bool = False) -> tuple[str, str]:
    """(what may go to the tokenizer now, what waits for the rest of its word)."""
    if final:
        return pending, ""
    cut = 0
    for match in _WORD_END.finditer(pending):
        cut = match.end()
    return pending[:cut], pending[cut:]


class Stopped(Exception):
    """The session ended before its text did (its client left, or a limit closed it)."""


class TextFeed:
    """A session's text for an engine that reads it while it speaks: the event loop
    :meth:`put` s what the client sends and :meth:`end` s it; the engine's thread iterates
    (blocking while the client writes). ``lease``: the session's engine slot, told when the
    engine waits for the client (waiting for text is not a hang)."""

    def __init__(self, lease: Any = None, poll: float = 0.1):
        self.lease, self.poll = lease, poll
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._held = ""  # the end of a word still being written
        self._text: list[str] = []
        self._lock = threading.Lock()
        self.stopped = threading.Event()

    def put(self, delta: str) -> None:
        with self._lock:
            self._text.append(delta)
            ready, self._held = word_pieces(self._held + delta)
        if ready:
            self._queue.put(ready)

    def end(self) -> None:
        with self._lock:
            rest, self._held = self._held, ""
        if rest:
            self._queue.put(rest)
        self._queue.put(None)

    def stop(self) -> None:
        """The session is over: the engine's next read ends its text with :class:`Stopped`."""
        self.stopped.set()
        self._queue.put(None)

    def tail(self) -> str:
        """The last characters sent (a special token may start there and end in the next delta)."""
        with self._lock:
            return "".join(self._text[-16:])[-16:]

    def so_far(self) -> str:
        """Everything the client has sent so far."""
        with self._lock:
            return "".join(self._text)

    def __iter__(self) -> Iterator[str]:
        while True:
            try:
                piece = self._queue.get_nowait()
            except queue.Empty:
                piece = self._wait()
            if self.stopped.is_set():
                raise Stopped("the streaming session ended before its text did")
            if piece is None:
                return
            yield piece

    def _wait(self) -> str | None:
        if self.lease is not None:
            self.lease.waiting(True)
        try:
            while True:
                try:
                    return self._queue.get(timeout=self.poll)
                except queue.Empty:
                    if self.stopped.is_set():
                        return None
        finally:
            if self.lease is not None:
                self.lease.waiting(False)
