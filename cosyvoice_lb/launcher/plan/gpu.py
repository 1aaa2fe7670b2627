"""NVML adapter: what the box has (GPUs, cores, RAM) as a planner :class:`Inventory`.

Without a GPU or a driver, ``nvmlInit`` raises (``NVMLError_LibraryNotFound`` and
friends) and the inventory simply has no GPUs; the planner then plans CPU slots.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from cosyvoice_lb.common.sizes import SizeError, parse_size
from cosyvoice_lb.launcher.plan.planner import Gpu, Inventory, PlanError


def host_inventory(gpus: tuple[Gpu, ...] = (), source: str = "none") -> Inventory:
    memory = psutil.virtual_memory()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return Inventory(gpus=gpus, cpu_cores=cores, ram_total=memory.total, ram_available=memory.available, source=source)


def parse_gpus(text: str) -> tuple[Gpu, ...]:
    """``24GiB,24GiB`` -> two hypothetical cards with that much memory, all free."""
    sizes = [part for part in (p.strip() for p in text.split(",")) if part]
    if not sizes:
        raise PlanError("--gpus needs sizes, e.g. --gpus 24GiB,24GiB")
    try:
        totals = [parse_size(s) for s in sizes]
    except SizeError as exc:
        raise PlanError(f"--gpus: {exc}") from None
    return tuple(Gpu(index=i, total=total, free=total, name="hypothetical") for i, total in enumerate(totals))


def visible_indexes(uuids: list[str], value: str | None) -> list[int]:
    """NVML indexes that CUDA_VISIBLE_DEVICES (``value``) allows; all when unset.

    Entries are indexes (``0,2``) or GPU UUIDs, whole or a unique prefix (``GPU-8932f937``),
    as CUDA accepts them. Pure, so it is tested without a GPU.
    """
    if value is None or not value.strip():
        return list(range(len(uuids)))
    picked: list[int] = []
    for part in (p.strip() for p in value.split(",")):
        if part.isdigit():
            index = int(part)
        else:
            matches = [i for i, uuid in enumerate(uuids) if part and uuid.startswith(part)]
            if len(matches) != 1:
                break  # CUDA stops at the first entry it cannot resolve
            index = matches[0]
        if index >= len(uuids):
            break
        if index not in picked:
            picked.append(index)
    return picked


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _load(nvml: Any) -> Any:
    """``nvml`` as given (a test's fake), else the pynvml module; None when it is not installed."""
    if nvml is not None:
        return nvml
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _shutdown(nvml: Any) -> None:
    """``nvmlShutdown`` after a successful init; its own error is not worth failing a read for."""
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError:
        pass


@dataclass(frozen=True)
class GpuReading:
    """One card's telemetry now: memory in bytes, utilisation 0..1, Celsius, watts.

    A reading the card does not offer (``NVMLError_NotSupported``: some cards, MIG) is None.
    """

    index: int  # NVML's, as :class:`~cosyvoice_lb.launcher.plan.planner.Gpu` and the slots use it
    name: str
    uuid: str
    memory_used: int
    memory_total: int
    utilization: float | None = None
    temperature: float | None = None
    power: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The reading as plain JSON-able values."""
        return asdict(self)


def _optional(nvml: Any, read: Callable[[], float]) -> float | None:
    """``read()``, or None when NVML refuses it: one unsupported reading must not lose the others."""
    try:
        return float(read())
    except nvml.NVMLError:
        return None


def _reading(nvml: Any, index: int, handle: Any, uuid: str) -> GpuReading:
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    return GpuReading(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        uuid=uuid,
        memory_used=int(memory.used),
        memory_total=int(memory.total),
        utilization=_optional(nvml, lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100),
        temperature=_optional(nvml, lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
        power=_optional(nvml, lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000),  # NVML says milliwatts
    )


def gpu_readings(nvml: Any = None) -> tuple[GpuReading, ...]:
    """Every GPU CUDA_VISIBLE_DEVICES lets this process see, read now; () without NVML.

    No pynvml, no driver, or an NVML error while listing the cards: no readings, never an
    exception (``status`` must work on any box). ``nvml`` stands in for pynvml in tests.
    """
    nvml = _load(nvml)
    if nvml is None:
        return ()
    try:
        nvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound and friends, or a library that does not load at all
        return ()
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
        visible = visible_indexes(uuids, os.environ.get("CUDA_VISIBLE_DEVICES"))
        return tuple(_reading(nvml, index, handles[index], uuids[index]) for index in visible)
    except nvml.NVMLError:
        return ()
    finally:
        _shutdown(nvml)


def nvml_gpus() -> tuple[tuple[Gpu, ...], str]:
    """(GPUs as NVML sees them now, a word on where they came from)."""
    try:
        import pynvml
    except ImportError:
        return (), "none (pynvml is not installed: pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return (), f"none (NVML: {exc})"
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
        gpus = []
        for index in visible_indexes(uuids, os.environ.get("CUDA_VISIBLE_DEVICES")):
            handle = handles[index]
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            gpus.append(Gpu(index=index, total=int(memory.total), free=int(memory.free), name=_text(name)))
        return tuple(gpus), "nvml"
    finally:
        pynvml.nvmlShutdown()


def inventory(gpus: str = "") -> Inventory:
    """The box's inventory; ``gpus`` (``24GiB,24GiB``) plans for a hypothetical box."""
    if gpus:
        return host_inventory(parse_gpus(gpus), "--gpus")
    found, source = nvml_gpus()
    return host_inventory(found, source)


def device_used(index: int) -> int:
    """GPU memory in use on one card (bytes); 0 without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
    except pynvml.NVMLError:
        return 0
    finally:
        pynvml.nvmlShutdown()


def process_gpu_memory(pids: set[int], nvml: Any = None) -> dict[int, int]:
    """GPU memory (bytes) each of ``pids`` holds, summed over all GPUs; {} without NVML.

    Inside a container NVML may report host pids, which match nothing here: callers fall
    back to :func:`device_used`. ``nvml`` stands in for pynvml in tests.
    """
    nvml = _load(nvml)
    if nvml is None:
        return {}
    try:
        nvml.nvmlInit()
    except Exception:
        return {}
    try:
        used: dict[int, int] = {}
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in pids and proc.usedGpuMemory is not None:
                    used[proc.pid] = used.get(proc.pid, 0) + int(proc.usedGpuMemory)
        return used
    except nvml.NVMLError:
        return {}
    finally:
        _shutdown(nvml)
