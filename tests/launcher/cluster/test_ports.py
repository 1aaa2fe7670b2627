"""Port blocks for test and bench clusters: outside the ephemeral range, every port checked."""

from __future__ import annotations

import random
import socket

import pytest

from cosyvoice_lb.launcher.cluster.ports import LINUX_DEFAULT, block_starts, ephemeral_range, free_port_block


def test_the_range_is_read_from_the_kernel_file(tmp_path):
    path = tmp_path / "range"
    path.write_text("40000\t50000\n")
    assert ephemeral_range(str(path)) == (40000, 50000)
    assert ephemeral_range(str(tmp_path / "missing")) == LINUX_DEFAULT
    path.write_text("garbage\n")
    assert ephemeral_range(str(path)) == LINUX_DEFAULT


@pytest.mark.parametrize("count", [1, 4, 200])
def test_no_port_of_a_block_falls_in_the_range(count):
    rng = random.Random(7)
    for _ in range(500):
        base = free_port_block(count, ephemeral=(32768, 60999), free=lambda port: True, rng=rng)
        ports = range(base, base + count)
        assert not any(32768 <= port <= 60999 for port in ports)
        assert ports[0] >= 1024 and ports[-1] <= 65535


def test_every_port_of_the_block_is_checked():
    taken = set(range(10000, 32768, 2))  # every other port: no block of two anywhere below
    checked: list[int] = []

    def free(port: int) -> bool:
        checked.append(port)
        return port not in taken

    base = free_port_block(2, ephemeral=(32768, 60999), free=free, rng=random.Random(1))
    assert base > 60999  # only above the range is there room
    assert base in checked and base + 1 in checked


def test_a_range_that_starts_low_still_leaves_room_below_it():
    assert block_starts(3, (5000, 65535)) == [range(1024, 4998)]


def test_no_room_is_said():
    with pytest.raises(RuntimeError, match="outside the ephemeral range"):
        free_port_block(10, ephemeral=(1024, 65535), free=lambda port: True)


def test_a_block_found_here_is_free_and_outside_this_kernels_range():
    low, high = ephemeral_range()
    base = free_port_block(3)
    assert not any(low <= port <= high for port in range(base, base + 3))
    for port in range(base, base + 3):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
