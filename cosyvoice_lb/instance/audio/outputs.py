"""The outputs dir: every instance writes results under unique names, and each keeps the dir
within its age and size limits (:mod:`cosyvoice_lb.instance.audio.sweep`; on Kubernetes, the
whole shared volume, the dirs of pods that are gone included)."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.instance.audio.sweep import StoredFile, expired, hold_alive, pod_volume, sweep
from cosyvoice_lb.instance.audio.wav import PRIVATE, WavBuilder, write_wav

__all__ = ["Outputs", "StoredFile", "expired"]


class Outputs:
    """The outputs dir: every instance writes unique names and keeps it bounded.

    ``volume``: the shared volume the dir is one pod's dir on (default: told by the layout,
    :func:`~cosyvoice_lb.instance.audio.sweep.pod_volume`, from ``environ``); its sweep then
    covers every pod's dir, and this instance marks its pod alive until :meth:`close`."""

    def __init__(
        self,
        directory: str,
        port: int,
        max_age: float,
        max_bytes: int,
        sweep_every: float = 30.0,
        *,
        volume: str | None = None,
        clock: Callable[[], float] = time.time,
        environ: Mapping[str, str] | None = None,
    ):
        self.dir = Path(directory) if directory else None
        self.port, self.max_age, self.max_bytes, self.sweep_every = port, max_age, max_bytes, sweep_every
        self.clock = clock
        self.last_sweep = 0.0
        self._sweeping = threading.Lock()  # (one sweep per process at a time; flock cannot tell threads apart)
        self.volume: Path | None = None
        self._alive: int | None = None
        if self.dir:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.volume = Path(volume) if volume else pod_volume(self.dir, os.environ if environ is None else environ)
            if self.volume is not None:
                self._alive = hold_alive(self.dir)

    def name(self, suffix: str = ".wav") -> str:
        return f"{time.strftime('%Y%m%d-%H%M%S')}-{self.port}-{uuid.uuid4().hex[:12]}{suffix}"

    def save(self, audio: np.ndarray | WavBuilder, rate: int) -> str:
        """Write one result (samples, or a built WAV file); returns its file name ("" without
        an outputs dir)."""
        if not self.dir:
            return ""
        name = self.name()
        if isinstance(audio, WavBuilder):
            write_atomic(self.dir / name, audio.data, mode=PRIVATE, durable=False)
        else:
            write_wav(self.dir / name, audio, rate)
        self.sweep()
        return name

    def sweep(self, force: bool = False) -> list[str]:
        """Delete what is past the bounds, at most every ``sweep_every`` seconds (``force``: now);
        returns what went (see :func:`~cosyvoice_lb.instance.audio.sweep.sweep`)."""
        now = self.clock()
        if not self.dir or (not force and now - self.last_sweep < self.sweep_every):
            return []
        if not self._sweeping.acquire(blocking=False):
            return []
        try:
            self.last_sweep = now
            return sweep(self.dir, self.volume, now, self.max_age, self.max_bytes)
        finally:
            self._sweeping.release()

    def close(self) -> None:
        """Let go of this instance's mark on its pod's dir (the process's end does it too)."""
        if self._alive is not None:
            os.close(self._alive)
            self._alive = None
