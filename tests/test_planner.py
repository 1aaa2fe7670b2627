"""Slot planning (cosyvoice_lb/launcher/plan/planner.py): pure, so every case builds its inventory by hand."""

from __future__ import annotations

import json

import pytest

from cosyvoice_lb.common.sizes import GiB, MiB
from cosyvoice_lb.launcher.plan.gpu import parse_gpus
from cosyvoice_lb.launcher.plan.planner import Budget, Gpu, Inventory, Plan, PlanError, Slot, plan


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
    assert set(data) == {"slots", "mode", "capacity", "devices", "notes", "serving", "spares", "min_serving", "surge"}
    assert data["mode"] == "gpu" and data["capacity"] == 3
    assert data["slots"] == [
        {"name": "instance-0", "index": 0, "port": 7860, "gpu": 0, "memory": 5 * GiB, "device": "gpu0"},
        {"name": "instance-1", "index": 1, "port": 7861, "gpu": 1, "memory": 5 * GiB, "device": "gpu1"},
        {"name": "instance-2", "index": 2, "port": 7862, "gpu": 0, "memory": 5 * GiB, "device": "gpu0"},
    ]
    assert data["devices"] == [
        {
            "device": "gpu0",
            "total": 24 * GiB,
            "free": 24 * GiB,
            "by_total": 4,
            "by_free": 4,
            "fits": 2,
            "limit": "max-instances",
        },
        {
            "device": "gpu1",
            "total": 12 * GiB,
            "free": 12 * GiB,
            "by_total": 2,
            "by_free": 2,
            "fits": 1,
            "limit": "max-instances",
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
    b = Budget(gpu_footprint=5 * GiB, host_footprint=512 * MiB, reserve=1 * GiB, gpu_fraction=0.2)
    p = plan(cards(24, 80), b)
    per_card = {s.gpu: s.memory for s in p.slots}
    assert per_card == {0: 5 * GiB + int(0.2 * 24 * GiB), 1: 5 * GiB + int(0.2 * 80 * GiB)}
    assert [f.fits for f in p.fits] == [2, 3]  # 23 GiB // 9.8 GiB, 79 GiB // 21 GiB
