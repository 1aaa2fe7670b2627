"""``cluster.json``: what the last render recorded — the settings, the slots and their roles.

Render is its one writer (:func:`dump`, into the files it writes); the health loop at its
start, ``status``, ``up`` and ``restart`` read it through :func:`parse` / :func:`read` as a
:class:`ClusterRecord`. It holds nothing that changes between two renders of the same
cluster (free memory, notes), so an unchanged cluster renders the same file. It carries
``version``; a file without one was written by 0.1 (the same fields; one without roles, by
a version before pools: every slot serves), see ``launcher.compat``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.slots import Roles, Slot

VERSION = 1
SLOT_FIELDS = ("name", "index", "port", "gpu", "memory", "concurrency", "vllm_memory")


@dataclass(frozen=True)
class ClusterRecord:
    settings: Settings
    slots: tuple[Slot, ...]
    roles: Roles
    mode: str = ""
    version: int = VERSION


class Planned(Protocol):
    """What a plan gives the record (the planner's ``Plan``)."""

    @property
    def mode(self) -> str: ...

    @property
    def slots(self) -> tuple[Slot, ...]: ...

    @property
    def roles(self) -> Roles: ...


def dump(settings: Settings, plan: Planned) -> str:
    slots = [{field: getattr(slot, field) for field in SLOT_FIELDS} for slot in plan.slots]
    data = {
        "version": VERSION,
        "settings": json.loads(settings.to_json()),
        "plan": {"mode": plan.mode, "slots": slots, "pool": plan.roles.as_dict()},
    }
    return json.dumps(data, indent=2) + "\n"


def parse(text: str) -> ClusterRecord:
    """The record in ``text``; ValueError, KeyError or TypeError when it is not one. Settings
    a newer version added are ignored."""
    data = json.loads(text)
    plan = data["plan"]
    slots = tuple(
        Slot(
            index=s["index"],
            port=s["port"],
            gpu=s["gpu"],
            memory=s["memory"],
            concurrency=int(s.get("concurrency", 1)),  # (recorded before concurrency: one at a time)
            vllm_memory=float(s.get("vllm_memory", 0.0)),
        )
        for s in plan["slots"]
    )
    pool = plan.get("pool")
    roles = (
        Roles(serving=int(pool["serving"]), spares=int(pool["spares"]), min_serving=int(pool["min_serving"]))
        if isinstance(pool, dict)
        else Roles(serving=len(slots))  # (rendered before pools: every slot serves)
    )
    return ClusterRecord(
        settings=Settings.from_mapping(data["settings"]),
        slots=slots,
        roles=roles,
        mode=str(plan.get("mode", "")),
        version=int(data.get("version", 0)),  # (0: written by 0.1)
    )


def read(layout: Layout) -> ClusterRecord | None:
    """The record of the cluster in ``layout``; None when there is none (or it is broken)."""
    try:
        return parse(layout.cluster_json.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
