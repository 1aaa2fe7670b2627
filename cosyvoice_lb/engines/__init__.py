"""Speech engines behind one small interface.

An engine loads once (``load``), then turns a :class:`SynthesisRequest` into mono float32
audio chunks at ``sample_rate``. The instance server knows nothing else about it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np


@dataclass(frozen=True)
class SynthesisRequest:
    text: str
    speed: float = 1.0


class EngineError(RuntimeError):
    """A synthesis failed for a reason the caller should hear about (answered as 5xx)."""


class Engine(Protocol):
    name: str
    sample_rate: int

    def load(self) -> None:
        """Load models or check tools; raises when the engine cannot work here."""

    def synthesize(self, request: SynthesisRequest) -> Iterator[np.ndarray]:
        """Yield mono float32 chunks in [-1, 1] at ``sample_rate``."""


# name -> "module:Class"; imported on demand so an engine's dependencies load only when used.
ENGINES = {
    "espeak": "cosyvoice_lb.engines.espeak:EspeakEngine",
}


def create_engine(name: str, **options) -> Engine:
    try:
        target = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(sorted(ENGINES))}") from None
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)(**options)
