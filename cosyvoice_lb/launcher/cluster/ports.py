"""Free blocks of loopback ports for clusters that tests and benchmarks start.

A block must lie outside the kernel's ephemeral range (``net.ipv4.ip_local_port_range``):
any outgoing connection on the box may take a port there at any moment, so a block found
free in that range can be taken between the check and the cluster's start (seen: "port
... is not free" on a busy box). Below the range, only listeners take ports.

Launcher side: standard library only.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable

RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LINUX_DEFAULT = (32768, 60999)
LOWEST = 10000  # under it sit the well-known services (8080, 9090, ...) a box may run


def ephemeral_range(path: str = RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        with open(path, encoding="ascii") as lines:
            low, high = (int(word) for word in lines.read().split()[:2])
    except (OSError, ValueError):
        return LINUX_DEFAULT
    return low, high


def block_starts(count: int, ephemeral: tuple[int, int], lowest: int = LOWEST) -> list[range]:
    """Where a block of ``count`` ports may start: under the ephemeral range, and above it
    where there is room (each a range of first ports)."""
    low, high = ephemeral
    start = lowest if low - count >= lowest else 1024  # (a box whose range starts low)
    spans = [range(start, low - count + 1)]
    spans.append(range(high + 1, 65536 - count + 1))
    return [span for span in spans if len(span) > 0]


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            return True
        except OSError:
            return False


def free_port_block(
    count: int,
    ephemeral: tuple[int, int] | None = None,
    free: Callable[[int], bool] = port_free,
    rng: random.Random | None = None,
    tries: int = 200,
) -> int:
    """The first of ``count`` consecutive free loopback ports, every one of them outside
    the ephemeral range and checked."""
    spans = block_starts(count, ephemeral or ephemeral_range())
    if not spans:
        raise RuntimeError(f"no room for {count} ports outside the ephemeral range {ephemeral or ephemeral_range()}")
    rng = rng or random.Random()
    weights = [len(span) for span in spans]
    for _ in range(tries):
        span = rng.choices(spans, weights)[0]
        base = span[rng.randrange(len(span))]
        if all(free(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no block of {count} free ports found outside the ephemeral range")
