"""Slot planning: how many instances fit on this box, and where each one goes.

Pure: an :class:`Inventory` (what the box has) and a :class:`Budget` (what one instance
needs) go in, a :class:`Plan` comes out. No NVML, no file system, no processes, so every
case is tested without a GPU; ``gpu.py`` builds the inventory on a real box.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cosyvoice_lb.common.sizes import GiB, format_size


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
class Budget:
    """What one instance needs and what to keep back.

    ``gpu_footprint`` is GPU memory per instance (on GPU boxes); ``host_footprint`` is
    host RAM per instance (on CPU-only boxes). ``reserve`` is kept free on every GPU
    (and in host RAM when planning CPU slots).
    """

    gpu_footprint: int
    host_footprint: int
    reserve: int = 1 * GiB
    max_instances: int | None = None
    gpu_fraction: float = 0.0  # added per instance as a share of the card (vLLM reserves 0.2)

    def on_card(self, gpu: Gpu) -> int:
        """GPU memory one instance takes on this card."""
        return self.gpu_footprint + int(self.gpu_fraction * gpu.total)


@dataclass(frozen=True)
class Slot:
    """One instance: its name, port and the device it is pinned to."""

    index: int
    port: int
    gpu: int | None  # NVML index, or None for a CPU slot
    memory: int  # bytes this slot is budgeted on its device

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
class DeviceFit:
    """How many instances one device holds, and what limits it."""

    device: str  # "gpu0" or "cpu"
    total: int
    free: int
    by_total: int  # fits in (total - reserve)
    by_free: int  # fits in what is free now
    fits: int
    limit: str  # which bound decided: total, free, cores, max-instances


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

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "capacity": self.capacity,
            **self.roles.as_dict(),
            "surge": self.surge,
            "slots": [
                {
                    "name": s.name,
                    "index": s.index,
                    "port": s.port,
                    "gpu": s.gpu,
                    "memory": s.memory,
                    "device": "cpu" if s.gpu is None else f"gpu{s.gpu}",
                }
                for s in self.slots
            ],
            "devices": [f.__dict__ for f in self.fits],
            "notes": list(self.notes),
        }


def _fit_gpu(gpu: Gpu, budget: Budget) -> DeviceFit:
    usable = gpu.total - budget.reserve
    each = budget.on_card(gpu)
    by_total = max(0, usable // each)
    # What is free now already excludes other processes' memory; keep the reserve too,
    # but never demand more headroom than the card has in total.
    by_free = max(0, (min(gpu.free, usable)) // each)
    fits = min(by_total, by_free)
    return DeviceFit(
        device=f"gpu{gpu.index}",
        total=gpu.total,
        free=gpu.free,
        by_total=by_total,
        by_free=by_free,
        fits=fits,
        limit="free" if by_free < by_total else "total",
    )


def _fit_cpu(inventory: Inventory, budget: Budget) -> DeviceFit:
    usable = inventory.ram_total - budget.reserve
    by_total = max(0, usable // budget.host_footprint)
    by_free = max(0, min(inventory.ram_available, usable) // budget.host_footprint)
    by_memory = min(by_total, by_free)
    fits = min(by_memory, max(1, inventory.cpu_cores))
    if fits < by_memory:
        limit = "cores"
    else:
        limit = "free" if by_free < by_total else "total"
    return DeviceFit(
        device="cpu",
        total=inventory.ram_total,
        free=inventory.ram_available,
        by_total=by_total,
        by_free=by_free,
        fits=fits,
        limit=limit,
    )


def plan(
    inventory: Inventory,
    budget: Budget,
    *,
    base_port: int = 7860,
    instances: int | None = None,
    force: bool = False,
    spares: int = 0,
    surge: int = 0,
    min_instances: int = 0,
) -> Plan:
    """Plan slots: as many as fit (``instances=None``), or exactly ``instances``, to serve;
    then ``spares`` (refused, as serving ones, past what fits), then up to ``surge`` parked
    slots for roll-outs, as many as memory leaves room for (noted when fewer).

    GPUs are filled one instance per card in turn (0, 1, 0, 1, ...) so load and
    memory spread evenly. Asking for more than fits is refused unless ``force``.
    """
    if spares < 0 or surge < 0 or min_instances < 0:
        raise PlanError("--spares, --surge and --min-instances cannot be negative")
    if budget.gpu_footprint <= 0 or budget.host_footprint <= 0:
        raise PlanError("the footprint must be larger than 0 (e.g. --footprint 5GiB)")
    if budget.reserve < 0:
        raise PlanError("the reserve cannot be negative (e.g. --reserve 1GiB)")
    if budget.max_instances is not None and budget.max_instances < 1:
        raise PlanError("--max-instances must be at least 1")
    if instances is not None and instances < 1:
        raise PlanError("--instances must be at least 1 (or 'auto')")
    if not 1 <= base_port <= 65535:
        raise PlanError(f"base port {base_port} is not a TCP port (1-65535)")

    notes: list[str] = []
    if inventory.gpus:
        mode = "gpu"
        fits = [_fit_gpu(g, budget) for g in inventory.gpus]
        devices: list[int | None] = [g.index for g in inventory.gpus]
        per_device: dict[int | None, int] = {g.index: budget.on_card(g) for g in inventory.gpus}
        per_slot = max(per_device.values())
        for fit in fits:
            if fit.fits == 0:
                notes.append(
                    f"{fit.device}: no instance fits ({format_size(fit.free)} free, "
                    f"{format_size(fit.total)} total, {format_size(max(per_device.values()))} "
                    f"per instance + {format_size(budget.reserve)} reserve)"
                )
    else:
        mode = "cpu"
        fits = [_fit_cpu(inventory, budget)]
        devices = [None]
        per_device = {None: budget.host_footprint}
        per_slot = budget.host_footprint
        notes.append(
            "no GPU found: planning CPU slots from "
            f"{inventory.cpu_cores} cores and {format_size(inventory.ram_available)} free RAM"
        )

    capacity = sum(f.fits for f in fits)
    # Memory is a hard limit (out of memory kills); CPU cores only share time. So an explicit
    # --instances N is refused past what fits in memory, and only noted past the core count.
    room = sum(min(f.by_total, f.by_free) for f in fits)
    if budget.max_instances is not None and capacity > budget.max_instances:
        notes.append(f"capped at --max-instances {budget.max_instances} (room for {capacity})")
        capacity = budget.max_instances
        fits = _cap(fits, budget.max_instances)
    if budget.max_instances is not None:
        room = min(room, budget.max_instances)

    spare_words = f" and {spares} spare{'s' if spares != 1 else ''}" if spares else ""
    if instances is None:
        count = capacity - spares
        if capacity == 0:
            raise PlanError(
                "no instance fits on this box: "
                + "; ".join(notes or ["lower --footprint or --reserve"])
                + ". Lower --footprint/--reserve, free memory, or use --instances N --force"
            )
        if count < 1:
            raise PlanError(
                f"room for {capacity} instance(s) only: none would serve beside --spares {spares}. "
                "Ask for fewer spares, lower --footprint, or give --instances N --force"
            )
    else:
        count = instances
        if count + spares > room and not force:
            raise PlanError(
                f"{count} instances{spare_words} requested but only {room} fit "
                f"({', '.join(f'{f.device}: {min(f.by_total, f.by_free)}' for f in fits)}; "
                f"{format_size(per_slot)} per instance). "
                "Ask for fewer, lower --footprint, or pass --force to start them anyway"
            )
        if count + spares > room:
            notes.append(f"--force: {count + spares} instances where {room} fit")
        elif count + spares > capacity and mode == "cpu":
            notes.append(f"{count + spares} instances on {inventory.cpu_cores} cores: they share the CPU")
    if min_instances > count:
        raise PlanError(
            f"--min-instances {min_instances} is above the {count} instances planned to serve: "
            "lower it, or raise --instances"
        )
    headroom = min(surge, max(0, room - count - spares))
    if headroom < surge:
        notes.append(
            f"--surge {surge}: room for {headroom} parked slot(s) beside {count + spares} instances; "
            "roll-outs surge with what there is, or drain first"
        )
    total = count + spares + headroom

    if base_port + total - 1 > 65535:  # before placing: a tiny footprint can "fit" billions
        raise PlanError(
            f"ports {base_port}..{base_port + total - 1} run past 65535: "
            "lower --base-port, or check --footprint (plain numbers are bytes)"
        )
    placement = _place(total, fits, devices)
    slots = tuple(
        Slot(index=i, port=base_port + i, gpu=device, memory=per_device[device]) for i, device in enumerate(placement)
    )
    pool = Roles(serving=count, spares=spares, min_serving=min_instances if 0 < min_instances < count else 0)
    return Plan(mode=mode, slots=slots, fits=tuple(fits), capacity=capacity, notes=tuple(notes), pool=pool)


def startable(
    inventory: Inventory, budget: Budget, running: tuple[Slot, ...], candidates: tuple[Slot, ...]
) -> list[Slot]:
    """Of ``candidates`` (parked slots), those that can start now beside the ``running``
    ones, in order: each device holds as many as fit in its memory (``inventory`` as
    :func:`with_own_slots` makes it, the running slots' memory counted free again)."""
    room: dict[int | None, int]
    if inventory.gpus:
        room = {g.index: _fit_gpu(g, budget).fits for g in inventory.gpus}
    else:
        fit = _fit_cpu(inventory, budget)
        room = {None: min(fit.by_total, fit.by_free)}  # (cores share time: memory is the bound)
    used: dict[int | None, int] = {}
    for slot in running:
        used[slot.gpu] = used.get(slot.gpu, 0) + 1
    chosen = []
    for slot in candidates:
        if used.get(slot.gpu, 0) < room.get(slot.gpu, 0):
            used[slot.gpu] = used.get(slot.gpu, 0) + 1
            chosen.append(slot)
    return chosen


def _cap(fits: list[DeviceFit], limit: int) -> list[DeviceFit]:
    """Trim per-device counts to ``limit`` in total, taking round-robin across devices."""
    taken = [0] * len(fits)
    left = limit
    while left:
        progressed = False
        for i, fit in enumerate(fits):
            if left and taken[i] < fit.fits:
                taken[i] += 1
                left -= 1
                progressed = True
        if not progressed:
            break
    return [
        DeviceFit(**{**f.__dict__, "fits": t, "limit": "max-instances" if t < f.fits else f.limit})
        for f, t in zip(fits, taken)
    ]


def _place(count: int, fits: list[DeviceFit], devices: list[int | None]) -> list[int | None]:
    """Round-robin over devices with room; forced extras keep going round-robin."""
    room = [f.fits for f in fits]
    placement: list[int | None] = []
    while len(placement) < count:
        placed = False
        for i, device in enumerate(devices):
            if len(placement) < count and room[i] > 0:
                placement.append(device)
                room[i] -= 1
                placed = True
        if not placed:  # over capacity (--force): spread the rest evenly
            for device in devices:
                if len(placement) < count:
                    placement.append(device)
    return placement


def with_own_slots(inventory: Inventory, slots: tuple[Slot, ...]) -> Inventory:
    """The inventory as a running cluster's own re-plan must see it: the memory its slots
    hold counts as free again (else every re-plan of a running cluster would shrink it)."""
    gpus = tuple(
        Gpu(
            index=g.index,
            total=g.total,
            name=g.name,
            free=min(g.total, g.free + sum(s.memory for s in slots if s.gpu == g.index)),
        )
        for g in inventory.gpus
    )
    ram = inventory.ram_available + sum(s.memory for s in slots if s.gpu is None)
    return Inventory(
        gpus=gpus,
        cpu_cores=inventory.cpu_cores,
        ram_total=inventory.ram_total,
        ram_available=min(inventory.ram_total, ram),
        source=inventory.source,
    )
