"""A load model for benchmarks, not speech: ``--engine simulated``.

It stands in for a GPU-bound CosyVoice3 instance so the balancer can be measured on a
box without a GPU: each synthesis *waits* (sleeps) for a service time proportional to the
text, one at a time per instance (the instance's engine slot), and uses almost no CPU.
The audio it returns is silence, 10 ms per character, so answers stay small. Never the
default; choose it only to measure routing, overhead and scale-out.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import numpy as np

from cosyvoice_lb.instance.engines import SynthesisRequest

SAMPLE_RATE = 16000
# --simulated-faults: texts that make the instance die or hang, for chaos runs (poison requests)
CRASH, HANG = "CRASH-NOW", "HANG-NOW"


class SimulatedEngine:
    name = "simulated"
    sample_rate = SAMPLE_RATE
    modes = ("sft",)

    def __init__(
        self,
        simulated_ms_per_char: float = 4.0,
        simulated_base_ms: float = 0.0,
        simulated_faults: bool = False,
        simulated_load_seconds: float = 0.0,
    ):
        self.per_char = simulated_ms_per_char / 1000
        self.base = simulated_base_ms / 1000
        self.faults = simulated_faults
        self.load_seconds = simulated_load_seconds

    def speakers(self) -> list[str]:
        return []

    def load(self) -> None:
        time.sleep(self.load_seconds)  # as a model's weights loading: the instance is not ready meanwhile

    def service_seconds(self, text: str) -> float:
        return self.base + self.per_char * len(text)

    def synthesize(self, request: SynthesisRequest) -> Iterator[np.ndarray]:
        if self.faults and CRASH in request.text:  # as a model that dies on some input (a CUDA assert)
            os._exit(70)
        if self.faults and HANG in request.text:  # as a model stuck on some input
            threading.Event().wait()
        time.sleep(self.service_seconds(request.text))
        yield np.zeros(max(1, len(request.text) * SAMPLE_RATE // 100), dtype=np.float32)
