"""The plan in words: one line per device saying how many processes it runs, how many
syntheses each runs at once, what one takes there and why (`cosyvoice-lb plan`, and its
``--json`` as ``reasoning``). Pure.
"""

from __future__ import annotations

from cosyvoice_lb.common.sizes import format_size
from cosyvoice_lb.launcher.plan.model import DeviceFit, Plan


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _share(fit: DeviceFit) -> str:
    """vLLM's share of the card in words ("" without vLLM)."""
    if not fit.vllm_memory:
        return ""
    return f"vLLM {round(fit.vllm_memory, 3):g} of {format_size(fit.total)} each, "


def _why(fit: DeviceFit, reasons: dict[str, str]) -> str:
    """What --instance-concurrency stands for here, and when auto was lowered to fit."""
    why = reasons.get("cpu" if fit.device == "cpu" else "gpu", "")
    if fit.concurrency < fit.asked:
        why += f", lowered to {fit.concurrency} for one process to fit this card"
    return f"; {why}" if why else ""


def device_line(fit: DeviceFit, processes: int, reasons: dict[str, str]) -> str:
    """``GPU 0: 3 processes x 8 syntheses = 24 at once (vLLM 0.019 of 141.0 GiB each, 15.7 GiB
    per process; --instance-concurrency auto = 8 with --load-vllm)``."""
    name = "CPU" if fit.device == "cpu" else f"GPU {fit.device.removeprefix('gpu')}"
    each = f"{_share(fit)}{format_size(fit.each)} per process{_why(fit, reasons)}"
    if processes == 0:
        return (
            f"{name}: no process: one at {_count(fit.concurrency, 'synthesis', 'syntheses')} takes "
            f"{format_size(fit.each)}, {format_size(fit.free)} free of {format_size(fit.total)} ({each})"
        )
    syntheses = _count(fit.concurrency, "synthesis", "syntheses")
    return (
        f"{name}: {_count(processes, 'process', 'processes')} x {syntheses} = "
        f"{processes * fit.concurrency} at once ({each})"
    )


def device_lines(plan: Plan, reasons: dict[str, str]) -> list[str]:
    """One :func:`device_line` per device of the plan; ``reasons``: what --instance-concurrency
    stands for on a ``gpu`` and on a ``cpu`` slot."""
    lines = []
    for fit in plan.fits:
        processes = sum(1 for s in plan.slots if ("cpu" if s.gpu is None else f"gpu{s.gpu}") == fit.device)
        lines.append(device_line(fit, processes, reasons))
    return lines
