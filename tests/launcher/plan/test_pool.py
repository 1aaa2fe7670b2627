"""The pool: how many slots are planned and started (spares, surge, elastic), which ready
instances serve and which wait as warm spares, and which parked slots have room to start."""

from __future__ import annotations

import pytest

from cosyvoice_lb.common.sizes import GiB, MiB
from cosyvoice_lb.launcher.health.rotation import rotation, spares_of
from cosyvoice_lb.launcher.plan.planner import (
    Budget,
    Gpu,
    Inventory,
    PlanError,
    Roles,
    Slot,
    plan,
    startable,
    with_own_slots,
)


def cards(*sizes_gib: float, free_gib: tuple[float, ...] | None = None) -> Inventory:
    free = free_gib or sizes_gib
    gpus = tuple(Gpu(index=i, total=int(t * GiB), free=int(f * GiB)) for i, (t, f) in enumerate(zip(sizes_gib, free)))
    return Inventory(gpus=gpus, cpu_cores=16, ram_total=64 * GiB, ram_available=60 * GiB)


def cpu_box(cores: int = 2, ram_gib: float = 24) -> Inventory:
    return Inventory(gpus=(), cpu_cores=cores, ram_total=int(ram_gib * GiB), ram_available=int(ram_gib * GiB))


FIVE = Budget(gpu_footprint=5 * GiB, host_footprint=512 * MiB, reserve=1 * GiB)


# --- planning the pool ------------------------------------------------------------------


def test_auto_serves_what_fits_less_the_spares():
    p = plan(cards(24), FIVE, spares=1)  # 4 fit
    assert (p.roles.serving, p.roles.spares, p.surge, len(p.slots)) == (3, 1, 0, 4)
    assert p.roles.started == 4


def test_spares_beside_all_that_fits_leave_none_serving_and_are_refused():
    with pytest.raises(PlanError, match="none would serve beside --spares 4"):
        plan(cards(24), FIVE, spares=4)


def test_explicit_instances_and_spares_must_fit_together():
    with pytest.raises(PlanError, match="4 instances and 1 spare requested but only 4 fit"):
        plan(cards(24), FIVE, instances=4, spares=1)
    forced = plan(cards(24), FIVE, instances=4, spares=1, force=True)
    assert len(forced.slots) == 5 and "--force: 5 instances where 4 fit" in forced.notes


def test_surge_slots_are_planned_as_far_as_memory_goes_and_said_when_fewer():
    p = plan(cards(24), FIVE, instances=2, surge=1)
    assert (p.roles.serving, p.surge, p.roles.started) == (2, 1, 2)
    assert [s.port for s in p.slots] == [7860, 7861, 7862]
    short = plan(cards(24), FIVE, instances=3, surge=3)  # room for 4: one parked slot
    assert short.surge == 1
    assert any("--surge 3: room for 1 parked slot(s)" in note for note in short.notes)
    none = plan(cards(24), FIVE, surge=1)  # auto takes every slot that fits
    assert none.surge == 0


def test_surge_and_spares_spread_over_cards_like_serving_slots():
    p = plan(cards(24, 24), FIVE, instances=2, spares=2, surge=2)
    assert [s.gpu for s in p.slots] == [0, 1, 0, 1, 0, 1]


def test_elastic_starts_at_its_floor_and_may_grow_to_the_planned_number():
    p = plan(cards(24), FIVE, instances=4, min_instances=1, spares=0)
    assert p.roles == Roles(serving=4, spares=0, min_serving=1)
    assert p.roles.elastic and p.roles.started == 1 and len(p.slots) == 4
    with pytest.raises(PlanError, match="--min-instances 5 is above the 4 instances planned"):
        plan(cards(24), FIVE, instances=4, min_instances=5)
    fixed = plan(cards(24), FIVE, instances=4, min_instances=4)  # floor = ceiling: not elastic
    assert not fixed.roles.elastic and fixed.roles.started == 4


def test_cpu_surge_is_bounded_by_memory_not_cores():
    p = plan(cpu_box(cores=2), FIVE, instances=4, surge=1)
    assert (len(p.slots), p.surge) == (5, 1)


def test_plan_as_dict_says_the_pool():
    d = plan(cards(24), FIVE, instances=2, spares=1, surge=1).as_dict()
    assert (d["serving"], d["spares"], d["surge"], d["min_serving"]) == (2, 1, 1, 0)


# --- room to start parked slots now ----------------------------------------------------------


def slot(i: int, gpu: int | None) -> Slot:
    return Slot(index=i, port=7860 + i, gpu=gpu, memory=5 * GiB)


def test_startable_counts_what_runs_on_each_card():
    box = cards(24, 12)  # 4 and 2 fit
    running = (slot(0, 0), slot(1, 1), slot(2, 0), slot(3, 1))
    parked = (slot(4, 1), slot(5, 0), slot(6, 0), slot(7, 0))
    # gpu1 is full; gpu0 has room for two more
    assert [s.index for s in startable(box, FIVE, running, parked)] == [5, 6]


def test_startable_sees_other_work_taking_memory():
    # Real NVML: free excludes our own running instance (added back) and another job's 14 GiB.
    box = with_own_slots(cards(24, free_gib=(5,)), (slot(0, 0),))  # 10 GiB free for us -> 1 more (reserve 1)
    assert [s.index for s in startable(box, FIVE, (slot(0, 0),), (slot(1, 0), slot(2, 0)))] == [1]


def test_startable_on_a_cpu_box_is_bounded_by_ram():
    box = Inventory(gpus=(), cpu_cores=2, ram_total=3 * GiB, ram_available=3 * GiB)  # (3-1)/0.5 = 4
    running = tuple(slot(i, None) for i in range(3))
    parked = tuple(slot(i, None) for i in range(3, 6))
    assert [s.index for s in startable(box, FIVE, running, parked)] == [3]


# --- who serves, who waits ------------------------------------------------------------------


def test_rotation_keeps_serving_ones_and_fills_with_spares():
    assert rotation(["a", "b", "c", "d"], before=["a", "b", "c"], wanted=3) == ["a", "b", "c"]
    # b taken out: the spare d fills its place, in the same step
    assert rotation(["a", "c", "d"], before=["a", "b", "c"], wanted=3) == ["a", "c", "d"]
    # b back and ready: it waits as the spare now, d keeps serving
    assert rotation(["a", "b", "c", "d"], before=["a", "c", "d"], wanted=3) == ["a", "c", "d"]
    assert spares_of(["a", "b", "c", "d"], ["a", "c", "d"]) == ["b"]


def test_rotation_takes_a_surge_and_gives_back_the_last_when_fewer_are_wanted():
    assert rotation(["a", "b", "c", "e"], before=["a", "b", "c"], wanted=4) == ["a", "b", "c", "e"]
    assert rotation(["a", "b", "c", "e"], before=["a", "b", "c", "e"], wanted=3) == ["a", "b", "c"]
    assert rotation(["a"], before=[], wanted=0) == []
