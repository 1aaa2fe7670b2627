"""An embedded engine's speech program (espeak-ng, flite), run once per piece of text, its
failures translated: a timeout or a failure is an :class:`EngineError` (5xx), a crash by a
signal on this very text :class:`Unspeakable` (422: reword it).
"""

from __future__ import annotations

import io
import logging
import subprocess

import numpy as np
import soundfile

from cosyvoice_lb.instance.engines import EngineError, Unspeakable

log = logging.getLogger("cosyvoice_lb.instance")


def run_tool(argv: list[str], timeout: float, stdin: bytes = b"") -> bytes:
    """``argv``'s standard output. In a session of its own: a stop signal sent to the
    instance's process group must not kill a synthesis in flight (the server drains first)."""
    name = argv[0].rsplit("/", 1)[-1]
    try:
        done = subprocess.run(
            argv, input=stdin, capture_output=True, timeout=timeout, start_new_session=True, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise EngineError(f"{name} took longer than {timeout:.0f}s") from exc
    except OSError as exc:
        raise EngineError(f"{name} could not be run: {exc}") from exc
    if done.returncode < 0:  # killed by a signal: it crashed on this text
        log.warning(
            "%s crashed (signal %d) on a %d-byte text: %s",
            name,
            -done.returncode,
            len(stdin),
            done.stderr.decode(errors="replace").strip()[-300:],
        )
        raise Unspeakable(
            f"the engine cannot speak this text ({name} crashed on it): reword it, e.g. write out "
            "long runs of letters, dots or symbols, then send it again"
        )
    if done.returncode != 0:
        raise EngineError(f"{name} failed (exit {done.returncode}): {done.stderr.decode(errors='replace')[-300:]}")
    return done.stdout


def mono(wav: bytes, rate: int, name: str) -> np.ndarray:
    """A WAV ``name`` made, as mono float32 at ``rate`` (another rate is the program's fault)."""
    if not wav:
        raise EngineError(f"{name} made no audio")
    try:
        audio, got = soundfile.read(io.BytesIO(wav), dtype="float32")
    except (soundfile.LibsndfileError, RuntimeError) as exc:
        raise EngineError(f"{name} made audio that cannot be read: {exc}") from exc
    if got != rate:
        raise EngineError(f"{name} answered at {got} Hz, expected {rate} Hz")
    return audio if audio.ndim == 1 else audio.mean(axis=1)
