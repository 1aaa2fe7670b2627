"""``run/canary.json``: a model roll-out under comparison — which parked slots run the new
model, what differs from the serving instances' settings, how traffic reaches it (a mirrored
copy, or a real share) and the thresholds of its verdict.

The launcher writes it (``canary start``) and removes it (``abort``, ``promote``); render
reads it (the canary slots' commands, nginx's mirror or share), so does the health loop at
its start (the canary slots stay out of the serving rotation) and ``status``. It survives
``up`` and ``down``: the next ``up`` starts the canary again.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.common.setting_errors import setting_errors
from cosyvoice_lb.common.settings import Settings, declarations, flag
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.state.layout import Layout

MODES = ("mirror", "share")
# A setting the canary may change: what an instance is started with, and the Python that runs it.
_LAUNCHER_SIDE = ("python",)


class CanaryError(ValueError):
    """A canary that cannot be: the message says what to change."""


@dataclass(frozen=True)
class Thresholds:
    """What the canary's side may be, next to the serving side over the same requests, for
    its verdict to pass (each a setting of ``canary start``, with these defaults)."""

    min_requests: int = 20  # answers on each side before a verdict
    max_failure_increase: float = 0.02  # failure ratio: at most the serving side's plus this
    max_bad_audio_increase: float = 0.02  # bad-audio ratio: likewise
    max_error_increase: float = 0.10  # speech check's mean error (WER/CER): likewise
    max_latency_ratio: float = 1.5  # first-chunk and total p99: at most this times the serving side's
    max_similarity_drop: float = 0.10  # speaker similarity: at least the serving side's minus this


@dataclass(frozen=True)
class Canary:
    slots: tuple[str, ...]  # the parked slots it runs on
    changes: dict[str, Any]  # setting -> its value on the canary (what differs from serving)
    mode: str = "mirror"  # "mirror": nginx copies requests to it; "share": it serves them
    percent: float = 10.0  # of live synthesis requests
    started: float = 0.0  # epoch seconds
    thresholds: Thresholds = field(default_factory=Thresholds)

    def settings_for(self, serving: Settings) -> Settings:
        """The canary's settings: the serving instances' with its changes."""
        return dataclasses.replace(serving, **self.changes)

    def changed(self) -> str:
        """What it runs that the serving instances do not, as flags."""
        return ", ".join(f"{flag(k)} {v}" for k, v in sorted(self.changes.items()))

    def describe(self) -> str:
        return f"{', '.join(self.slots)} on {self.changed()} ({self.mode} {self.percent:g}%)"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def changeable() -> dict[str, dataclasses.Field]:
    """The settings a canary may change, by name."""
    return {f.name: f for f in declarations() if f.metadata["instance"] or f.name in _LAUNCHER_SIDE}


def parse_value(name: str, text: str) -> Any:
    """A setting's value from ``--set NAME=VALUE`` text, typed as its declaration says."""
    fields = changeable()
    if name not in fields:
        raise CanaryError(
            f"--set {name}: not a setting an instance is started with; these are: {', '.join(sorted(fields))}"
        )
    meta = fields[name].metadata
    if meta["is_flag"]:
        lowered = text.strip().lower()
        if lowered not in ("1", "0", "true", "false", "on", "off", "yes", "no"):
            raise CanaryError(f"--set {name}={text}: a switch takes true or false")
        return lowered in ("1", "true", "on", "yes")
    kind = meta["type"] or str
    try:
        value = kind(text)
    except ValueError:
        raise CanaryError(f"--set {name}={text}: not a {kind.__name__}") from None
    if meta["choices"] and value not in meta["choices"]:
        raise CanaryError(f"--set {name}={text}: one of {', '.join(meta['choices'])}")
    return value


def pinned_recogniser(serving: Settings, changes: dict[str, Any]) -> dict[str, Any]:
    """Both sides judged by the same ear: unless the canary names its own, it transcribes
    with the recogniser the serving side's ``--asr auto`` stands for (a canary on another
    engine would otherwise pick another one, or none)."""
    if "asr" in changes or serving.asr != "auto":
        return changes
    if serving.asr_model:
        return {**changes, "asr": "sherpa-onnx"}
    if serving.resolved_engine == "flite":
        return {**changes, "asr": "pocketsphinx"}
    return changes


def checked_changes(serving: Settings, changes: dict[str, Any]) -> dict[str, Any]:
    """``changes`` that make a canary: something differs from serving, and the result is a
    valid set of settings. Returns them with the recogniser pinned (:func:`pinned_recogniser`)."""
    differing = {k: v for k, v in changes.items() if getattr(serving, k) != v}
    if not differing:
        raise CanaryError(
            "the canary would run what the serving instances run: give --model-dir, --engine, --python "
            "or --set NAME=VALUE with something new"
        )
    canary = dataclasses.replace(serving, **differing)
    found = setting_errors(canary)
    if found:
        raise CanaryError(f"the canary's settings cannot work: {found[0]}")
    return pinned_recogniser(serving, differing)


def dump(canary: Canary) -> str:
    return json.dumps({"version": 1, **canary.as_dict()}, indent=2, sort_keys=True) + "\n"


def parse(text: str) -> Canary:
    data = json.loads(text)
    return Canary(
        slots=tuple(str(s) for s in data["slots"]),
        changes=dict(data["changes"]),
        mode=str(data.get("mode", "mirror")),
        percent=float(data.get("percent", 10.0)),
        started=float(data.get("started", 0.0)),
        thresholds=Thresholds(**data.get("thresholds", {})),
    )


def read(layout: Layout) -> Canary | None:
    """The canary in progress in ``layout``, or None (none, or a file that is not one)."""
    try:
        return parse(layout.canary_json.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def names(layout: Layout) -> frozenset[str]:
    """The slots a canary runs on (none: an empty set)."""
    found = read(layout)
    return frozenset(found.slots) if found else frozenset()


def displaced(layout: Layout, parked: set[str]) -> Canary | None:
    """A canary whose slots a new plan no longer parks (they serve now, or are gone): removed,
    and returned to be said; None when the canary (if any) still has its slots."""
    found = read(layout)
    if found is None or set(found.slots) <= parked:
        return None
    remove(layout)
    return found


def not_restarted(layout: Layout, asked: list[str] | None) -> None:
    """Refuse a restart by name of a canary's slot (``restart --all`` leaves it out): it
    never serves, so a restart's wait for it to serve would never end."""
    found = [n for n in asked or [] if n in names(layout)]
    if found:
        raise ClusterError(
            f"{', '.join(found)} runs the canary of a model roll-out, not a serving instance: "
            "'cosyvoice-lb canary abort' stops it ('canary start' again runs a fresh one)"
        )


def write(layout: Layout, canary: Canary) -> None:
    write_atomic(layout.canary_json, dump(canary), mode=0o600)


def remove(layout: Layout) -> None:
    layout.canary_json.unlink(missing_ok=True)
