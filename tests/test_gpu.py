"""The NVML adapter's pure parts, and its behaviour on a box without a GPU."""

from __future__ import annotations

import pytest

from cosyvoice_lb.gpu import inventory, visible_indexes

UUIDS = ["GPU-8932f937-aaaa", "GPU-1a2b3c4d-bbbb", "GPU-8932f000-cccc"]


@pytest.mark.parametrize("value, expected", [
    (None, [0, 1, 2]),
    ("", [0, 1, 2]),
    ("2,0", [2, 0]),
    ("1", [1]),
    ("GPU-1a2b", [1]),
    ("GPU-1a2b3c4d-bbbb,0", [1, 0]),
    ("0,7,1", [0]),  # CUDA stops at the first entry it cannot resolve
    ("GPU-8932f", [],),  # ambiguous prefix
    ("0,0,1", [0, 1]),
    ("MIG-abcd", []),
])
def test_visible_indexes_follow_cuda_visible_devices(value, expected):
    assert visible_indexes(UUIDS, value) == expected


def test_inventory_without_a_gpu_says_why_and_has_the_host():
    box = inventory()
    assert box.gpus == () and box.source.startswith("none")
    assert box.cpu_cores >= 1 and box.ram_total >= box.ram_available > 0


def test_inventory_for_a_hypothetical_box():
    box = inventory("24GiB, 12GiB")
    assert [(g.index, g.total, g.free) for g in box.gpus] == [(0, 24 * 2**30, 24 * 2**30), (1, 12 * 2**30, 12 * 2**30)]
    assert box.source == "--gpus"
