"""The memory limit `up` plans within (cosyvoice_lb/launcher/plan/host_memory.py, the check in
plan/preflight.py): the cgroup's limit read from fake cgroup files (v2 and v1, no limit), the
pure decision with what fits, what was asked and what to change, and the refusal before
anything starts."""

from __future__ import annotations

import dataclasses

import pytest

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.sizes import GiB, MiB
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.plan.host_memory import (
    OVERHEAD,
    cgroup_memory_limit,
    limit_problem,
    needed,
    per_instance,
)
from cosyvoice_lb.launcher.plan.planner import Slot
from cosyvoice_lb.launcher.plan.preflight import check_memory_limit

V3 = Settings(engine="cosyvoice3", model_dir="/models/cv3")


def cgroup(tmp_path, relative: str, text: str):
    path = tmp_path / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "relative, text, limit",
    [
        ("memory.max", "26843545600\n", 25 * GiB),  # cgroup v2, a pod's limit
        ("memory.max", "max\n", None),  # v2, none
        ("memory/memory.limit_in_bytes", "8589934592\n", 8 * GiB),  # cgroup v1
        ("memory/memory.limit_in_bytes", "9223372036854771712\n", None),  # v1's "none": near 2**63
        ("memory.max", "garbage\n", None),
    ],
)
def test_the_limit_is_read_from_the_cgroup_files(tmp_path, relative, text, limit):
    assert cgroup_memory_limit(cgroup(tmp_path, relative, text)) == limit


def test_no_cgroup_files_means_no_limit(tmp_path):
    assert cgroup_memory_limit(tmp_path) is None
    assert cgroup_memory_limit(tmp_path / "absent") is None


def test_v2_wins_where_both_are_there(tmp_path):
    cgroup(tmp_path, "memory/memory.limit_in_bytes", str(8 * GiB))
    assert cgroup_memory_limit(cgroup(tmp_path, "memory.max", str(4 * GiB))) == 4 * GiB


def test_instances_that_fit_the_limit_pass():
    assert limit_problem(4, 6 * GiB, 25 * GiB) == ""  # exactly: 4 x 6 + 1
    assert limit_problem(40, 6 * GiB, None) == ""  # no limit, no check
    assert needed(4, 6 * GiB) == 4 * 6 * GiB + OVERHEAD


def test_instances_past_the_limit_are_refused_with_what_fits_and_what_to_change():
    problem = limit_problem(5, 6 * GiB, 25 * GiB)
    assert "memory limit (25.0 GiB" in problem and "holds 4 instance(s) at 6.0 GiB each" in problem
    assert "the plan asks for 5 (31.0 GiB)" in problem
    for fix in ("--instances 4", "--host-memory-per-instance", "k8s render --gpu-memory"):
        assert fix in problem


def test_a_limit_that_holds_no_instance_says_so():
    problem = limit_problem(1, 6 * GiB, 2 * GiB)
    assert "does not hold even one instance" in problem and "--instances 0" not in problem


def test_host_memory_per_instance_is_the_engines_unless_given():
    assert per_instance(V3) == 6 * GiB
    assert per_instance(Settings()) == 640 * MiB  # espeak's, measured
    assert per_instance(Settings(engine="simulated")) == 256 * MiB
    assert per_instance(dataclasses.replace(V3, host_memory_per_instance="3GiB")) == 3 * GiB


def slots(count: int) -> tuple[Slot, ...]:
    return tuple(Slot(i, 7860 + i, 0, 5 * GiB) for i in range(count))


def test_up_refuses_a_plan_past_its_containers_limit_before_anything_starts(tmp_path):
    root = cgroup(tmp_path, "memory.max", str(13 * GiB))
    check_memory_limit(V3, slots(2), root=root)  # 2 x 6 + 1 = 13: fits
    with pytest.raises(ClusterError, match=r"holds 2 instance\(s\).*asks for 3.*nothing was started"):
        check_memory_limit(V3, slots(3), root=root)
    given = dataclasses.replace(V3, host_memory_per_instance="4GiB")
    check_memory_limit(given, slots(3), root=root)  # 3 x 4 + 1 = 13: fits
    check_memory_limit(V3, slots(30), root=tmp_path / "elsewhere")  # no cgroup files: no limit


def test_a_bad_host_memory_per_instance_is_refused_by_its_check():
    from cosyvoice_lb.common.setting_errors import setting_errors

    (problem,) = setting_errors(Settings(host_memory_per_instance="lots"))
    assert "--host-memory-per-instance: cannot read size 'lots'" in problem
