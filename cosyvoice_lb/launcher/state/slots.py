"""A cluster's slots and what each is for: what the planner makes, ``cluster.json`` records
and every part of the launcher reads back (the planner's other records are in
``plan/model.py``, which re-exports these)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """One instance: its name, port, the device it is pinned to, how many syntheses it runs
    at once and (with --load-vllm) the share of its card its vLLM reserves."""

    index: int
    port: int
    gpu: int | None  # NVML index, or None for a CPU slot
    memory: int  # bytes this slot is budgeted on its device
    concurrency: int = 1
    vllm_memory: float = 0.0  # 0.0: no vLLM

    @property
    def name(self) -> str:
        return f"instance-{self.index}"

    @property
    def env(self) -> dict[str, str]:
        """Environment that pins the instance to its device.

        NVML numbers cards by PCI bus; CUDA's default order is fastest first, so the index
        only means the same card with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
        """
        return {"CUDA_VISIBLE_DEVICES": "" if self.gpu is None else str(self.gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


@dataclass(frozen=True)
class Roles:
    """How the planned slots are used: ``serving`` in rotation (elastic: between
    ``min_serving`` and ``serving``), ``spares`` loaded out of rotation; the slots past
    ``serving + spares`` are parked (planned, not started) for roll-outs' surge."""

    serving: int
    spares: int = 0
    min_serving: int = 0  # 0: a fixed number (serving)

    @property
    def elastic(self) -> bool:
        return 0 < self.min_serving < self.serving

    @property
    def started(self) -> int:
        """How many instances `up` starts: those that serve at first, and the spares."""
        return (self.min_serving if self.elastic else self.serving) + self.spares

    def at_up(self, slots: int) -> list[str]:
        """What each of ``slots`` planned slots is at `up`, which starts the first ones:
        serving, a warm spare, or parked (for elastic growth, or for roll-outs' surge).
        Roles move between slots later: a spare takes an instance's place, a surge
        replacement an old one's."""
        floor = self.min_serving if self.elastic else self.serving
        return (
            ["serving"] * floor
            + ["warm spare"] * self.spares
            + ["parked (elastic)"] * (self.serving - floor)
            + ["parked (surge)"] * max(0, slots - self.serving - self.spares)
        )

    def as_dict(self) -> dict:
        return {"serving": self.serving, "spares": self.spares, "min_serving": self.min_serving}
