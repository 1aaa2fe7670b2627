"""What one instance needs, and so what fits on this box: the engine's default footprint,
what its flags add, what `calibrate` measured (run/footprint.json), or --footprint; then
the plan for this box's inventory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.sizes import parse_size
from cosyvoice_lb.launcher.cluster.layout import Layout, layout_for
from cosyvoice_lb.launcher.plan.gpu import inventory
from cosyvoice_lb.launcher.plan.planner import Budget, Plan, PlanError, Slot, plan, startable, with_own_slots

# Default memory one instance needs, per engine: GPU memory on GPU boxes, host RAM on
# CPU-only boxes. The espeak engine uses no GPU: on a GPU box it stands in for
# CosyVoice3 and is planned with CosyVoice3's footprint, so its plan is the model's plan.
# CosyVoice3 (plain, no TRT/vLLM): ~4.5 GB peak reported on an RTX 3060 in upstream's issues,
# rounded up for fragmentation and the warm-up peak.
ENGINE_FOOTPRINTS: dict[str, dict[str, str]] = {
    # espeak's host figure is measured: an instance's peak RSS (espeak-ng, Gradio UI), sampled
    # every 50 ms, while 20,000-character texts go through `up --instances 2` (the script of
    # tests/integration/test_long_text_memory.py, which holds the bound): ~200 MiB at rest,
    # 425/488 MiB one text at a time, 433/471 MiB two at once; one instance alone (its own
    # balancer) 422 MiB, two at once 585 MiB. 640 MiB covers them all.
    "espeak": {"gpu": "5GiB", "host": "640MiB"},
    # CosyVoice3 on CPU (no GPU): weights plus activations in host RAM.
    "cosyvoice3": {"gpu": "5GiB", "host": "6GiB"},
    # The benchmark load model stands in for CosyVoice3 on a GPU box, like espeak.
    "simulated": {"gpu": "5GiB", "host": "256MiB"},
}
# Added per instance by CosyVoice's engine flags (upstream's issues and code):
# one TensorRT context of the flow decoder ~4.5 GB (v2 reports; trt_concurrent=1);
# vLLM is started with gpu_memory_utilization=0.2 (upstream cli/model.py), i.e. it
# reserves a fifth of the card per instance whatever the model needs.
TRT_EXTRA = "4.5GiB"
VLLM_CARD_FRACTION = 0.2


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


def budget_for(settings: Settings, layout: Layout) -> tuple[Budget, str]:
    """Memory per instance, and where the figure came from."""
    engine = settings.resolved_engine
    defaults = ENGINE_FOOTPRINTS[engine]
    gpu, host, fraction, source = parse_size(defaults["gpu"]), parse_size(defaults["host"]), 0.0, "default"
    if engine == "cosyvoice3":
        if settings.load_trt:
            gpu += parse_size(TRT_EXTRA)
        if settings.load_vllm:
            fraction = VLLM_CARD_FRACTION
    measured = calibrated(layout, settings)
    if measured:
        gpu, fraction, source = int(measured["gpu_bytes"]), 0.0, f"calibrated {measured.get('when', '')}".strip()
    if settings.footprint:
        gpu = host = parse_size(settings.footprint)
        fraction, source = 0.0, "--footprint"
    return Budget(
        gpu_footprint=gpu,
        host_footprint=host,
        reserve=parse_size(settings.reserve),
        max_instances=settings.max_instances or None,
        gpu_fraction=fraction,
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
    """`cosyvoice-lb plan`: the plan, and where its figures came from."""

    plan: Plan
    gpu_source: str
    footprint_source: str

    def as_dict(self, engine: str) -> dict:
        return {
            **self.plan.as_dict(),
            "engine": engine,
            "gpu_source": self.gpu_source,
            "footprint_source": self.footprint_source,
        }


def plan_report(settings: Settings) -> PlanReport:
    result, source = make_plan(settings)
    return PlanReport(result, source, budget_for(settings, layout_for(settings))[1])
