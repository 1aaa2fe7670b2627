"""The results dir of long-form jobs: one folder per job, its segments' audio and its result.

Layout (:func:`results_dir`: ``--job-results``, by default ``<state_dir>/jobs/results``)::

    <job_id>/plan.json        the segment size the job was split with (a resume splits alike)
    <job_id>/seg-00001.wav    each segment's audio as the balancer answered it (1-based)
    <job_id>/audio.<ext>      the joined result, in the job's response_format

Every file is written whole or not at all (:func:`cosyvoice_lb.common.atomic.write_atomic`,
synced: a segment the store records as done survives a crash of the box), so a file that is
there is a file that was finished. The writer is a parameter: a test gives one that fails as
a full disk does.

Errors: a write that fails is a :class:`ResultsError` whose message says what to do; a full
disk (ENOSPC, a quota) is its subclass :class:`DiskFull`, whose message starts with "the disk
is full" (the API answers 507 for a job that failed so).

The joined result is built as it is encoded: each segment is read, crossfaded into the one
before (:class:`cosyvoice_lb.instance.audio.segments.Joiner`, sample for sample what
``join`` gives) and fed to the instances' encoder (:mod:`cosyvoice_lb.instance.audio.formats`),
so a job of hours holds its encoded bytes and one segment's samples, not all of them as floats.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import soundfile

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.instance.audio.formats import OUTPUT_RATE, Encoder
from cosyvoice_lb.instance.audio.segments import Joiner
from cosyvoice_lb.instance.audio.wav import HEADER_BYTES, PRIVATE, wav_header
from cosyvoice_lb.jobs.model import Result

Writer = Callable[..., None]  # write_atomic(path, data, mode=..., durable=...)
FULL = (errno.ENOSPC, errno.EDQUOT)
PLAN = "plan.json"
# Formats whose encoder can hand out bytes as they come (the rest hold their file until the end)
STREAMED = ("wav", "pcm")


class ResultsError(RuntimeError):
    """A job's audio could not be written or read; the message says what to do."""


class DiskFull(ResultsError):
    """The results' disk (or its quota) is full."""


def results_dir(state_dir: str | Path, configured: str = "") -> Path:
    """The results dir: ``configured`` (--job-results) when given, else ``jobs/results`` in the
    state dir. Every reader and writer of jobs' audio asks here."""
    return Path(configured).expanduser() if configured else Path(state_dir).expanduser() / "jobs" / "results"


class Results:
    """The results dir ``root`` (made when first written to)."""

    def __init__(self, root: str | Path, writer: Writer = write_atomic) -> None:
        self.root = Path(root)
        self.writer = writer

    def folder(self, job_id: str) -> Path:
        if not job_id or "/" in job_id or job_id in (".", ".."):
            raise ValueError(f"job id {job_id!r}: not a name for a folder")
        return self.root / job_id

    def segment_path(self, job_id: str, index: int) -> Path:
        """Segment ``index`` (0-based, as the store counts) is ``seg-<index + 1>.wav``."""
        return self.folder(job_id) / f"seg-{index + 1:05d}.wav"

    def audio_path(self, job_id: str, fmt: str) -> Path:
        return self.folder(job_id) / f"audio.{fmt}"

    @contextmanager
    def _writing(self, what: str, path: Path) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            reason = exc.strerror or str(exc)
            if exc.errno in FULL:
                raise DiskFull(
                    f"the disk is full: free space on {self.root} ({what} could not be written: {reason}), "
                    "or remove finished jobs (DELETE /v1/audio/jobs/{id}), then send the job again"
                ) from exc
            raise ResultsError(
                f"{what} could not be written to {path.parent} ({reason}): make {self.root} writable by the "
                "user running cosyvoice-lb, then send the job again"
            ) from exc

    def _write(self, what: str, path: Path, data: bytes | memoryview) -> None:
        with self._writing(what, path):
            self.writer(path, data, mode=PRIVATE, durable=True)

    # --- the plan ------------------------------------------------------------------------

    def write_plan(self, job_id: str, segment_chars: int, total: int) -> None:
        data = json.dumps({"segment_chars": segment_chars, "segments": total})
        self._write("the job's plan", self.folder(job_id) / PLAN, data.encode())

    def plan(self, job_id: str) -> int | None:
        """The segment size the job was first split with, or None (a job not started yet)."""
        try:
            chars = json.loads((self.folder(job_id) / PLAN).read_text(encoding="utf-8"))["segment_chars"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return chars if isinstance(chars, int) and not isinstance(chars, bool) and chars >= 1 else None

    # --- segments ------------------------------------------------------------------------

    def write_segment(self, job_id: str, index: int, wav: bytes) -> None:
        self._write(f"segment {index + 1}'s audio", self.segment_path(job_id, index), wav)

    def has_segment(self, job_id: str, index: int) -> bool:
        """Whether segment ``index``'s file is there and reads as audio."""
        try:
            return bool(soundfile.info(str(self.segment_path(job_id, index))).frames > 0)
        except (OSError, RuntimeError):
            return False

    def read_segment(self, job_id: str, index: int) -> tuple[np.ndarray, int]:
        """Segment ``index``'s audio as mono float32, and its rate."""
        path = self.segment_path(job_id, index)
        try:
            audio, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
        except (OSError, RuntimeError) as exc:
            raise ResultsError(
                f"segment {index + 1}'s audio {path} cannot be read ({exc}): send the job again"
            ) from exc
        return audio.mean(axis=1).astype(np.float32), int(rate)

    # --- the result ----------------------------------------------------------------------

    def assemble(self, job_id: str, count: int, fmt: str) -> Result:
        """Join segments ``0 .. count - 1`` in order, encode them as ``fmt`` and write the
        result (atomically); its path and size. A format this Python cannot make is a
        ValueError saying so."""
        data = self.encoded(job_id, count, fmt)
        path = self.audio_path(job_id, fmt)
        self._write("the job's audio", path, memoryview(data))
        return Result(path=str(path.resolve()), bytes=len(data))

    def encoded(self, job_id: str, count: int, fmt: str) -> bytearray:
        if count < 1:
            raise ValueError(f"job {job_id}: no segments to join")
        joiner: Joiner | None = None
        encoder: Encoder | None = None
        data = bytearray()
        first_rate = 0
        for index in range(count):
            audio, rate = self.read_segment(job_id, index)
            if joiner is None or encoder is None:
                first_rate = rate
                joiner = Joiner(rate)
                encoder = Encoder(fmt, rate, stream=fmt in STREAMED)
            elif rate != first_rate:
                raise ResultsError(
                    f"segment {index + 1} is at {rate} Hz, segment 1 at {first_rate} Hz: the instances answered "
                    "at different rates; send the job again"
                )
            data += encoder.feed(joiner.feed(audio))
        assert joiner is not None and encoder is not None
        data += encoder.feed(joiner.finish())
        data += encoder.finish()
        if fmt == "wav":  # (streamed: the header's sizes said "unknown"; now they are known)
            data[:HEADER_BYTES] = wav_header(OUTPUT_RATE, len(data) - HEADER_BYTES)
        return data

    # --- removal and size ----------------------------------------------------------------

    def drop_segments(self, job_id: str) -> None:
        """The segments' files, once the result holds them (the result and plan stay)."""
        folder = self.folder(job_id)
        try:
            names = [entry.name for entry in os.scandir(folder)]
        except OSError:
            return
        for name in names:
            if name.startswith("seg-") and name.endswith(".wav"):
                try:
                    (folder / name).unlink()
                except OSError:
                    pass

    def remove(self, job_id: str) -> int:
        """Every file of the job (retention, a cancel, a failure); the bytes freed."""
        folder = self.folder(job_id)
        freed = tree_size(folder)
        shutil.rmtree(folder, ignore_errors=True)
        return freed

    def size(self) -> int:
        """The bytes every job's files take (for --outputs-max-size)."""
        return tree_size(self.root)


def tree_size(path: Path) -> int:
    """The bytes of the files under ``path`` (0 when it is not there); files that vanish
    meanwhile are skipped."""
    total = 0
    try:
        entries = list(os.scandir(path))
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                total += tree_size(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
        except OSError:
            pass
    return total
