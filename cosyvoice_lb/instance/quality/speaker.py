"""Speaker similarity for the speech check: does an answer spoken with a prompt sound like
the prompt's speaker? Upstream's own speaker model (CAM++, ``campplus.onnx`` in a CosyVoice
model dir, the one its frontend embeds every prompt with) embeds both, and the cosine of the
two embeddings is the similarity (1: the same direction; unrelated speakers sit far lower).

The embedding is upstream's (``CosyVoiceFrontEnd._extract_spk_embedding``), to the bit: mono,
resampled to 16 kHz by torchaudio's ``Resample`` as upstream's ``load_wav`` does (not the
recognisers' linear interpolation, whose aliasing would shift an answer's features against
its prompt's), kaldi fbank of 80 bins without dither, mean-normalised over time, one
onnxruntime run on the CPU, flattened. onnxruntime and torchaudio are in upstream's
CosyVoice environment, not necessarily anywhere else: both are imported when the model
loads, and every failure (a missing library, a model that does not load, audio it cannot
embed) is a :class:`SpeakerError` that says what is missing.

A prompt's embedding is kept (``CACHED_PROMPTS``), keyed by the file rather than its path:
a saved voice reaches each request as a hard link of its own name to the same file.

Instance side: numpy here; onnxruntime, torch(audio) and soundfile loaded lazily.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import IO, Any

import numpy as np

FILE = "campplus.onnx"  # where upstream's model dir keeps it
RATE = 16000  # what CAM++ takes
MEL_BINS = 80
MIN_SAMPLES = 400  # one 25 ms fbank frame at 16 kHz: anything shorter has no features
CACHED_PROMPTS = 64  # prompt embeddings kept (saved voices, the checks' prompt)


class SpeakerError(RuntimeError):
    """The speaker model could not load, or could not embed an audio (no similarity then)."""


def cosine(a: Any, b: Any) -> float:
    """The cosine of two embeddings: 1.0 the same direction, 0.0 orthogonal, -1.0 opposite;
    0.0 when either is all zeros (or not finite). Embeddings of different sizes are a ValueError."""
    x = np.asarray(a, dtype=np.float64).reshape(-1)
    y = np.asarray(b, dtype=np.float64).reshape(-1)
    if x.shape != y.shape:
        raise ValueError(f"embeddings of different sizes: {x.size} and {y.size}")
    norms = float(np.linalg.norm(x) * np.linalg.norm(y))
    if norms == 0.0 or not np.isfinite(norms):
        return 0.0
    return float(np.clip(np.dot(x, y) / norms, -1.0, 1.0))


def speaker_model_for(model_dir: str | os.PathLike[str]) -> SpeakerModel | None:
    """The speaker model of ``model_dir`` when it has upstream's ``campplus.onnx`` (not loaded
    yet: that happens at the first check); None otherwise."""
    if not str(model_dir):
        return None
    path = Path(model_dir) / FILE
    return SpeakerModel(path) if path.is_file() else None


def _identity(prompt: str | IO[bytes]) -> tuple[int, ...]:
    """What tells a prompt file's content apart, without reading it: the file (device, inode:
    a saved voice's per-request hard link is the voice's file), its size and mtime."""
    st = os.stat(prompt) if isinstance(prompt, str) else os.fstat(prompt.fileno())
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class SpeakerModel:
    """Upstream's CAM++ speaker model at ``path``, on the CPU with one thread (off the hot
    path, beside the model). :meth:`load` once, then :meth:`similarity`; prompt embeddings are
    kept (``CACHED_PROMPTS``, by the file's identity)."""

    name = "campplus"

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._session: Any = None
        self._torch: Any = None
        self._fbank: Any = None
        self._resampler: Any = None
        self._resamplers: dict[int, Any] = {}  # by source rate (upstream's transform: its kernel, exactly)
        self._prompts: OrderedDict[tuple[int, ...], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def load(self) -> None:
        """Load the model and the feature code, once; a :class:`SpeakerError` says what is
        missing."""
        if self._session is not None:
            return
        try:
            import onnxruntime
        except ImportError as exc:
            raise SpeakerError(
                f"onnxruntime is not installed in this Python ({exc}): pip install onnxruntime"
            ) from None
        try:
            import torch
            import torchaudio.compliance.kaldi as kaldi
            import torchaudio.transforms as transforms
        except ImportError as exc:
            raise SpeakerError(f"torchaudio is not installed in this Python ({exc}): pip install torchaudio") from None
        if not self.path.is_file():
            raise SpeakerError(f"{self.path} is not there: the model dir has no speaker model")
        try:
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = 1
            session = onnxruntime.InferenceSession(
                str(self.path), sess_options=options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # noqa: BLE001  (onnxruntime's own errors, translated here)
            raise SpeakerError(f"{self.path} does not load in onnxruntime: {type(exc).__name__}: {exc}") from None
        self._torch, self._fbank, self._resampler = torch, kaldi.fbank, transforms.Resample
        self._session = session

    def embed(self, audio: np.ndarray, rate: int) -> np.ndarray:
        """The speaker embedding of ``audio`` (mono float in [-1, 1] at ``rate`` Hz): a 1-D
        float32 vector."""
        self.load()
        samples = np.array(audio, dtype=np.float32).reshape(-1)  # (a copy torch may write to)
        if int(rate) <= 0 or samples.size * RATE < MIN_SAMPLES * int(rate):
            raise SpeakerError(f"{samples.size} samples at {rate} Hz are too short for a speaker embedding")
        if not np.isfinite(samples).all():
            raise SpeakerError("the audio is not finite (NaN or infinity): no speaker embedding")
        try:
            wave = self._torch.from_numpy(samples).unsqueeze(0)
            if int(rate) != RATE:
                if int(rate) not in self._resamplers:
                    self._resamplers[int(rate)] = self._resampler(orig_freq=int(rate), new_freq=RATE)
                wave = self._resamplers[int(rate)](wave)
            feat = self._fbank(wave, num_mel_bins=MEL_BINS, dither=0, sample_frequency=RATE)
            feat = feat - feat.mean(dim=0, keepdim=True)
            inputs = {self._session.get_inputs()[0].name: feat.unsqueeze(dim=0).cpu().numpy()}
            out = self._session.run(None, inputs)[0]
        except Exception as exc:  # noqa: BLE001  (torch's and onnxruntime's errors, translated here)
            raise SpeakerError(f"the speaker model failed: {type(exc).__name__}: {exc}") from None
        embedding = np.asarray(out, dtype=np.float32).reshape(-1)
        if embedding.size == 0 or not np.isfinite(embedding).all():
            raise SpeakerError("the speaker model gave no finite embedding")
        return embedding

    def embed_prompt(self, prompt: str | IO[bytes]) -> np.ndarray:
        """The embedding of a prompt file (a path, or the file opened before its request
        removed it), kept for the next check with the same file."""
        try:
            key = _identity(prompt)
        except (OSError, ValueError) as exc:
            raise SpeakerError(f"the prompt {_named(prompt)} cannot be read: {exc}") from None
        with self._lock:
            if key in self._prompts:
                self._prompts.move_to_end(key)
                return self._prompts[key]
        embedding = self.embed(*_read(prompt))
        with self._lock:
            self._prompts[key] = embedding
            while len(self._prompts) > CACHED_PROMPTS:
                self._prompts.popitem(last=False)
        return embedding

    def similarity(self, audio: np.ndarray, rate: int, prompt: str | IO[bytes]) -> float:
        """The cosine of ``audio``'s speaker embedding to its prompt's."""
        return cosine(self.embed(audio, rate), self.embed_prompt(prompt))


def _named(prompt: str | IO[bytes]) -> str:
    return prompt if isinstance(prompt, str) else str(getattr(prompt, "name", "(an open file)"))


def _read(prompt: str | IO[bytes]) -> tuple[np.ndarray, int]:
    """A prompt file's audio, mixed down to mono, and its rate."""
    try:
        import soundfile
    except ImportError as exc:
        raise SpeakerError(f"soundfile is not installed in this Python ({exc}): pip install soundfile") from None
    try:
        if not isinstance(prompt, str):
            prompt.seek(0)
        audio, rate = soundfile.read(prompt, dtype="float32", always_2d=True)
    except Exception as exc:  # noqa: BLE001  (libsndfile's and the file's errors, translated here)
        raise SpeakerError(f"the prompt {_named(prompt)} cannot be read: {exc}") from None
    return audio.mean(axis=1), int(rate)
