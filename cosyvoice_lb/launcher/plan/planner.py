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


@dataclass(frozen=True)
class _Devices:
    """The devices a plan places slots on: each one's fit, and the memory a slot takes there."""

    mode: str  # "gpu" or "cpu"
    fits: list[DeviceFit]
    devices: list[int | None]  # NVML indexes, or [None] for the CPU
    per_device: dict[int | None, int]  # bytes one slot is budgeted on each device
    per_slot: int  # the most one slot takes on any device (for messages)
    notes: tuple[str, ...]


@dataclass(frozen=True)
class _Room:
    """How many instances the box holds, after ``--max-instances``."""

    fits: list[DeviceFit]
    capacity: int  # what fits in memory and cores: as many as ``instances=None`` plans
    room: int  # what fits in memory alone: the most an explicit ``--instances`` may ask for
    notes: tuple[str, ...]


def _check_request(
    budget: Budget, *, base_port: int, instances: int | None, spares: int, surge: int, min_instances: int
) -> None:
    """Refuse a request no box could plan (negative counts, an empty footprint, a port that is
    not one) before looking at the box, so the message names the flag to fix."""
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


def _gpu_devices(inventory: Inventory, budget: Budget) -> _Devices:
    """GPU placement: every card with how many instances fit on it, a note for each card
    that holds none (so a refusal says which card and why)."""
    fits = [_fit_gpu(g, budget) for g in inventory.gpus]
    per_device: dict[int | None, int] = {g.index: budget.on_card(g) for g in inventory.gpus}
    per_slot = max(per_device.values())
    notes = tuple(
        f"{fit.device}: no instance fits ({format_size(fit.free)} free, "
        f"{format_size(fit.total)} total, {format_size(per_slot)} "
        f"per instance + {format_size(budget.reserve)} reserve)"
        for fit in fits
        if fit.fits == 0
    )
    return _Devices("gpu", fits, [g.index for g in inventory.gpus], per_device, per_slot, notes)


def _cpu_devices(inventory: Inventory, budget: Budget) -> _Devices:
    """CPU placement, on a box without a usable GPU: one device, the host's RAM and cores."""
    note = (
        "no GPU found: planning CPU slots from "
        f"{inventory.cpu_cores} cores and {format_size(inventory.ram_available)} free RAM"
    )
    per_slot = budget.host_footprint
    return _Devices("cpu", [_fit_cpu(inventory, budget)], [None], {None: per_slot}, per_slot, (note,))


def _room(fits: list[DeviceFit], budget: Budget) -> _Room:
    """Capacity and room of the devices, both capped at ``--max-instances`` (the per-device
    fits trimmed round-robin to match). Memory is a hard limit (out of memory kills); CPU
    cores only share time: so room counts memory only, capacity cores too."""
    capacity = sum(f.fits for f in fits)
    room = sum(min(f.by_total, f.by_free) for f in fits)
    cap = budget.max_instances
    if cap is None:
        return _Room(fits, capacity, room, ())
    if capacity <= cap:
        return _Room(fits, capacity, min(room, cap), ())
    note = f"capped at --max-instances {cap} (room for {capacity})"
    return _Room(_cap(fits, cap), cap, min(room, cap), (note,))


def _auto_serving(capacity: int, spares: int, notes: tuple[str, ...]) -> int:
    """How many serve when ``--instances`` is auto: what fits, less the spares; refused when
    nothing fits (``notes`` say why) or the spares would take every slot."""
    if capacity == 0:
        raise PlanError(
            "no instance fits on this box: "
            + "; ".join(notes or ["lower --footprint or --reserve"])
            + ". Lower --footprint/--reserve, free memory, or use --instances N --force"
        )
    if capacity - spares < 1:
        raise PlanError(
            f"room for {capacity} instance(s) only: none would serve beside --spares {spares}. "
            "Ask for fewer spares, lower --footprint, or give --instances N --force"
        )
    return capacity - spares


def _asked_serving(
    instances: int, spares: int, *, force: bool, room: _Room, devices: _Devices, cpu_cores: int
) -> tuple[str, ...]:
    """Check an explicit ``--instances`` (with the spares) against the room: refused past
    it unless ``force``; the notes say when it is forced, or when CPU slots share cores."""
    wanted = instances + spares
    if wanted <= room.room:
        if wanted > room.capacity and devices.mode == "cpu":
            return (f"{wanted} instances on {cpu_cores} cores: they share the CPU",)
        return ()
    if force:
        return (f"--force: {wanted} instances where {room.room} fit",)
    spare_words = f" and {spares} spare{'s' if spares != 1 else ''}" if spares else ""
    raise PlanError(
        f"{instances} instances{spare_words} requested but only {room.room} fit "
        f"({', '.join(f'{f.device}: {min(f.by_total, f.by_free)}' for f in room.fits)}; "
        f"{format_size(devices.per_slot)} per instance). "
        "Ask for fewer, lower --footprint, or pass --force to start them anyway"
    )


def _surge_slots(surge: int, room: int, occupied: int) -> tuple[int, tuple[str, ...]]:
    """How many of the ``surge`` parked slots fit beside the ``occupied`` ones (serving and
    spares), and a note when fewer than asked."""
    headroom = min(surge, max(0, room - occupied))
    if headroom == surge:
        return headroom, ()
    return headroom, (
        f"--surge {surge}: room for {headroom} parked slot(s) beside {occupied} instances; "
        "roll-outs surge with what there is, or drain first",
    )


def _roles(serving: int, spares: int, min_instances: int) -> Roles:
    """The slots' roles: ``serving`` in rotation, elastic down to ``min_instances`` (refused
    above ``serving``; below 1 or equal to it, a fixed number), then the spares."""
    if min_instances > serving:
        raise PlanError(
            f"--min-instances {min_instances} is above the {serving} instances planned to serve: "
            "lower it, or raise --instances"
        )
    return Roles(serving=serving, spares=spares, min_serving=min_instances if 0 < min_instances < serving else 0)


def _check_ports(base_port: int, total: int) -> None:
    """Refuse slots whose ports would run past 65535: checked before placing, since a tiny
    footprint can "fit" billions of slots."""
    if base_port + total - 1 > 65535:
        raise PlanError(
            f"ports {base_port}..{base_port + total - 1} run past 65535: "
            "lower --base-port, or check --footprint (plain numbers are bytes)"
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
    _check_request(
        budget, base_port=base_port, instances=instances, spares=spares, surge=surge, min_instances=min_instances
    )
    devices = _gpu_devices(inventory, budget) if inventory.gpus else _cpu_devices(inventory, budget)
    room = _room(devices.fits, budget)
    notes = devices.notes + room.notes
    if instances is None:
        count = _auto_serving(room.capacity, spares, notes)
    else:
        count = instances
        notes += _asked_serving(
            instances, spares, force=force, room=room, devices=devices, cpu_cores=inventory.cpu_cores
        )
    pool = _roles(count, spares, min_instances)
    headroom, surge_notes = _surge_slots(surge, room.room, count + spares)
    notes += surge_notes
    total = count + spares + headroom

    _check_ports(base_port, total)
    placement = _place(total, room.fits, devices.devices)
    slots = tuple(
        Slot(index=i, port=base_port + i, gpu=device, memory=devices.per_device[device])
        for i, device in enumerate(placement)
    )
    return Plan(mode=devices.mode, slots=slots, fits=tuple(room.fits), capacity=room.capacity, notes=notes, pool=pool)


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
