"""Speech engines behind one small interface.

An engine loads once (``load``), then turns a :class:`SynthesisRequest` into mono float32
audio chunks at ``sample_rate``. The instance server knows nothing else about it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

MODES = ("zero_shot", "cross_lingual", "instruct", "sft")
CLONING = ("zero_shot", "cross_lingual", "instruct")  # the modes that speak with a prompt


@dataclass(frozen=True)
class SynthesisRequest:
    """One synthesis. ``prompt_wav`` is a path to a prepared (mono, >= 16 kHz, trimmed) WAV."""

    text: str
    speed: float = 1.0
    mode: str = ""  # "" means the engine's default mode
    prompt_text: str = ""
    prompt_wav: str = ""
    instruct_text: str = ""
    speaker: str = ""
    seed: int | None = None
    stream: bool = False
    voice_id: str = ""  # a saved voice (prompt_wav/prompt_text hold its prompt): engines may cache it
    # set (a threading.Event) once the client went away: an engine may stop at once, even
    # inside a step that makes no chunk (the whole of a non-streamed synthesis)
    cancel: Any = field(default=None, compare=False, repr=False)
    # the text as its client writes it (a streaming session, see ``speech.text_feed``): an
    # iterator of pieces, for an engine that says ``streams_text``; ``text`` is then "".
    text_stream: Any = field(default=None, compare=False, repr=False)

    def spoken(self) -> Any:
        """What it says: ``text``, or a streaming session's text as it grows (a callable)."""
        return getattr(self.text_stream, "so_far", None) or self.text


class EngineError(RuntimeError):
    """A synthesis failed for a reason the caller should hear about (answered as 5xx)."""


class Unspeakable(EngineError):
    """The engine broke on this very text (e.g. its process crashed on it): the same text
    fails the same way, so it is answered as a 422 that asks for other wording. The
    message is for the client; the engine logs its own diagnostics."""


class Engine(Protocol):
    name: str
    sample_rate: int
    modes: tuple[str, ...]  # what this engine (and its model) can do, the default first

    def speakers(self) -> list[str]:
        """Built-in speakers (for mode ``sft``)."""

    def load(self) -> None:
        """Load models or check tools; raises when the engine cannot work here."""

    def synthesize(self, request: SynthesisRequest) -> Iterator[np.ndarray]:
        """Yield mono float32 chunks in [-1, 1] at ``sample_rate``."""


def streams_text(engine: Engine, mode: str) -> bool:
    """The engine speaks text as it arrives in ``mode`` (upstream's bistream): one synthesis
    for a whole streaming session. Else the session is spoken sentence by sentence."""
    check = getattr(engine, "streams_text", None)
    return bool(check(mode)) if check is not None else False


def clones(engine: Engine) -> bool:
    """The engine speaks in a voice cloned from prompt audio (so it can speak saved voices)."""
    return any(mode in engine.modes for mode in ("zero_shot", "cross_lingual"))


# name -> "module:Class"; imported on demand so an engine's dependencies load only when used.
ENGINES = {
    "espeak": "cosyvoice_lb.instance.engines.espeak:EspeakEngine",
    "flite": "cosyvoice_lb.instance.engines.flite:FliteEngine",
    "cosyvoice3": "cosyvoice_lb.instance.engines.cosyvoice:CosyVoiceEngine",
    "simulated": "cosyvoice_lb.instance.engines.simulated:SimulatedEngine",  # a load model for benchmarks
}


def create_engine(name: str, **options) -> Engine:
    """The named engine, given only the options its constructor takes."""
    try:
        target = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(sorted(ENGINES))}") from None
    module_name, class_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    accepted = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in options.items() if k in accepted})
