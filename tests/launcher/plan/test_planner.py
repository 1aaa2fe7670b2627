"""Slot planning (cosyvoice_lb/launcher/plan/planner.py): pure, so every case builds its inventory by hand."""

from __future__ import annotations

import json
import re

import pytest
from conftest import ROOT

from cosyvoice_lb.common.concurrency import auto_concurrency, explain
from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.sizes import GiB, MiB, format_size
from cosyvoice_lb.launcher.plan import figures
from cosyvoice_lb.launcher.plan.explain import device_lines
from cosyvoice_lb.launcher.plan.footprint import budget_for, concurrency_reasons
from cosyvoice_lb.launcher.plan.gpu import parse_gpus
from cosyvoice_lb.launcher.plan.planner import (
    Budget,
    Gpu,
    Inventory,
    Plan,
    PlanError,
    Slot,
    VllmShare,
    plan,
    startable,
    with_own_slots,
)
from cosyvoice_lb.launcher.state.layout import Layout, layout_for

FAKE_MODEL = ROOT / "tests" / "fake_models" / "Fun-CosyVoice3-0.5B"


def cards(*sizes_gib: float, free_gib: tuple[float, ...] | None = None) -> Inventory:
    """A GPU box: one card per size (GiB), all free unless ``free_gib`` says otherwise."""
    free = free_gib or sizes_gib
    gpus = tuple(Gpu(index=i, total=int(t * GiB), free=int(f * GiB)) for i, (t, f) in enumerate(zip(sizes_gib, free)))
    return Inventory(gpus=gpus, cpu_cores=16, ram_total=64 * GiB, ram_available=60 * GiB)


def cpu_box(cores: int = 8, ram_gib: float = 64, available_gib: float | None = None) -> Inventory:
    available = ram_gib if available_gib is None else available_gib
    return Inventory(
        gpus=(), cpu_cores=cores, ram_total=int(ram_gib * GiB), ram_available=int(available * GiB), source="none"
    )


def budget(gpu_gib: float = 5, host_mib: int = 512, reserve_gib: float = 1, max_instances: int | None = None) -> Budget:
    return Budget(
        gpu_footprint=int(gpu_gib * GiB),
        host_footprint=host_mib * MiB,
        reserve=int(reserve_gib * GiB),
        max_instances=max_instances,
    )


def devices(p: Plan) -> list[int | None]:
    return [s.gpu for s in p.slots]


def test_plan_error_is_a_value_error():
    assert issubclass(PlanError, ValueError)


# --- parse_gpus (gpu.py) ------------------------------------------------------------------


def test_parse_gpus_builds_hypothetical_cards_all_free():
    assert parse_gpus("24GiB,24GiB") == (
        Gpu(index=0, total=24 * GiB, free=24 * GiB, name="hypothetical"),
        Gpu(index=1, total=24 * GiB, free=24 * GiB, name="hypothetical"),
    )


def test_parse_gpus_mixed_units_spaces_and_empty_parts():
    gpus = parse_gpus(" 12G , ,24576MiB,")
    assert [(g.index, g.total, g.free) for g in gpus] == [(0, 12 * GiB, 12 * GiB), (1, 24 * GiB, 24 * GiB)]


@pytest.mark.parametrize("text", ["", " ", ",", " , "])
def test_parse_gpus_without_sizes_is_refused(text):
    with pytest.raises(PlanError, match="--gpus needs sizes"):
        parse_gpus(text)


def test_parse_gpus_bad_size_is_refused():
    with pytest.raises(PlanError, match="cannot read size 'lots'"):
        parse_gpus("24GiB,lots")


# --- GPU plans ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "card_gib, footprint_gib, fits",
    [
        (12, 5, 2),  # (12 - 1) // 5
        (12, 6, 1),  # (12 - 1) // 6
        (24, 5, 4),  # (24 - 1) // 5
        (24, 6, 3),  # (24 - 1) // 6
    ],
)
def test_seed_table_instances_per_card(card_gib, footprint_gib, fits):
    p = plan(cards(card_gib), budget(gpu_gib=footprint_gib))
    assert p.mode == "gpu"
    assert p.capacity == fits
    assert devices(p) == [0] * fits
    assert [s.memory for s in p.slots] == [footprint_gib * GiB] * fits
    (fit,) = p.fits
    assert (fit.device, fit.fits, fit.by_total, fit.limit) == ("gpu0", fits, fits, "total")
    assert p.notes == ()


@pytest.mark.parametrize(
    "sizes, footprint_gib, expected",
    [
        ((24, 24), 5, [0, 1, 0, 1, 0, 1, 0, 1]),
        ((24, 24), 6, [0, 1, 0, 1, 0, 1]),
        ((12, 24), 5, [0, 1, 0, 1, 1, 1]),  # the small card fills first, the big one keeps going
        ((12, 12, 12), 5, [0, 1, 2, 0, 1, 2]),
    ],
)
def test_several_cards_are_filled_in_turn(sizes, footprint_gib, expected):
    p = plan(cards(*sizes), budget(gpu_gib=footprint_gib))
    assert devices(p) == expected
    assert p.capacity == len(expected)
    assert [f.device for f in p.fits] == [f"gpu{i}" for i in range(len(sizes))]


def test_slots_get_consecutive_ports_names_and_a_pinned_device():
    p = plan(cards(24, 24), budget(), base_port=9000)
    assert [s.port for s in p.slots] == list(range(9000, 9008))
    assert [s.index for s in p.slots] == list(range(8))
    assert [s.name for s in p.slots] == [f"instance-{i}" for i in range(8)]
    assert [s.env for s in p.slots] == [
        {"CUDA_VISIBLE_DEVICES": str(i % 2), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"} for i in range(8)
    ]


def test_slot_env_pins_the_nvml_index_not_the_position():
    # CUDA_VISIBLE_DEVICES=1,3 on the launcher: NVML indexes 1 and 3 are what the box offers.
    inventory = Inventory(
        gpus=(Gpu(1, 24 * GiB, 24 * GiB), Gpu(3, 24 * GiB, 24 * GiB)),
        cpu_cores=8,
        ram_total=64 * GiB,
        ram_available=64 * GiB,
    )
    p = plan(inventory, budget(), instances=3)
    assert devices(p) == [1, 3, 1]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in p.slots] == ["1", "3", "1"]
    assert [f.device for f in p.fits] == ["gpu1", "gpu3"]


def test_default_base_port_is_7860():
    assert [s.port for s in plan(cards(12), budget()).slots] == [7860, 7861]


@pytest.mark.parametrize(
    "free_gib, fits, limit",
    [
        (24, 4, "total"),
        (23.5, 4, "total"),  # free beyond (total - reserve) does not count twice
        (20, 4, "total"),
        (19.9, 3, "free"),  # another process holds ~4 GiB
        (10, 2, "free"),
        (5, 1, "free"),
    ],
)
def test_free_memory_limits_a_card(free_gib, fits, limit):
    p = plan(cards(24, free_gib=(free_gib,)), budget())
    (fit,) = p.fits
    assert (fit.fits, fit.by_total, fit.limit) == (fits, 4, limit)
    assert fit.free == int(free_gib * GiB) and fit.total == 24 * GiB
    assert p.capacity == fits


def test_a_busy_card_gets_fewer_slots_and_the_plan_notes_a_full_one():
    p = plan(cards(24, 24, 24, free_gib=(24, 6, 2)), budget())
    assert [f.fits for f in p.fits] == [4, 1, 0]
    assert devices(p) == [0, 1, 0, 0, 0]
    (note,) = p.notes
    assert note.startswith("gpu2: no instance fits")
    assert "2.0 GiB free" in note and "24.0 GiB total" in note and "5.0 GiB per instance" in note


@pytest.mark.parametrize(
    "reserve_gib, fits",
    [
        (0, 2),  # 10 // 5
        (1, 1),  # 9 // 5
        (4.9, 1),
        (5, 1),
    ],
)
def test_reserve_is_kept_back_on_each_card(reserve_gib, fits):
    p = plan(cards(10, 10), budget(reserve_gib=reserve_gib))
    assert [f.fits for f in p.fits] == [fits, fits]


def test_reserve_larger_than_the_card_fits_nothing():
    with pytest.raises(PlanError, match="no instance fits"):
        plan(cards(4), budget(reserve_gib=5))


@pytest.mark.parametrize("inventory", [cards(4), cards(4, 4), cards(24, free_gib=(3,))])
def test_zero_capacity_is_refused_with_the_reason(inventory):
    with pytest.raises(PlanError) as caught:
        plan(inventory, budget())
    message = str(caught.value)
    assert message.startswith("no instance fits on this box: gpu0: no instance fits")
    assert "--footprint" in message and "--force" in message


def test_max_instances_caps_and_spreads_across_cards():
    p = plan(cards(24, 24), budget(max_instances=3))
    assert p.capacity == 3
    assert devices(p) == [0, 1, 0]
    assert [(f.fits, f.limit) for f in p.fits] == [(2, "max-instances"), (1, "max-instances")]
    assert [(f.by_total, f.by_free) for f in p.fits] == [(4, 4), (4, 4)]  # the room is still reported
    assert p.notes == ("capped at --max-instances 3 (room for 8)",)


def test_max_instances_skips_a_full_card_when_spreading():
    p = plan(cards(24, 24, 24, free_gib=(24, 2, 24)), budget(max_instances=3))
    assert devices(p) == [0, 2, 0]
    assert [(f.fits, f.limit) for f in p.fits] == [(2, "max-instances"), (0, "free"), (1, "max-instances")]


@pytest.mark.parametrize("max_instances", [8, 9, 100])
def test_max_instances_at_or_above_capacity_changes_nothing(max_instances):
    p = plan(cards(24, 24), budget(max_instances=max_instances))
    assert p.capacity == 8 and len(p.slots) == 8
    assert [f.limit for f in p.fits] == ["total", "total"]
    assert p.notes == ()


@pytest.mark.parametrize(
    "instances, expected",
    [
        (1, [0]),
        (3, [0, 1, 0]),
        (8, [0, 1, 0, 1, 0, 1, 0, 1]),
    ],
)
def test_instances_within_capacity(instances, expected):
    p = plan(cards(24, 24), budget(), instances=instances)
    assert devices(p) == expected
    assert p.capacity == 8  # capacity is what fits, not what was asked for
    assert p.notes == ()


def test_instances_respects_per_card_room():
    p = plan(cards(24, 24, free_gib=(24, 6)), budget(), instances=4)
    assert devices(p) == [0, 1, 0, 0]


def test_instances_beyond_capacity_is_refused():
    with pytest.raises(PlanError) as caught:
        plan(cards(24, 24), budget(), instances=9)
    message = str(caught.value)
    assert "9 instances requested but only 8 fit" in message
    assert "gpu0: 4, gpu1: 4" in message and "5.0 GiB per instance" in message
    assert "--force" in message


def test_instances_beyond_a_max_instances_cap_is_refused():
    with pytest.raises(PlanError, match="4 instances requested but only 3 fit"):
        plan(cards(24, 24), budget(max_instances=3), instances=4)


@pytest.mark.parametrize(
    "inventory, instances, expected",
    [
        (cards(24, 24), 9, [0, 1, 0, 1, 0, 1, 0, 1, 0]),
        (cards(24, 24), 11, [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0]),
        (cards(12), 4, [0, 0, 0, 0]),
        (cards(4, 4), 3, [0, 1, 0]),  # nothing fits anywhere: still round-robin
        (cards(4), 2, [0, 0]),
    ],
)
def test_force_places_extra_instances_round_robin(inventory, instances, expected):
    p = plan(inventory, budget(), instances=instances, force=True)
    assert devices(p) == expected
    assert [s.port for s in p.slots] == list(range(7860, 7860 + instances))
    assert all(s.memory == 5 * GiB for s in p.slots)
    assert f"--force: {instances} instances where {p.capacity} fit" in p.notes


def test_force_within_capacity_adds_no_note():
    p = plan(cards(24), budget(), instances=2, force=True)
    assert devices(p) == [0, 0] and p.notes == ()


# --- CPU plans ----------------------------------------------------------------------------


def test_cpu_plan_is_limited_by_cores():
    p = plan(cpu_box(cores=4, ram_gib=64), budget())
    assert p.mode == "cpu"
    assert p.capacity == 4
    assert devices(p) == [None] * 4
    assert [s.memory for s in p.slots] == [512 * MiB] * 4  # host footprint, not GPU footprint
    assert [s.env for s in p.slots] == [{"CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}] * 4
    (fit,) = p.fits
    assert (fit.device, fit.fits, fit.limit) == ("cpu", 4, "cores")
    assert fit.by_total == 126 and fit.by_free == 126  # (64 GiB - 1 GiB) / 512 MiB
    assert p.notes == ("no GPU found: planning CPU slots from 4 cores and 64.0 GiB free RAM",)


@pytest.mark.parametrize(
    "ram_gib, available_gib, fits, limit",
    [
        (64, 2, 4, "free"),  # 2 GiB free / 512 MiB
        (64, 1.9, 3, "free"),
        (3, 3, 4, "total"),  # (3 GiB - 1 GiB reserve) / 512 MiB
        (2, 2, 2, "total"),
    ],
)
def test_cpu_plan_is_limited_by_ram(ram_gib, available_gib, fits, limit):
    p = plan(cpu_box(cores=32, ram_gib=ram_gib, available_gib=available_gib), budget())
    assert p.capacity == fits
    (fit,) = p.fits
    assert (fit.fits, fit.limit) == (fits, limit)


def test_cpu_plan_uses_the_ram_reserve():
    assert plan(cpu_box(cores=32, ram_gib=3), budget(reserve_gib=0)).capacity == 6
    assert plan(cpu_box(cores=32, ram_gib=3), budget(reserve_gib=2)).capacity == 2


@pytest.mark.parametrize("cores", [0, 1])
def test_cpu_plan_always_allows_one_instance_per_box(cores):
    assert plan(cpu_box(cores=cores), budget()).capacity == 1


def test_cpu_plan_without_ram_is_refused():
    with pytest.raises(PlanError, match="no instance fits on this box: no GPU found"):
        plan(cpu_box(cores=8, ram_gib=1), budget())


def test_cpu_plan_instances_and_force():
    assert devices(plan(cpu_box(cores=2), budget(), instances=2)) == [None, None]
    # More instances than cores is allowed (they share time), and said.
    more = plan(cpu_box(cores=2), budget(), instances=3)
    assert devices(more) == [None] * 3 and "3 instances on 2 cores: they share the CPU" in more.notes
    # More than fits in RAM is refused unless forced.
    with pytest.raises(PlanError, match="5 instances requested but only 4 fit \\(cpu: 4; 512 MiB per instance\\)"):
        plan(cpu_box(cores=2, ram_gib=3), budget(), instances=5)
    assert devices(plan(cpu_box(cores=2, ram_gib=3), budget(), instances=5, force=True)) == [None] * 5


def test_cpu_plan_max_instances():
    p = plan(cpu_box(cores=8), budget(max_instances=3))
    assert p.capacity == 3 and len(p.slots) == 3
    assert p.fits[0].limit == "max-instances"


# --- invalid requests ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "the_budget, kwargs, match",
    [
        (Budget(gpu_footprint=0, host_footprint=512 * MiB), {}, "footprint must be larger than 0"),
        (Budget(gpu_footprint=-GiB, host_footprint=512 * MiB), {}, "footprint must be larger than 0"),
        (Budget(gpu_footprint=5 * GiB, host_footprint=0), {}, "footprint must be larger than 0"),
        (Budget(gpu_footprint=5 * GiB, host_footprint=MiB, reserve=-1), {}, "reserve cannot be negative"),
        (Budget(gpu_footprint=5 * GiB, host_footprint=MiB, max_instances=0), {}, "--max-instances must be at least 1"),
        (Budget(gpu_footprint=5 * GiB, host_footprint=MiB), {"instances": 0}, "--instances must be at least 1"),
        (Budget(gpu_footprint=5 * GiB, host_footprint=MiB), {"instances": -2}, "--instances must be at least 1"),
        (Budget(gpu_footprint=5 * GiB, host_footprint=MiB), {"base_port": 0}, "base port 0 is not a TCP port"),
        (Budget(gpu_footprint=5 * GiB, host_footprint=MiB), {"base_port": 65536}, "base port 65536 is not a TCP port"),
    ],
)
def test_invalid_requests_are_refused(the_budget, kwargs, match):
    for inventory in (cards(24), cpu_box()):
        with pytest.raises(PlanError, match=match):
            plan(inventory, the_budget, **kwargs)


@pytest.mark.parametrize("base_port, ok", [(65528, True), (65529, False), (65535, False)])
def test_ports_past_65535_are_refused(base_port, ok):
    # eight slots: base .. base + 7
    if ok:
        assert plan(cards(24, 24), budget(), base_port=base_port).slots[-1].port == 65535
    else:
        with pytest.raises(PlanError, match=f"ports {base_port}\\.\\.{base_port + 7} run past 65535"):
            plan(cards(24, 24), budget(), base_port=base_port)


def test_a_tiny_footprint_is_refused_before_placing_billions_of_slots():
    # plain numbers are bytes: "--footprint 5" means five bytes
    with pytest.raises(PlanError, match="plain numbers are bytes"):
        plan(cards(12, 4), Budget(gpu_footprint=5, host_footprint=512 * MiB))


def test_one_slot_on_the_last_port():
    assert [s.port for s in plan(cards(24), budget(), base_port=65535, instances=1).slots] == [65535]


# --- Plan.as_dict -------------------------------------------------------------------------


def test_as_dict_json_shape():
    p = plan(cards(24, 12), budget(max_instances=3))
    data = json.loads(json.dumps(p.as_dict()))  # survives JSON unchanged
    assert data == p.as_dict()
    assert set(data) == {
        "slots",
        "mode",
        "capacity",
        "devices",
        "notes",
        "serving",
        "spares",
        "min_serving",
        "surge",
        "syntheses",
    }
    assert data["mode"] == "gpu" and data["capacity"] == 3 and data["syntheses"] == 3
    one = {"memory": 5 * GiB, "concurrency": 1, "vllm_memory": 0.0}
    assert data["slots"] == [
        {"name": "instance-0", "index": 0, "port": 7860, "gpu": 0, "device": "gpu0", **one},
        {"name": "instance-1", "index": 1, "port": 7861, "gpu": 1, "device": "gpu1", **one},
        {"name": "instance-2", "index": 2, "port": 7862, "gpu": 0, "device": "gpu0", **one},
    ]
    each = {"concurrency": 1, "asked": 1, "each": 5 * GiB, "vllm_memory": 0.0}
    assert data["devices"] == [
        {
            "device": "gpu0",
            "total": 24 * GiB,
            "free": 24 * GiB,
            "by_total": 4,
            "by_free": 4,
            "fits": 2,
            "limit": "max-instances",
            **each,
        },
        {
            "device": "gpu1",
            "total": 12 * GiB,
            "free": 12 * GiB,
            "by_total": 2,
            "by_free": 2,
            "fits": 1,
            "limit": "max-instances",
            **each,
        },
    ]
    assert data["notes"] == ["capped at --max-instances 3 (room for 6)"]


def test_as_dict_cpu_slots():
    data = plan(cpu_box(cores=2), budget()).as_dict()
    assert data["mode"] == "cpu"
    assert [(s["gpu"], s["device"], s["memory"]) for s in data["slots"]] == [(None, "cpu", 512 * MiB)] * 2
    assert [d["device"] for d in data["devices"]] == ["cpu"]


def test_slot_name_and_env_properties():
    assert Slot(index=7, port=7867, gpu=2, memory=GiB).name == "instance-7"
    assert Slot(index=0, port=7860, gpu=2, memory=GiB).env == {
        "CUDA_VISIBLE_DEVICES": "2",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    assert Slot(index=0, port=7860, gpu=0, memory=GiB).env == {
        "CUDA_VISIBLE_DEVICES": "0",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    assert Slot(index=0, port=7860, gpu=None, memory=GiB).env == {
        "CUDA_VISIBLE_DEVICES": "",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }


def test_a_running_cluster_counts_its_own_memory_as_free_when_re_planned():
    from cosyvoice_lb.launcher.plan.planner import with_own_slots

    # Four 5 GiB instances run on a 24 GiB card: 4 GiB is free now.
    busy = Inventory(
        gpus=(Gpu(index=0, total=24 * GiB, free=4 * GiB),), cpu_cores=8, ram_total=64 * GiB, ram_available=60 * GiB
    )
    first = plan(cards(24), budget())
    with pytest.raises(PlanError):
        plan(busy, budget())
    again = plan(with_own_slots(busy, first.slots), budget())
    assert [s.gpu for s in again.slots] == [s.gpu for s in first.slots]
    # CPU slots give their RAM back the same way, capped at the total.
    box = cpu_box(cores=4, ram_gib=4, available_gib=1)
    own = plan(cpu_box(cores=4, ram_gib=4), budget(reserve_gib=0), instances=4).slots
    assert with_own_slots(box, own).ram_available == 3 * GiB
    assert with_own_slots(cpu_box(ram_gib=4, available_gib=4), own).ram_available == 4 * GiB


def test_vllm_reserves_a_share_of_each_card():
    # vLLM takes 0.2 x the card per instance on top of the rest: bigger cards, bigger slots.
    b = Budget(gpu_footprint=5 * GiB, host_footprint=512 * MiB, reserve=1 * GiB, vllm=VllmShare(given=0.2))
    p = plan(cards(24, 80), b)
    per_card = {s.gpu: s.memory for s in p.slots}
    assert per_card == {0: 5 * GiB + int(0.2 * 24 * GiB), 1: 5 * GiB + int(0.2 * 80 * GiB)}
    assert [f.fits for f in p.fits] == [2, 3]  # 23 GiB // 9.8 GiB, 79 GiB // 21 GiB
    assert {s.vllm_memory for s in p.slots} == {0.2}


# --- processes x concurrency: footprints per synthesis, vLLM's share, auto ------------------


def cv3(tmp_path, **given) -> Settings:
    """CosyVoice3 settings with a state dir of their own (no calibration there unless a test writes one)."""
    return Settings(engine="cosyvoice3", state_dir=str(tmp_path), **given)


def budget_of(settings: Settings) -> Budget:
    return budget_for(settings, layout_for(settings))[0]


H200 = cards(141)


def test_one_more_synthesis_costs_its_activations_and_with_tensorrt_its_context_too():
    plain = Budget(5 * GiB, 512 * MiB, gpu_per_synthesis=GiB, host_per_synthesis=256 * MiB)
    assert [plain.on_card(Gpu(0, 24 * GiB, 24 * GiB), n) for n in (1, 2, 8)] == [5 * GiB, 6 * GiB, 12 * GiB]
    assert [plain.on_host(n) for n in (1, 2, 3)] == [512 * MiB, 768 * MiB, GiB]
    # a footprint measured at 4 at once covers fewer, and grows past it
    measured = Budget(7 * GiB, 512 * MiB, gpu_per_synthesis=GiB, footprint_at=4)
    assert [measured.rest(n) for n in (1, 4, 5, 8)] == [7 * GiB, 7 * GiB, 8 * GiB, 11 * GiB]


@pytest.mark.parametrize(
    "engine, flags, on_gpu, on_cpu",
    [
        ("cosyvoice3", {}, 2, 1),
        ("cosyvoice3", {"load_vllm": True}, 8, 8),
        ("cosyvoice3", {"load_trt": True}, 2, 1),
        ("cosyvoice3", {"fp16": True}, 2, 1),
        ("espeak", {}, 1, 1),
        ("simulated", {}, 1, 1),
    ],
)
def test_auto_concurrency_per_engine_and_flags_on_a_gpu_and_a_cpu_slot(tmp_path, engine, flags, on_gpu, on_cpu):
    settings = Settings(engine=engine, state_dir=str(tmp_path), **flags)
    gpu_plan = plan(H200, budget_of(settings))
    assert {s.concurrency for s in gpu_plan.slots} == {on_gpu} == {auto_concurrency(engine, **flags_of(flags))}
    cpu_plan = plan(cpu_box(cores=4), budget_of(settings))
    assert {s.concurrency for s in cpu_plan.slots} == {on_cpu}
    assert {s.vllm_memory for s in cpu_plan.slots} == {0.0}  # (no vLLM without a GPU)


def flags_of(flags: dict) -> dict:
    return {"load_vllm": flags.get("load_vllm", False), "gpu": True}


def test_auto_and_its_reasons_are_the_documented_table():
    assert [auto_concurrency("cosyvoice3", vllm, gpu) for vllm, gpu in ((False, True), (True, True))] == [2, 8]
    assert auto_concurrency("cosyvoice3", True, gpu=False) == 8  # (vLLM batches on a CPU too)
    assert auto_concurrency("cosyvoice3", False, gpu=False) == auto_concurrency("espeak") == 1
    assert explain("auto", "cosyvoice3", True) == "--instance-concurrency auto = 8 with --load-vllm"
    assert explain("auto", "cosyvoice3") == "--instance-concurrency auto = 2 for cosyvoice3 on a GPU"
    assert explain("auto", "cosyvoice3", gpu=False) == "--instance-concurrency auto = 1 without a GPU"
    assert explain("auto", "espeak") == "--instance-concurrency auto = 1 for espeak"
    assert explain("auto", "espeak", gpu=False) == "--instance-concurrency auto = 1 without a GPU"
    assert explain("auto", "cosyvoice3", True, gpu=False) == "--instance-concurrency auto = 8 with --load-vllm"
    assert explain(" 4 ", "cosyvoice3", True) == "--instance-concurrency 4"


@pytest.mark.parametrize("n", [1, 3, 16])
def test_an_explicit_concurrency_reaches_every_slot_gpu_or_cpu(tmp_path, n):
    settings = cv3(tmp_path, instance_concurrency=str(n))
    assert {s.concurrency for s in plan(cards(80, 80), budget_of(settings)).slots} == {n}
    assert {s.concurrency for s in plan(cpu_box(cores=2, ram_gib=512), budget_of(settings)).slots} == {n}


def test_the_default_footprint_grows_with_the_syntheses_and_fewer_processes_fit(tmp_path):
    per = figures.GPU_PER_SYNTHESIS
    for n, fits in ((1, 4), (2, 3), (4, 2), (8, 1)):  # 23 GiB // (5 GiB + (n - 1) x 1 GiB)
        p = plan(cards(24), budget_of(cv3(tmp_path, instance_concurrency=str(n))))
        assert [s.memory for s in p.slots] == [5 * GiB + (n - 1) * per] * fits
    # one TensorRT context per synthesis at once: 9.5 GiB at one, 5.5 GiB more each
    trt = budget_of(cv3(tmp_path, load_trt=True, instance_concurrency="3"))
    assert trt.on_card(Gpu(0, 80 * GiB, 80 * GiB), 3) == 5 * GiB + 3 * figures.TRT_PER_CONTEXT + 2 * per
    # CPU slots: CosyVoice3's activations in RAM, 1 GiB a synthesis more
    cpu = plan(cpu_box(cores=8, ram_gib=64), budget_of(cv3(tmp_path, instance_concurrency="3")))
    assert {s.memory for s in cpu.slots} == {6 * GiB + 2 * figures.HOST_PER_SYNTHESIS["cosyvoice3"]}


def test_an_explicit_concurrency_that_fits_no_card_is_refused_naming_it(tmp_path):
    with pytest.raises(PlanError, match=r"gpu0: no instance fits .* per instance at 12 syntheses"):
        plan(cards(12), budget_of(cv3(tmp_path, instance_concurrency="12")))


def test_auto_is_lowered_on_a_card_that_cannot_hold_one_instance_at_it(tmp_path):
    # TensorRT at 2: 5 + 4.5 x 2 + 1 = 15 GiB > 11 GiB usable on a 12 GiB card; at 1, 9.5 GiB
    small, big = plan(cards(12, 24), budget_of(cv3(tmp_path, load_trt=True))).fits
    assert (small.concurrency, small.asked, small.fits, small.each) == (1, 2, 1, int(9.5 * GiB))
    assert (big.concurrency, big.fits) == (2, 1)
    # an explicit number is never lowered: that card holds none at it
    with pytest.raises(PlanError, match="gpu0: no instance fits"):
        plan(cards(12), budget_of(cv3(tmp_path, load_trt=True, instance_concurrency="2")))
    # a busy card lowers it too: what is free now counts, as for how many fit
    busy = plan(cards(24, free_gib=(10,)), budget_of(cv3(tmp_path, load_trt=True)))
    assert (busy.slots[0].concurrency, len(busy.slots)) == (1, 1)


def test_the_vllm_share_is_planned_for_the_syntheses_and_the_card(tmp_path):
    share = budget_of(cv3(tmp_path, load_vllm=True)).vllm
    assert share is not None and share.given == 0.0
    kv = figures.VLLM_KV_PER_TOKEN
    # weights + activations + a KV cache of at least one 32,768-token sequence, + 10 %
    assert share.needs(1) == share.needs(8) == int((2 * GiB + 32768 * kv) * 1.1 + 0.5)
    assert share.needs(16) == int((2 * GiB + 16 * 4096 * kv) * 1.1 + 0.5)  # past 8, a sequence each
    p = plan(cards(141, 24), budget_of(cv3(tmp_path, load_vllm=True)))
    shares = {f.device: f.vllm_memory for f in p.fits}
    assert shares == {"gpu0": share.planned(141 * GiB, 8), "gpu1": share.planned(24 * GiB, 8)}
    # rounded up to 0.001 of the card: never less than vLLM needs
    assert shares["gpu0"] * 141 * GiB >= share.needs(8) > (shares["gpu0"] - 0.001) * 141 * GiB
    assert {s.vllm_memory for s in p.slots if s.gpu == 0} == {shares["gpu0"]}
    # each instance: vLLM's share + the model outside it (5 GiB, vLLM's own process 1 GiB, 7 more syntheses)
    rest = 5 * GiB + figures.VLLM_OUTSIDE + 7 * figures.GPU_PER_SYNTHESIS
    assert {s.memory for s in p.slots if s.gpu == 0} == {rest + int(shares["gpu0"] * 141 * GiB)}


def test_more_vllm_instances_fit_an_h200_than_upstreams_fifth_of_the_card_allows(tmp_path):
    for n in ("1", "8"):
        planned = plan(H200, budget_of(cv3(tmp_path, load_vllm=True, instance_concurrency=n)))
        upstream = plan(H200, budget_of(cv3(tmp_path, load_vllm=True, instance_concurrency=n, vllm_memory=0.2)))
        assert len(upstream.slots) <= 4 < len(planned.slots)  # 0.2 each: four at most, on any card
        assert {s.vllm_memory for s in upstream.slots} == {0.2}
    at_eight = plan(H200, budget_of(cv3(tmp_path, load_vllm=True)))
    assert (len(at_eight.slots), at_eight.syntheses) == (8, 64)  # 140 GiB // 15.7 GiB, x 8


def test_a_given_vllm_share_is_used_and_counted(tmp_path):
    p = plan(cards(80), budget_of(cv3(tmp_path, load_vllm=True, vllm_memory=0.3)))
    rest = 5 * GiB + figures.VLLM_OUTSIDE + 7 * figures.GPU_PER_SYNTHESIS
    assert {(s.vllm_memory, s.memory) for s in p.slots} == {(0.3, rest + int(0.3 * 80 * GiB))}
    assert len(p.slots) == 79 * GiB // (rest + int(0.3 * 80 * GiB))
    assert p.notes == ()


def test_a_vllm_share_too_large_for_one_instance_is_refused_with_the_planned_one(tmp_path):
    share = budget_of(cv3(tmp_path, load_vllm=True)).vllm
    assert share is not None
    with pytest.raises(PlanError) as refused:
        plan(cards(24), budget_of(cv3(tmp_path, load_vllm=True, vllm_memory=0.8)))
    message = str(refused.value)
    assert "--vllm-memory 0.8 reserves 19.2 GiB of gpu0's 24.0 GiB" in message
    assert "not even one instance fits" in message and "give 0 to have it planned" in message
    assert f"({share.planned(24 * GiB, 8):g} of this card for 8 syntheses at once)" in message
    # 0.6 leaves room for one instance at 3 (6 GiB + 2 x 1 GiB + 14.4 GiB): auto comes down to it
    lowered = plan(cards(24), budget_of(cv3(tmp_path, load_vllm=True, vllm_memory=0.6)))
    assert [(s.concurrency, s.vllm_memory) for s in lowered.slots] == [(3, 0.6)]


def test_a_vllm_share_below_what_vllm_needs_is_noted(tmp_path):
    p = plan(cards(24), budget_of(cv3(tmp_path, load_vllm=True, vllm_memory=0.01)))
    assert any("--vllm-memory 0.01 gives each vLLM 246 MiB" in n and "may refuse to start" in n for n in p.notes)


def test_a_given_footprint_holds_the_whole_instance_vllm_share_included(tmp_path):
    p = plan(cards(80), budget_of(cv3(tmp_path, load_vllm=True, footprint="10GiB")))
    assert {s.memory for s in p.slots} == {10 * GiB} and len(p.slots) == 7
    assert {s.vllm_memory for s in p.slots} == {budget_of(cv3(tmp_path, load_vllm=True)).vllm.planned(80 * GiB, 8)}
    over = plan(cards(80), budget_of(cv3(tmp_path, load_vllm=True, footprint="10GiB", vllm_memory=0.2)))
    assert any("more than --footprint's 10.0 GiB" in n for n in over.notes)


def calibrate_entry(tmp_path, key: str, entry: dict) -> None:
    (tmp_path / "run").mkdir(exist_ok=True)
    (tmp_path / "run" / "footprint.json").write_text(json.dumps({key: entry}))


def test_a_calibration_counts_at_the_concurrency_it_ran_and_grows_past_it(tmp_path):
    calibrate_entry(tmp_path, "cosyvoice3", {"gpu_bytes": 7 * GiB, "peak_bytes": 6 * GiB, "concurrency": 4})
    budget, source = budget_for(cv3(tmp_path), Layout(tmp_path))
    assert source.startswith("calibrated") and source.endswith("at 4 at once")
    assert [budget.rest(n) for n in (2, 4, 6)] == [7 * GiB, 7 * GiB, 9 * GiB]
    # written before it ran several at once: one at a time
    calibrate_entry(tmp_path, "cosyvoice3", {"gpu_bytes": 3 * GiB})
    assert budget_of(cv3(tmp_path)).rest(2) == 4 * GiB


def test_a_vllm_calibration_counts_vllms_reservation_apart(tmp_path):
    entry = {"gpu_bytes": 0, "peak_bytes": 30 * GiB, "concurrency": 8, "vllm_memory": 0.1, "gpu_total": 80 * GiB}
    calibrate_entry(tmp_path, "cosyvoice3+load_vllm", entry)
    budget, source = budget_for(cv3(tmp_path, load_vllm=True), Layout(tmp_path))
    assert budget.rest(8) == int(22 * GiB * 1.1) and "vLLM's reservation apart" in source
    gpu = Gpu(0, 141 * GiB, 141 * GiB)
    assert budget.on_card(gpu, 8) == budget.rest(8) + int(budget.vllm_fraction(gpu, 8) * gpu.total)
    # one from before --vllm-memory holds upstream's 0.2 of a card it does not name: not used
    calibrate_entry(tmp_path, "cosyvoice3+load_vllm", {"gpu_bytes": 30 * GiB, "peak_bytes": 27 * GiB})
    assert budget_for(cv3(tmp_path, load_vllm=True), Layout(tmp_path))[1] == "default"


def test_startable_counts_each_slots_memory_at_its_concurrency(tmp_path):
    budget = budget_of(cv3(tmp_path, load_vllm=True))
    full = plan(H200, budget, instances=3, surge=5)
    running, parked = full.slots[:3], full.slots[3:]
    box = with_own_slots(
        Inventory((Gpu(0, 141 * GiB, 141 * GiB - 3 * running[0].memory),), 16, 64 * GiB, 64 * GiB), running
    )
    assert startable(box, budget, running, parked) == list(parked)
    tight = Inventory((Gpu(0, 141 * GiB, 141 * GiB - 7 * running[0].memory),), 16, 64 * GiB, 64 * GiB)
    assert startable(with_own_slots(tight, running), budget, running, parked) == list(parked[:1])


# --- the plan in words ------------------------------------------------------------------------


def test_each_gpu_gets_a_line_with_its_processes_syntheses_share_and_why(tmp_path):
    settings = cv3(tmp_path, load_vllm=True)
    p = plan(cards(141, 24, free_gib=(141, 2)), budget_of(settings))
    share = p.fits[0].vllm_memory
    each = format_size(p.fits[0].each)
    reasons = concurrency_reasons(settings)
    gpu0, gpu1 = device_lines(p, reasons)
    assert gpu0 == (
        f"GPU 0: 8 processes x 8 syntheses = 64 at once (vLLM {share:g} of 141.0 GiB each, {each} per process; "
        "--instance-concurrency auto = 8 with --load-vllm)"
    )
    assert gpu1.startswith("GPU 1: no process: one at 1 synthesis takes ")
    assert "2.0 GiB free of 24.0 GiB" in gpu1 and "lowered to 1 for one process to fit this card" in gpu1


def test_the_cpu_line_and_an_explicit_number_say_so(tmp_path):
    settings = cv3(tmp_path, instance_concurrency="3")
    p = plan(cpu_box(cores=2, ram_gib=64), budget_of(settings))
    (line,) = device_lines(p, concurrency_reasons(settings))
    assert line == "CPU: 2 processes x 3 syntheses = 6 at once (8.0 GiB per process; --instance-concurrency 3)"
    one = plan(cpu_box(cores=1), budget())
    assert device_lines(one, {})[0] == "CPU: 1 process x 1 synthesis = 1 at once (512 MiB per process)"


def test_plan_shows_processes_times_syntheses_in_its_table_its_lines_and_its_json(tmp_path):
    from conftest import cli_here

    args = ("plan", "--gpus", "141GiB,141GiB", "--engine", "cosyvoice3", "--load-vllm", "--state-dir", str(tmp_path))
    shown = cli_here(*args, "--model-dir", str(FAKE_MODEL))
    assert shown.returncode == 0, shown.stderr
    rows = [line.split("│") for line in shown.stdout.splitlines() if line.startswith("│ instance-")]
    assert len(rows) == 16 and {(r[6].strip(), r[7].strip()) for r in rows} == {("8", f"{rows_share(tmp_path):g}")}
    for gpu in (0, 1):
        assert f"GPU {gpu}: 8 processes x 8 syntheses = 64 at once (vLLM {rows_share(tmp_path):g} of 141.0 GiB" in (
            shown.stdout
        )
    data = json.loads(cli_here(*args, "--model-dir", str(FAKE_MODEL), "--json").stdout)
    assert data["syntheses"] == 128 and data["concurrency"]["gpu"] == "--instance-concurrency auto = 8 with --load-vllm"
    assert {(s["concurrency"], s["vllm_memory"]) for s in data["slots"]} == {(8, rows_share(tmp_path))}
    assert data["reasoning"] == [line for line in shown.stdout.splitlines() if re.match(r"GPU \d+: ", line)]


def rows_share(tmp_path) -> float:
    share = budget_of(cv3(tmp_path, load_vllm=True)).vllm
    assert share is not None
    return share.planned(141 * GiB, 8)
