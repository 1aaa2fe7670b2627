"""The pod's CPU and memory, from the instances its GPU holds: requests equal to limits, so
the pod is of QoS class Guaranteed (the last a node evicts, and never throttled for memory
it was promised).

Memory: the instances x host memory per instance (:func:`~cosyvoice_lb.launcher.plan.
host_memory.per_instance`: --host-memory-per-instance, else the engine's) + the overhead of
what runs beside them (:data:`~cosyvoice_lb.launcher.plan.host_memory.OVERHEAD`) — the same
figures `up` checks the pod's limit against, so a pod sized here starts. CPU: the instances x
CPU per instance (--cpu-per-instance, else the engine's) + :data:`CPU_OVERHEAD`. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.sizes import GiB, MiB
from cosyvoice_lb.launcher.plan.host_memory import OVERHEAD, per_instance

# Cores one instance keeps busy. cosyvoice3: its syntheses are Python threads driving the GPU
# (about one core: at --instance-concurrency N they share the one interpreter lock, and the
# text frontend runs one call at a time) beside the HTTP server, the UI and the encoding of
# results (about one more). espeak synthesizes on the CPU, one text at a time. simulated only
# sleeps. --cpu-per-instance overrides. How many instances a pod's GPU holds comes from the
# plan (``manifests.instances_per_pod``), at the syntheses each runs: a pod is sized for them.
CPU_PER_INSTANCE = {"cosyvoice3": 2.0, "espeak": 1.0, "flite": 1.0, "simulated": 0.25}
# nginx, supervisord, the health loop (a probe a second per instance), the panel, the launcher.
CPU_OVERHEAD = 0.5


@dataclass(frozen=True)
class PodSize:
    """One pod's container resources for ``instances`` instances, and how they were reached."""

    instances: int
    memory_each: int  # bytes
    cpu_each: float  # cores
    memory_overhead: int = OVERHEAD
    cpu_overhead: float = CPU_OVERHEAD

    @property
    def memory(self) -> int:
        return self.instances * self.memory_each + self.memory_overhead

    @property
    def millicores(self) -> int:
        return math.ceil(round((self.instances * self.cpu_each + self.cpu_overhead) * 1000, 3))

    def resources(self) -> dict[str, dict[str, int | str]]:
        """The container's ``resources``: one GPU, and requests equal to limits (Guaranteed)."""
        amounts: dict[str, int | str] = {
            "nvidia.com/gpu": 1,
            "cpu": cpu_quantity(self.millicores),
            "memory": memory_quantity(self.memory),
        }
        return {"requests": dict(amounts), "limits": dict(amounts)}

    def arithmetic(self) -> str:
        """The sums, as YAML comment lines (as the grace period's are)."""
        n = self.instances
        return "\n".join(
            [
                f"#   memory: {n} x {memory_quantity(self.memory_each)} + {memory_quantity(self.memory_overhead)} "
                f"(nginx, supervisord, the health loop, the panel, the launcher) = {memory_quantity(self.memory)}",
                f"#   cpu:    {n} x {self.cpu_each:g} + {self.cpu_overhead:g} = {cpu_quantity(self.millicores)}",
            ]
        )


def pod_size(settings: Settings, instances: int, cpu_each: float = 0.0) -> PodSize:
    """The pod's size for ``instances`` instances (``cpu_each`` 0: the engine's cores)."""
    engine = settings.resolved_engine
    return PodSize(instances, per_instance(settings), cpu_each or CPU_PER_INSTANCE[engine])


def memory_quantity(size: int) -> str:
    """Bytes as a Kubernetes quantity: whole GiB as ``Gi``, else MiB rounded up."""
    return f"{size // GiB}Gi" if size % GiB == 0 else f"{math.ceil(size / MiB)}Mi"


def cpu_quantity(millicores: int) -> str:
    """Millicores as a Kubernetes quantity: whole cores as a number, else ``m``."""
    return str(millicores // 1000) if millicores % 1000 == 0 else f"{millicores}m"
