"""What one instance needs, and so what fits on this box: the engine's default footprint
(:mod:`~cosyvoice_lb.launcher.plan.figures`), what its flags and each synthesis at once add,
what `calibrate` measured (run/footprint.json), or --footprint; with --load-vllm vLLM's
share of the card (--vllm-memory, or planned); then the plan for this box's inventory.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from cosyvoice_lb.common import checks
from cosyvoice_lb.common.concurrency import concurrency, explain
from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.sizes import GiB, parse_size
from cosyvoice_lb.launcher.plan import figures
from cosyvoice_lb.launcher.plan.explain import device_lines
from cosyvoice_lb.launcher.plan.figures import ENGINE_FOOTPRINTS
from cosyvoice_lb.launcher.plan.gpu import inventory
from cosyvoice_lb.launcher.plan.knee import measured_knee
from cosyvoice_lb.launcher.plan.planner import (
    Budget,
    Plan,
    PlanError,
    Slot,
    VllmShare,
    plan,
    startable,
    with_own_slots,
)
from cosyvoice_lb.launcher.state.layout import Layout, layout_for


def parse_instances(value: str) -> int | None:
    text = str(value).strip().lower()
    if text in ("", "auto"):
        return None
    if not text.isdigit() or int(text) < 1:
        raise PlanError(f"--instances {value!r}: give a number of instances (1 or more) or 'auto'")
    return int(text)


def flags_key(settings: Settings) -> str:
    """Which calibration a footprint belongs to: the engine (and model version) and the
    flags that change memory."""
    engine = settings.resolved_engine
    if engine == "cosyvoice3" and settings.model_dir:
        from cosyvoice_lb.instance.engines.cosyvoice import model_version

        try:
            engine = f"cosyvoice{model_version(settings.model_dir)}"
        except ValueError:
            pass
    flags = [f for f in ("load_trt", "load_vllm", "fp16") if getattr(settings, f)]
    return "+".join([engine, *flags])


def calibrated(layout: Layout, settings: Settings) -> dict | None:
    """The footprint `cosyvoice-lb calibrate` measured for this engine and these flags."""
    try:
        return json.loads(layout.footprint_json.read_text()).get(flags_key(settings))
    except (OSError, ValueError):
        return None


def vllm_cpu_kv_bytes(concurrency: int) -> int:
    """vLLM's KV cache on a CPU slot for ``concurrency`` syntheses (before rounding to GiB)."""
    tokens = max(figures.VLLM_MAX_MODEL_LEN, max(1, concurrency) * figures.VLLM_TOKENS_PER_SYNTHESIS)
    return int(tokens * figures.VLLM_KV_PER_TOKEN * (1 + figures.VLLM_HEADROOM))


def vllm_cpu_kv_space(concurrency: int) -> int:
    """``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) for an instance on a CPU slot with --load-vllm."""
    return max(1, -(-vllm_cpu_kv_bytes(concurrency) // GiB))


def vllm_share(settings: Settings) -> VllmShare | None:
    """vLLM's share of the card with --load-vllm (CosyVoice3 only): --vllm-memory as given,
    or (0) planned per card and concurrency from the figures."""
    if settings.resolved_engine != "cosyvoice3" or not settings.load_vllm:
        return None
    return VllmShare(
        given=settings.vllm_memory,
        fixed=figures.VLLM_WEIGHTS + figures.VLLM_ACTIVATIONS,
        kv_per_synthesis=figures.VLLM_TOKENS_PER_SYNTHESIS * figures.VLLM_KV_PER_TOKEN,
        kv_floor=figures.VLLM_MAX_MODEL_LEN * figures.VLLM_KV_PER_TOKEN,
        headroom=figures.VLLM_HEADROOM,
    )


@dataclass(frozen=True)
class Measured:
    """What `calibrate` measured, as the planner counts it: GPU memory outside vLLM's
    reservation at ``concurrency`` syntheses at once."""

    rest: int
    concurrency: int
    source: str


def measured_rest(entry: dict | None, vllm: bool) -> Measured | None:
    """A calibration entry as a footprint; None when there is none, or (with vLLM) when it
    predates --vllm-memory: it holds upstream's 0.2 of a card it does not name."""
    if not entry or "gpu_bytes" not in entry:  # (none, or a calibration on a CPU box)
        return None
    at = max(1, int(entry.get("concurrency", 1)))  # (entries without it ran one request at a time)
    source = f"calibrated {entry.get('when', '')}".strip() + f" at {at} at once"
    if not vllm:
        return Measured(int(entry["gpu_bytes"]), at, source)
    if "vllm_memory" not in entry or "gpu_total" not in entry:
        return None
    reserved = float(entry["vllm_memory"]) * int(entry["gpu_total"])
    peak = int(entry.get("peak_bytes", entry["gpu_bytes"]))
    return Measured(int(max(0.0, peak - reserved) * 1.1), at, source + ", vLLM's reservation apart")


def check_concurrency(settings: Settings) -> None:
    """Refuse --instance-concurrency and --vllm-memory that cannot be planned (as their own
    declarations check them: `plan` checks no other settings)."""
    for problem in (
        checks.concurrency("--instance-concurrency", settings.instance_concurrency),
        checks.fraction("--vllm-memory", settings.vllm_memory),
    ):
        if problem:
            raise PlanError(problem)


def budget_for(settings: Settings, layout: Layout) -> tuple[Budget, str]:
    """Memory per instance and per synthesis at once, and where the figure came from."""
    check_concurrency(settings)
    engine = settings.resolved_engine
    defaults = ENGINE_FOOTPRINTS[engine]
    trt = engine == "cosyvoice3" and settings.load_trt
    share = vllm_share(settings)
    gpu = parse_size(defaults["gpu"]) + (figures.TRT_PER_CONTEXT if trt else 0)
    gpu += figures.VLLM_OUTSIDE if share else 0
    per = figures.GPU_PER_SYNTHESIS + (figures.TRT_PER_CONTEXT if trt else 0)
    host, host_per, at, source = parse_size(defaults["host"]), figures.HOST_PER_SYNTHESIS[engine], 1, "default"
    if share:  # (a CPU slot: vLLM's engine process and its KV cache in host RAM)
        host += figures.VLLM_CPU_ENGINE + vllm_cpu_kv_space(1) * GiB
    entry = calibrated(layout, settings)
    measured = measured_rest(entry, share is not None)
    if measured:
        gpu, at, source = measured.rest, measured.concurrency, measured.source
    if entry and "per_synthesis_bytes" in entry:  # (what each synthesis more held, measured)
        if entry.get("device") == "gpu":
            per = int(entry["per_synthesis_bytes"])
        else:
            host_per = int(entry["per_synthesis_bytes"])
    if entry and entry.get("device") == "cpu" and "host_bytes" in entry:
        host, source = int(entry["host_bytes"]), f"calibrated {entry.get('when', '')} on this CPU"
    if settings.footprint:
        gpu = host = parse_size(settings.footprint)
        per = host_per = 0
        share = dataclasses.replace(share, inside=True) if share else None
        source = "--footprint"
    asked = settings.instance_concurrency
    auto = str(asked).strip() == "auto"
    knees = {device: measured_knee(entry, device) if auto else None for device in ("gpu", "cpu")}
    return Budget(
        gpu_footprint=gpu,
        host_footprint=host,
        reserve=parse_size(settings.reserve),
        max_instances=settings.max_instances or None,
        concurrency=knees["gpu"] or concurrency(asked, engine, settings.load_vllm, gpu=True),
        auto=auto,
        cpu_concurrency=knees["cpu"] or concurrency(asked, engine, settings.load_vllm, gpu=False),
        gpu_per_synthesis=per,
        host_per_synthesis=host_per,
        footprint_at=at,
        vllm=share,
    ), source


def make_plan(settings: Settings, own: tuple[Slot, ...] = ()) -> tuple[Plan, str]:
    """The plan for these settings on this box, and where the GPU list came from.

    ``own``: the slots of the cluster already running here, whose memory is theirs to keep.
    """
    budget, _ = budget_for(settings, layout_for(settings))
    box = with_own_slots(inventory(settings.gpus), own)
    result = plan(
        box,
        budget,
        base_port=settings.base_port,
        instances=parse_instances(settings.instances),
        force=settings.force,
        spares=settings.spares,
        surge=settings.surge,
        min_instances=settings.min_instances,
    )
    return result, box.source


def room_to_start(settings: Settings, running: tuple[Slot, ...], parked: tuple[Slot, ...]) -> list[Slot]:
    """Of the ``parked`` slots, those this box has memory for now beside the ``running``
    ones (asked of NVML, or of the host's RAM, now: other work may have taken some)."""
    budget, _ = budget_for(settings, layout_for(settings))
    return startable(with_own_slots(inventory(settings.gpus), running), budget, running, parked)


@dataclass(frozen=True)
class PlanReport:
    """`cosyvoice-lb plan`: the plan, where its figures came from, and why each instance runs
    the syntheses it does (``concurrency``: what --instance-concurrency stands for, on a GPU
    and on a CPU slot)."""

    plan: Plan
    gpu_source: str
    footprint_source: str
    concurrency: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def reasoning(self) -> list[str]:
        """One line per device: how many processes, how many syntheses each, and why."""
        return device_lines(self.plan, self.concurrency)

    def as_dict(self, engine: str) -> dict:
        return {
            **self.plan.as_dict(),
            "engine": engine,
            "gpu_source": self.gpu_source,
            "footprint_source": self.footprint_source,
            "concurrency": self.concurrency,
            "reasoning": self.reasoning,
        }


def concurrency_reasons(settings: Settings) -> dict[str, str]:
    """What --instance-concurrency stands for on a GPU and on a CPU slot, in words (a knee
    `calibrate` measured on this box, or the documented default)."""
    engine, value = settings.resolved_engine, settings.instance_concurrency
    entry = calibrated(layout_for(settings), settings) if str(value).strip() == "auto" else None
    reasons = {}
    for device in ("gpu", "cpu"):
        knee = measured_knee(entry, device)
        if knee and entry:
            reasons[device] = (
                f"--instance-concurrency auto = {knee} measured by calibrate {entry.get('when', '')}".strip()
            )
        else:
            reasons[device] = explain(value, engine, settings.load_vllm, gpu=device == "gpu")
    return reasons


def plan_report(settings: Settings) -> PlanReport:
    result, source = make_plan(settings)
    footprint_source = budget_for(settings, layout_for(settings))[1]
    return PlanReport(result, source, footprint_source, concurrency_reasons(settings))
