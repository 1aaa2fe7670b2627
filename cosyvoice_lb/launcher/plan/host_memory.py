"""Host memory: what a cluster needs of it, and the memory limit it runs under.

A cluster needs, per instance, ``--host-memory-per-instance`` or else its engine's host
figure (:data:`~cosyvoice_lb.launcher.plan.figures.ENGINE_FOOTPRINTS`: espeak's is
measured, CosyVoice3's is its weights and activations in host RAM), and :data:`OVERHEAD`
for what runs beside the instances. `k8s render` sizes a pod by the same figures, and `up`
refuses a plan that exceeds the memory limit of the cgroup it runs in (a container's, a
pod's): :func:`cgroup_memory_limit` reads the limit (the adapter: its root is a parameter,
so tests hand it a dir of fake cgroup files) and :func:`limit_problem` decides (pure).
"""

from __future__ import annotations

from pathlib import Path

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.sizes import GiB, format_size, parse_size
from cosyvoice_lb.launcher.plan.figures import ENGINE_FOOTPRINTS

# nginx (its master and workers), supervisord, the health loop, the control panel and the
# launcher (`up --foreground`, relaying the logs): each Python process measured at 35-40 MiB
# once imported, supervisord at 23 MiB; ~200 MiB at rest, doubled for their peaks and rounded
# up to a GiB for the page cache of the logs they write.
OVERHEAD = 1 * GiB
CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v2 names the limit memory.max ("max": none); v1 memory/memory.limit_in_bytes, where
# "no limit" is a number near 2**63. Anything past an exbibyte is no limit.
LIMIT_FILES = ("memory.max", "memory/memory.limit_in_bytes")
NO_LIMIT = 1 << 60


def per_instance(settings: Settings) -> int:
    """Host memory one instance needs (bytes): --host-memory-per-instance, else its engine's."""
    given = settings.host_memory_per_instance
    return parse_size(given or ENGINE_FOOTPRINTS[settings.resolved_engine]["host"])


def needed(instances: int, each: int, overhead: int = OVERHEAD) -> int:
    """What ``instances`` instances of ``each`` bytes and the processes beside them need."""
    return instances * each + overhead


def cgroup_memory_limit(root: Path = CGROUP_ROOT) -> int | None:
    """The memory limit of the cgroup this process runs in (bytes), None for none (or none
    that can be read: a box outside any container)."""
    for name in LIMIT_FILES:
        try:
            text = (root / name).read_text().strip()
        except OSError:
            continue
        if not text.isdigit():  # "max", or what no kernel writes
            return None
        value = int(text)
        return value if 0 < value < NO_LIMIT else None
    return None


def limit_problem(instances: int, each: int, limit: int | None, overhead: int = OVERHEAD) -> str:
    """What is wrong with starting ``instances`` of ``each`` bytes under a memory ``limit``
    ("" when they fit, or there is no limit): what fits, what was asked, what to change."""
    want = needed(instances, each, overhead)
    if limit is None or want <= limit:
        return ""
    fits = max(0, (limit - overhead) // each)
    held = f"holds {fits} instance(s)" if fits else "does not hold even one instance"
    fix = f"give --instances {fits} (or --max-instances {fits}), or " if fits else ""
    return (
        f"this container's memory limit ({format_size(limit)}, its cgroup's) {held} at {format_size(each)} each "
        f"(--host-memory-per-instance) plus {format_size(overhead)} for nginx, the health loop, the panel and the "
        f"launcher; the plan asks for {instances} ({format_size(want)}): {fix}raise the container's memory limit "
        "(on Kubernetes: `k8s render --gpu-memory` with the card the pod gets, which sizes the pod for the "
        "instances that fit on it), or set --host-memory-per-instance to what one instance really takes"
    )
