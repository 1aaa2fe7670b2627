"""A load model for benchmarks, not speech: ``--engine simulated``.

It stands in for a GPU-bound CosyVoice3 instance so the balancer can be measured on a
box without a GPU: each synthesis *waits* (sleeps) for a service time proportional to the
text, one at a time per instance (the instance's engine slot), and uses almost no CPU.
The audio it returns is a quiet tone (-20 dBFS), 40 ms per character at speed 1: a length
the audio check finds plausible for any text, and answers that stay small. Never the
default; choose it only to measure routing, overhead and scale-out.

Faults, for tests and chaos runs: with ``--simulated-faults`` a text holding CRASH-NOW kills
the instance and HANG-NOW hangs it (poison requests); with ``--simulated-fault-dir DIR`` a
file in DIR named after the instance's port makes its audio bad as the file says, read at
each synthesis (so a test can turn it on and off): ``nan`` (NaN samples, as TensorRT fp16 on
some cards), ``silence`` (zeros), ``loud`` (far beyond ±1) or ``short`` (a few ms).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from cosyvoice_lb.instance.engines import EngineError, SynthesisRequest

SAMPLE_RATE = 16000
SECONDS_PER_CHAR = 0.04
LEVEL = 0.1  # -20 dBFS
TONE_HZ = 220.0
# --simulated-faults: texts that make the instance die or hang, for chaos runs (poison requests)
CRASH, HANG = "CRASH-NOW", "HANG-NOW"
FAULTS = ("nan", "silence", "loud", "short")
SHORT_SAMPLES = SAMPLE_RATE // 200  # 5 ms
# One period-aligned second of the tone, tiled as long as asked (cheap: no sine per request).
_TONE = (LEVEL * np.sin(2 * np.pi * TONE_HZ * np.arange(SAMPLE_RATE) / SAMPLE_RATE)).astype(np.float32)


def tone(samples: int) -> np.ndarray:
    """``samples`` of the quiet tone."""
    reps = -(-samples // _TONE.size)
    return np.tile(_TONE, reps)[:samples] if reps > 1 else _TONE[:samples].copy()


def spoil(audio: np.ndarray, fault: str) -> np.ndarray:
    """The audio as the fault makes it."""
    if fault == "nan":
        return np.full(audio.size, np.nan, dtype=np.float32)
    if fault == "silence":
        return np.zeros(audio.size, dtype=np.float32)
    if fault == "loud":
        return audio * np.float32(40.0)  # peak 4: far beyond ±1
    if fault == "short":
        return audio[:SHORT_SAMPLES]
    return audio


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
        simulated_fault_dir: str = "",
        port: int = 0,
    ):
        self.per_char = simulated_ms_per_char / 1000
        self.base = simulated_base_ms / 1000
        self.faults = simulated_faults
        self.load_seconds = simulated_load_seconds
        self.fault_file = Path(simulated_fault_dir) / str(port) if simulated_fault_dir else None

    def speakers(self) -> list[str]:
        return []

    def load(self) -> None:
        time.sleep(self.load_seconds)  # as a model's weights loading: the instance is not ready meanwhile

    def service_seconds(self, text: str) -> float:
        return self.base + self.per_char * len(text)

    def fault(self) -> str:
        """The fault its file asks for now ("" without one)."""
        if self.fault_file is None:
            return ""
        try:
            fault = self.fault_file.read_text(encoding="utf-8").strip().lower()
        except (FileNotFoundError, NotADirectoryError):
            return ""
        except (OSError, UnicodeDecodeError) as exc:
            raise EngineError(f"the fault file {self.fault_file} cannot be read: {exc}") from None
        if fault not in FAULTS:
            raise EngineError(f"the fault file {self.fault_file} says {fault[:40]!r}: write one of {', '.join(FAULTS)}")
        return fault

    def synthesize(self, request: SynthesisRequest) -> Iterator[np.ndarray]:
        if self.faults and CRASH in request.text:  # as a model that dies on some input (a CUDA assert)
            os._exit(70)
        if self.faults and HANG in request.text:  # as a model stuck on some input
            threading.Event().wait()
        time.sleep(self.service_seconds(request.text))
        speed = request.speed if request.speed > 0 else 1.0
        audio = tone(max(1, int(len(request.text) * SECONDS_PER_CHAR * SAMPLE_RATE / speed)))
        yield spoil(audio, self.fault())
