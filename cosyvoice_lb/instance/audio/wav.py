"""The one WAV and PCM writer: every route that answers 16-bit mono audio writes it here, so
``/v1/tts``, ``/v1/audio/speech`` (wav, pcm) and the UI give the same samples and header for
the same audio.

Samples: clipped to [-1, 1], scaled by 32767 and rounded to the nearest (not truncated).
Header: the canonical 44 bytes; a stream of unknown length says so with both sizes at
0xFFFFFFFF, as streaming servers and players agree.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from cosyvoice_lb.common.atomic import write_atomic

HEADER_BYTES = 44
UNKNOWN_SIZE = 0xFFFFFFFF
PRIVATE = 0o600  # prompts and results are someone's voice: readable by the service's user only


def pcm16(audio: np.ndarray) -> bytes:
    """s16le samples."""
    return np.round(np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def wav_header(rate: int, data_bytes: int | None) -> bytes:
    """The header of 16-bit mono PCM at ``rate`` with ``data_bytes`` of samples; ``None``
    for a stream whose length is not known yet."""
    riff = UNKNOWN_SIZE if data_bytes is None else 36 + data_bytes
    data = UNKNOWN_SIZE if data_bytes is None else data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data)
    )


def wav_bytes(audio: np.ndarray, rate: int) -> bytes:
    """A whole WAV file."""
    samples = pcm16(audio)
    return wav_header(rate, len(samples)) + samples


def write_wav(path: Path, audio: np.ndarray, rate: int) -> None:
    """Write a WAV file whole or not at all: an OSError (ENOSPC, EACCES, EROFS...) leaves
    nothing behind. Not synced to disk: a prompt or result lost to a power cut is not worth
    an fsync on every request."""
    write_atomic(path, wav_bytes(audio, rate), mode=PRIVATE, durable=False)


class WavBuilder:
    """A 16-bit mono WAV file built chunk by chunk as the audio comes.

    A long text's audio is hundreds of MB as float32: kept as float chunks, joined, clipped
    and encoded it was held four times over. Here each chunk is encoded as it arrives, so
    the whole is held once, at half the float size, and ``data`` hands it out uncopied.
    """

    HEADER = HEADER_BYTES

    def __init__(self, rate: int):
        self.rate = rate
        self._buffer = bytearray(self.HEADER)  # (the header is written once the size is known)
        self._view: memoryview | None = None

    def feed(self, audio: np.ndarray) -> None:
        self._buffer += pcm16(audio)

    @property
    def samples(self) -> int:
        return (len(self._buffer) - self.HEADER) // 2

    @property
    def seconds(self) -> float:
        return self.samples / self.rate

    @property
    def data(self) -> memoryview:
        """The whole WAV file (no more chunks may be fed after this)."""
        if self._view is None:
            self._buffer[: self.HEADER] = wav_header(self.rate, len(self._buffer) - self.HEADER)
            self._view = memoryview(self._buffer)
        return self._view
