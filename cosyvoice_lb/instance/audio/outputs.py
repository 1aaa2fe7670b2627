"""The shared outputs dir: every instance writes results under unique names, and each keeps
the dir within its age and size limits."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.instance.audio.wav import PRIVATE, WavBuilder, write_wav


@dataclass(frozen=True)
class StoredFile:
    name: str
    mtime: float
    size: int


def expired(files: list[StoredFile], now: float, max_age: float, max_bytes: int) -> list[str]:
    """Names to delete: older than ``max_age``, then the oldest until the rest fit ``max_bytes``."""
    doomed = {f.name for f in files if now - f.mtime > max_age}
    kept = sorted((f for f in files if f.name not in doomed), key=lambda f: (f.mtime, f.name))
    total = sum(f.size for f in kept)
    for f in kept:
        if total <= max_bytes:
            break
        doomed.add(f.name)
        total -= f.size
    return sorted(doomed)


class Outputs:
    """The shared outputs dir: every instance writes unique names and keeps it bounded."""

    def __init__(self, directory: str, port: int, max_age: float, max_bytes: int, sweep_every: float = 30.0):
        self.dir = Path(directory) if directory else None
        self.port, self.max_age, self.max_bytes, self.sweep_every = port, max_age, max_bytes, sweep_every
        self.last_sweep = 0.0
        if self.dir:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)

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
        now = time.time()
        if not self.dir or (not force and now - self.last_sweep < self.sweep_every):
            return []
        self.last_sweep = now
        files = []
        for entry in os.scandir(self.dir):
            if entry.is_file() and entry.name.endswith(".wav"):
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # another instance swept it
                    continue
                files.append(StoredFile(entry.name, stat.st_mtime, stat.st_size))
        doomed = expired(files, now, self.max_age, self.max_bytes)
        for name in doomed:
            try:
                (self.dir / name).unlink()
            except FileNotFoundError:
                pass
        return doomed
