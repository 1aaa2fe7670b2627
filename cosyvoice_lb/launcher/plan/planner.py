"""Slot planning: how many instances fit on this box, how many syntheses each runs at once,
and where each one goes.

Pure: an :class:`Inventory` (what the box has) and a :class:`Budget` (what one instance
needs, at how many syntheses) go in, a :class:`Plan` comes out. No NVML, no file system, no
processes, so every case is tested without a GPU; ``gpu.py`` builds the inventory on a real
box, ``footprint.py`` the budget from the settings. The records are in ``model.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from cosyvoice_lb.common.sizes import format_size
from cosyvoice_lb.launcher.plan.model import (
    Budget,
    DeviceFit,
    Gpu,
    Inventory,
    Plan,
    PlanError,
    Roles,
    Slot,
    VllmShare,
)

__all__ = [
    "Budget",
    "DeviceFit",
    "Gpu",
    "Inventory",
    "Plan",
    "PlanError",
    "Roles",
    "Slot",
    "VllmShare",
    "concurrency_on",
    "plan",
    "startable",
    "with_own_slots",
]


def concurrency_on(gpu: Gpu, budget: Budget) -> int:
    """Syntheses at once for an instance on this card: the budget's; with ``auto`` the most,
    up to the budget's, at which one instance fits in what the card has (at least 1)."""
    n = max(1, budget.concurrency)
    if budget.auto:
        room = min(gpu.free, gpu.total - budget.reserve)
        while n > 1 and budget.on_card(gpu, n) > room:
            n -= 1
    return n


def _fit_gpu(gpu: Gpu, budget: Budget) -> DeviceFit:
    n = concurrency_on(gpu, budget)
    usable = gpu.total - budget.reserve
    each = budget.on_card(gpu, n)
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
        concurrency=n,
        asked=max(1, budget.concurrency),
        each=each,
        vllm_memory=budget.vllm_fraction(gpu, n),
    )


def _fit_cpu(inventory: Inventory, budget: Budget) -> DeviceFit:
    n = max(1, budget.cpu_concurrency)
    each = budget.on_host(n)
    usable = inventory.ram_total - budget.reserve
    by_total = max(0, usable // each)
    by_free = max(0, min(inventory.ram_available, usable) // each)
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
        concurrency=n,
        asked=n,
        each=each,
    )


@dataclass(frozen=True)
class _Devices:
    """The devices a plan places slots on: each one's fit, and the memory a slot takes there."""

    mode: str  # "gpu" or "cpu"
    fits: list[DeviceFit]
    devices: list[int | None]  # NVML indexes, or [None] for the CPU
    per_device: dict[int | None, DeviceFit]  # each device's fit: what one slot takes there, at what concurrency
    notes: tuple[str, ...]

    @property
    def per_slot(self) -> int:
        """The most one slot takes on any device (for messages)."""
        return max(f.each for f in self.fits)


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
    if budget.concurrency < 1 or budget.cpu_concurrency < 1:
        raise PlanError("--instance-concurrency must be at least 1 (or 'auto')")
    if budget.max_instances is not None and budget.max_instances < 1:
        raise PlanError("--max-instances must be at least 1")
    if instances is not None and instances < 1:
        raise PlanError("--instances must be at least 1 (or 'auto')")
    if not 1 <= base_port <= 65535:
        raise PlanError(f"base port {base_port} is not a TCP port (1-65535)")


def _syntheses(n: int) -> str:
    return f"{n} synthes{'es' if n != 1 else 'is'}"


def _given_vllm(inventory: Inventory, budget: Budget) -> tuple[str, ...]:
    """An explicit --vllm-memory, checked on every card: refused where it leaves no room for
    one instance, noted where it gives vLLM less than it is estimated to need."""
    share = budget.vllm
    if share is None or not share.given:
        return ()
    notes = []
    asked = max(1, budget.concurrency)
    for gpu in inventory.gpus:
        n = concurrency_on(gpu, budget)
        reserved = int(share.given * gpu.total)
        usable = gpu.total - budget.reserve
        if not share.inside and budget.rest(1) <= usable < budget.on_card(gpu, 1):
            raise PlanError(
                f"--vllm-memory {share.given:g} reserves {format_size(reserved)} of gpu{gpu.index}'s "
                f"{format_size(gpu.total)} for each instance's vLLM: with the {format_size(budget.rest(1))} the "
                f"rest of an instance takes and the {format_size(budget.reserve)} reserve, not even one instance "
                f"fits. Lower --vllm-memory, or give 0 to have it planned "
                f"({share.planned(gpu.total, asked):g} of this card for {_syntheses(asked)} at once)"
            )
        if share.fixed and reserved < share.needs(n):
            notes.append(
                f"gpu{gpu.index}: --vllm-memory {share.given:g} gives each vLLM {format_size(reserved)}, less than "
                f"the {format_size(share.needs(n))} estimated for {_syntheses(n)} (weights, activations, KV "
                "cache): vLLM may refuse to start (0: planned)"
            )
        if share.inside and reserved > budget.rest(n):
            notes.append(
                f"gpu{gpu.index}: --vllm-memory {share.given:g} reserves {format_size(reserved)}, more than "
                f"--footprint's {format_size(budget.rest(n))} for the whole instance"
            )
    return tuple(notes)


def _gpu_devices(inventory: Inventory, budget: Budget) -> _Devices:
    """GPU placement: every card with how many instances fit on it, a note for each card
    that holds none (so a refusal says which card and why)."""
    notes = _given_vllm(inventory, budget)
    fits = [_fit_gpu(g, budget) for g in inventory.gpus]
    per_device: dict[int | None, DeviceFit] = {g.index: fit for g, fit in zip(inventory.gpus, fits)}
    notes += tuple(
        f"{fit.device}: no instance fits ({format_size(fit.free)} free, "
        f"{format_size(fit.total)} total, {format_size(fit.each)} "
        f"per instance at {_syntheses(fit.concurrency)} + {format_size(budget.reserve)} reserve)"
        for fit in fits
        if fit.fits == 0
    )
    return _Devices("gpu", fits, [g.index for g in inventory.gpus], per_device, notes)


def _cpu_devices(inventory: Inventory, budget: Budget) -> _Devices:
    """CPU placement, on a box without a usable GPU: one device, the host's RAM and cores."""
    note = (
        "no GPU found: planning CPU slots from "
        f"{inventory.cpu_cores} cores and {format_size(inventory.ram_available)} free RAM"
    )
    fit = _fit_cpu(inventory, budget)
    return _Devices("cpu", [fit], [None], {None: fit}, (note,))


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
    memory spread evenly. Asking for more than fits is refused unless ``force``. Each slot
    runs its device's concurrency (:func:`concurrency_on`) and, with vLLM, reserves its
    card's share.
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
        Slot(
            index=i,
            port=base_port + i,
            gpu=device,
            memory=devices.per_device[device].each,
            concurrency=devices.per_device[device].concurrency,
            vllm_memory=devices.per_device[device].vllm_memory,
        )
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
