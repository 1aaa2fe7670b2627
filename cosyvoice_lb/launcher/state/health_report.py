"""``health.json``: what the health loop last saw and decided, per instance, and the pool.

The loop is its one writer (:func:`write_report`, each step); status, the waits of ``up`` and
``restart``, roll-outs, the panel's metrics and a restarted loop read it through
:func:`read_report` as a :class:`HealthReport`, never as raw keys. It carries ``version``;
a file without one was written by 0.1, whose fields are the same (``launcher.compat``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.common.names import StrEnum
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.markers import DrainAction

VERSION = 1


class OnPurpose(StrEnum):
    """Why a ready instance is out of rotation on purpose (a track's ``on_purpose``); any other
    reason is an explanation for people (a track's ``reason``: not ready, hung, draining...).
    Its value is its words, as status and the logs show them and health.json keeps them."""

    SPARE = "warm spare: ready, enters rotation when an instance is taken out"
    PARKED = "parked: not started (a slot for surges, or scaled in)"
    DRAINED = "drained by hand (undrain to return it)"


@dataclass(frozen=True)
class Track:
    """What the loop remembers about one instance between probes.

    Why it is out: ``on_purpose`` (a state code tells apart) or ``reason`` (words for people:
    not ready, hung, draining, given up...), one at a time: whoever sets one clears the other,
    as a new reason replaces the last. health.json keeps either under its one ``"reason"``."""

    in_rotation: bool = False
    fails: int = 0
    goods: int = 0
    pid: int = 0
    ever_ready: bool = False  # this pid has answered ready at least once
    on_purpose: OnPurpose | None = None  # out of rotation on purpose (then ``reason`` is empty)
    reason: str = ""  # why it is out of rotation, or why it was last restarted (words for people)
    restarts: int = 0  # restarts the loop ordered
    recycle_at: int = 0  # requests after which this process is recycled (0: not set yet)
    # A planned stop: out of rotation since (epoch s; 0: none), then this action once the
    # requests in flight are done (see DrainAction), taken at signalled_at.
    draining_since: float = 0.0
    drain_signal: DrainAction | None = None
    signalled_at: float = 0.0
    ready_starts: int = 0  # the starts count when it was last ready: crash loops count from here
    failed: str = ""  # given up on (crash loop): why; it stays stopped until restarted by hand
    failed_at: float = 0.0  # when (epoch s)
    ordered: dict[str, int] = field(default_factory=dict)  # restarts the loop ordered, by reason (RESTART_REASONS)
    crashes: int = 0  # starts no order explains (see count_crashes): only ever grows
    bad_audio: str = ""  # what its /ping last said of bad audio (its warm-up's or a canary's), if ever
    bad_audio_at: float = 0.0  # when the loop saw it (epoch s)

    def __post_init__(self) -> None:
        if self.on_purpose is not None and self.reason:
            raise ValueError(
                f"out on purpose ({self.on_purpose.name}) and for a reason ({self.reason!r}): one at a time"
            )

    @property
    def reason_words(self) -> str:
        """Why it is out as people read it, and health.json keeps it: an OnPurpose's words,
        or the reason."""
        return str(self.on_purpose) if self.on_purpose is not None else self.reason


def track_from_dict(saved: dict) -> Track:
    """A track back from health.json (unknown keys from another version ignored)."""
    fields = {f.name for f in dataclasses.fields(Track)}
    values = {k: v for k, v in saved.items() if k in fields}
    signal = values.get("drain_signal")
    values["drain_signal"] = DrainAction(signal) if signal in tuple(a.value for a in DrainAction) else None
    values["on_purpose"], values["reason"] = parse_reason(values.get("reason", ""))
    return Track(**values)


def parse_reason(text: object) -> tuple[OnPurpose | None, str]:
    """A reason as health.json keeps it, as ``(on_purpose, reason)``: the words of an
    :class:`OnPurpose` are that member (and no reason), any other text stays text."""
    if not isinstance(text, str):
        return None, ""
    return (OnPurpose(text), "") if text in OnPurpose._value2member_map_ else (None, text)


def track_to_dict(track: Track) -> dict:
    values = dataclasses.asdict(track)
    del values["on_purpose"]  # (kept under "reason", as its words: the format has one key for both)
    values["drain_signal"] = track.drain_signal.value if track.drain_signal else ""
    values["reason"] = track.reason_words
    return values


@dataclass(frozen=True)
class HealthReport:
    """One report of the loop. ``updated`` 0: there is none (yet). ``pool``: how many are
    wanted in rotation, the roles, a roll-out's surge, the elastic scale and its decisions."""

    updated: float = 0.0
    tracks: dict[str, Track] = field(default_factory=dict)
    probe_seconds: dict[str, float] = field(default_factory=dict)
    pool: dict[str, Any] = field(default_factory=dict)
    version: int = VERSION

    def track(self, name: str) -> Track:
        return self.tracks.get(name) or Track()

    @property
    def out_of_rotation(self) -> frozenset[str]:
        """Instances the running loop has taken out."""
        return frozenset(name for name, track in self.tracks.items() if not track.in_rotation)


def write_report(layout: Layout, report: HealthReport) -> None:
    write_atomic(
        layout.health_json,
        json.dumps(
            {
                "version": report.version,
                "updated": report.updated,
                "instances": {name: track_to_dict(t) for name, t in report.tracks.items()},
                "probe_seconds": report.probe_seconds,
                "pool": report.pool,
            },
            indent=2,
        )
        + "\n",
    )


def read_report(layout: Layout) -> HealthReport:
    """What the loop last wrote; an empty report when there is none, or it cannot be read."""
    try:
        data = json.loads(layout.health_json.read_text())
        return parse_report(data if isinstance(data, dict) else {})
    except (OSError, ValueError, TypeError):
        return HealthReport()


def parse_report(data: dict[str, Any]) -> HealthReport:
    tracks = data.get("instances")
    probes = data.get("probe_seconds")
    pool = data.get("pool")
    return HealthReport(
        updated=float(data.get("updated", 0.0)),
        tracks={n: track_from_dict(t) for n, t in tracks.items() if isinstance(t, dict)}
        if isinstance(tracks, dict)
        else {},
        probe_seconds={n: float(s) for n, s in probes.items()} if isinstance(probes, dict) else {},
        pool=pool if isinstance(pool, dict) else {},
        version=int(data.get("version", 0)),  # (0: written by 0.1)
    )
