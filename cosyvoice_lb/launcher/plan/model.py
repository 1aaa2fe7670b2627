"""What the planner takes and gives: the box (:class:`Inventory`), what one instance needs
(:class:`Budget`, with vLLM's share of the card in :class:`VllmShare`), and the result
(:class:`Plan`: its :class:`Slot` records, each device's :class:`DeviceFit`, the
:class:`Roles`). Plain values, no I/O; :mod:`~cosyvoice_lb.launcher.plan.planner` decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cosyvoice_lb.common.sizes import GiB
from cosyvoice_lb.launcher.state.slots import Roles, Slot

__all__ = ["Budget", "DeviceFit", "Gpu", "Inventory", "Plan", "PlanError", "Roles", "Slot", "VllmShare"]


class PlanError(ValueError):
    """The request cannot be planned; the message says why and what to change."""


@dataclass(frozen=True)
class Gpu:
    """One card as NVML reports it (bytes)."""

    index: int
    total: int
    free: int
    name: str = "GPU"


@dataclass(frozen=True)
class Inventory:
    """What the box has. ``gpus`` is empty on a box without a usable GPU."""

    gpus: tuple[Gpu, ...]
    cpu_cores: int
    ram_total: int
    ram_available: int
    source: str = "nvml"  # where the GPU list came from: nvml, --gpus, none


@dataclass(frozen=True)
class VllmShare:
    """vLLM's reservation in each instance: ``gpu_memory_utilization``, a share of the card's
    total memory that vLLM takes whatever it holds. ``given`` (--vllm-memory) is used as it
    is; 0: planned for the instance's concurrency from what vLLM holds (``fixed``: weights and
    activations; its KV cache: ``kv_per_synthesis`` a synthesis, at least ``kv_floor``), with
    ``headroom`` more, rounded up to 0.001 of the card. ``inside``: the footprint counts the
    reservation already (``--footprint``), so it is passed to the instance, not added."""

    given: float = 0.0
    fixed: int = 0
    kv_per_synthesis: int = 0
    kv_floor: int = 0
    headroom: float = 0.0
    inside: bool = False

    def needs(self, concurrency: int) -> int:
        """Bytes vLLM holds for ``concurrency`` syntheses at once, headroom included."""
        kv = max(self.kv_floor, concurrency * self.kv_per_synthesis)
        return int((self.fixed + kv) * (1 + self.headroom) + 0.5)

    def planned(self, total: int, concurrency: int) -> float:
        """The share of a card of ``total`` bytes that holds what vLLM needs, rounded up to 0.001."""
        return -(-self.needs(concurrency) * 1000 // total) / 1000

    def fraction(self, total: int, concurrency: int) -> float:
        """The share each instance's vLLM is given on a card of ``total`` bytes."""
        return self.given or self.planned(total, concurrency)


@dataclass(frozen=True)
class Budget:
    """What one instance needs and what to keep back.

    ``gpu_footprint`` is GPU memory per instance at ``footprint_at`` syntheses at once (on GPU
    boxes; outside vLLM's reservation); ``host_footprint`` is host RAM per instance at one
    synthesis (on CPU-only boxes). Each synthesis more adds ``gpu_per_synthesis`` /
    ``host_per_synthesis``. ``reserve`` is kept free on every GPU (and in host RAM when
    planning CPU slots). An instance runs ``concurrency`` syntheses at once on a GPU
    (``auto``: the default for its engine, lowered on a card that cannot hold one instance
    at it), ``cpu_concurrency`` on a CPU slot. ``vllm``: with --load-vllm, its share of the card.
    """

    gpu_footprint: int
    host_footprint: int
    reserve: int = 1 * GiB
    max_instances: int | None = None
    concurrency: int = 1
    auto: bool = False
    cpu_concurrency: int = 1
    gpu_per_synthesis: int = 0
    host_per_synthesis: int = 0
    footprint_at: int = 1
    vllm: VllmShare | None = None

    def rest(self, concurrency: int) -> int:
        """GPU memory of one instance outside vLLM's reservation at ``concurrency``
        syntheses (a footprint measured at more covers fewer)."""
        return self.gpu_footprint + max(0, concurrency - self.footprint_at) * self.gpu_per_synthesis

    def vllm_fraction(self, gpu: Gpu, concurrency: int) -> float:
        """vLLM's share of this card per instance (0.0 without vLLM)."""
        return self.vllm.fraction(gpu.total, concurrency) if self.vllm else 0.0

    def reservation(self, gpu: Gpu, concurrency: int) -> int:
        """The bytes of this card vLLM takes per instance, as counted in the plan."""
        if self.vllm is None or self.vllm.inside:
            return 0
        return int(self.vllm_fraction(gpu, concurrency) * gpu.total)

    def on_card(self, gpu: Gpu, concurrency: int = 1) -> int:
        """GPU memory one instance at ``concurrency`` syntheses takes on this card."""
        return self.rest(concurrency) + self.reservation(gpu, concurrency)

    def on_host(self, concurrency: int = 1) -> int:
        """Host RAM one CPU instance at ``concurrency`` syntheses takes."""
        return self.host_footprint + (max(1, concurrency) - 1) * self.host_per_synthesis


@dataclass(frozen=True)
class DeviceFit:
    """How many instances one device holds, at how many syntheses each, and what limits it."""

    device: str  # "gpu0" or "cpu"
    total: int
    free: int
    by_total: int  # fits in (total - reserve)
    by_free: int  # fits in what is free now
    fits: int
    limit: str  # which bound decided: total, free, cores, max-instances
    concurrency: int = 1  # syntheses at once in each instance here
    asked: int = 1  # what the settings asked for (auto: lowered to ``concurrency`` to fit one)
    each: int = 0  # bytes one instance takes here
    vllm_memory: float = 0.0  # vLLM's share of this card per instance (0.0: none)


@dataclass(frozen=True)
class Plan:
    mode: str  # "gpu" or "cpu"
    slots: tuple[Slot, ...]
    fits: tuple[DeviceFit, ...]
    capacity: int  # how many fit on the box (before --instances)
    notes: tuple[str, ...] = field(default_factory=tuple)
    pool: Roles | None = None  # None: every slot serves

    @property
    def roles(self) -> Roles:
        return self.pool or Roles(serving=len(self.slots))

    @property
    def surge(self) -> int:
        """Parked slots planned for roll-outs."""
        return len(self.slots) - self.roles.serving - self.roles.spares

    @property
    def syntheses(self) -> int:
        """Syntheses the serving slots run at once, all together (spares and parked slots
        run theirs when they take a place)."""
        return sum(s.concurrency for s in self.slots[: self.roles.serving])

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "capacity": self.capacity,
            **self.roles.as_dict(),
            "surge": self.surge,
            "syntheses": self.syntheses,
            "slots": [
                {
                    "name": s.name,
                    "index": s.index,
                    "port": s.port,
                    "gpu": s.gpu,
                    "memory": s.memory,
                    "device": "cpu" if s.gpu is None else f"gpu{s.gpu}",
                    "concurrency": s.concurrency,
                    "vllm_memory": s.vllm_memory,
                }
                for s in self.slots
            ],
            "devices": [f.__dict__ for f in self.fits],
            "notes": list(self.notes),
        }
