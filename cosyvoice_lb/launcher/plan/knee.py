"""What `calibrate` makes of its sweep: throughput and memory against syntheses at once, the
knee that ``--instance-concurrency auto`` then stands for, and the memory each synthesis
more costs. Pure: the sweep itself runs in :mod:`~cosyvoice_lb.launcher.cluster.calibration`.

The knee is the fewest syntheses at once that reach ``KNEE_SHARE`` of the best throughput
measured: more would add queueing inside the model (each synthesis slower) for less than a
tenth more audio a second.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

KNEE_SHARE = 0.9


@dataclass(frozen=True)
class Point:
    """One level of the sweep: ``concurrency`` syntheses at once, for ``rounds`` rounds."""

    concurrency: int
    audio_seconds: float  # audio made at this level, all rounds
    wall_seconds: float  # time those rounds took
    peak_bytes: int = 0  # the instance's peak memory at this level (GPU or host RAM; 0: not read)

    @property
    def throughput(self) -> float:
        """Seconds of audio a second."""
        return self.audio_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0


def levels(most: int) -> list[int]:
    """The syntheses at once to measure: 1, 2, 4, ... up to ``most`` (which is always in)."""
    found, level = [], 1
    while level < most:
        found.append(level)
        level *= 2
    return [*found, max(1, most)]


def knee(points: Sequence[Point], share: float = KNEE_SHARE) -> int:
    """The fewest syntheses at once whose throughput is ``share`` of the best measured."""
    best = max(p.throughput for p in points)
    return min(p.concurrency for p in points if p.throughput >= share * best)


def per_synthesis(points: Sequence[Point]) -> int:
    """Memory each synthesis more costs: the growth of the peak from the fewest at once to the
    most, per synthesis (0 when it did not grow, or nothing was read)."""
    read = sorted((p for p in points if p.peak_bytes > 0), key=lambda p: p.concurrency)
    if len(read) < 2 or read[-1].concurrency == read[0].concurrency:
        return 0
    grown = read[-1].peak_bytes - read[0].peak_bytes
    return max(0, grown // (read[-1].concurrency - read[0].concurrency))


def sweep_entry(points: Sequence[Point], device: str, when: str) -> dict:
    """What a sweep adds to the calibration entry (``footprint.json``): the knee, and each
    level's throughput, on ``device`` (``gpu`` or ``cpu``)."""
    return {
        "device": device,
        "knee": knee(points),
        "throughput": {str(p.concurrency): round(p.throughput, 3) for p in points},
        "when": when,
    }


def measured_knee(entry: dict | None, device: str) -> int | None:
    """The knee a calibration on ``device`` measured (None: none, or measured on the other kind)."""
    if not entry or entry.get("device") != device or "knee" not in entry:
        return None
    try:
        return max(1, int(entry["knee"]))
    except (TypeError, ValueError):
        return None
