"""Speech recognisers, each behind one small adapter that translates its errors into
:class:`RecognizerError`. None downloads anything: each loads what is on this box.

* ``pocketsphinx`` (PyPI; its wheel bundles an English acoustic model, dictionary and
  language model): English, offline, light (about 0.1 s of CPU a second of audio). Good
  enough to tell speech that says the text from noise, a tone or other words; it mishears
  single words of clear speech (flite's ``slt`` voice: WER 0.07-0.11), so thresholds are
  generous. It does not understand espeak-ng's voice (WER 0.93 measured): ``auto`` gives
  the espeak engine no recogniser.
* ``sherpa-onnx`` (PyPI; onnxruntime inside, no torch): SenseVoice (Chinese, English,
  Japanese, Korean, Cantonese), Paraformer (Chinese) or Whisper, from a local model dir
  (``--asr-model``): the recogniser for CosyVoice3 boxes, whose model speaks Chinese first.
  Chosen over faster-whisper and funasr-onnx for one package that runs all three families
  on a CPU beside the model, without a second torch.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

RATE = 16000  # what the recognisers take


class RecognizerError(RuntimeError):
    """A recogniser could not load or could not transcribe (the check is then "unchecked")."""


class Recognizer(Protocol):
    name: str

    def transcribe(self, audio: np.ndarray, rate: int) -> str:
        """What ``audio`` (mono float32 in [-1, 1] at ``rate``) says."""


def resampled(audio: np.ndarray, rate: int, to: int = RATE) -> np.ndarray:
    """``audio`` at ``to`` Hz (linear interpolation: enough for a recogniser's 16 kHz)."""
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    if rate == to or audio.size == 0:
        return audio
    n = max(1, int(round(audio.size * to / rate)))
    return np.interp(np.arange(n) * (rate / to), np.arange(audio.size), audio).astype(np.float32)


def pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(np.nan_to_num(audio), -1.0, 1.0) * 32767).astype("<i2").tobytes()


class Pocketsphinx:
    """pocketsphinx's bundled English model. One decoder, used by one caller at a time."""

    name = "pocketsphinx"

    def __init__(self) -> None:
        try:
            from pocketsphinx import Decoder
        except ImportError as exc:
            raise RecognizerError(
                "pocketsphinx is not installed in the instances' Python: pip install pocketsphinx"
            ) from exc
        try:
            self._decoder = Decoder(samprate=RATE, loglevel="FATAL")
        except (RuntimeError, ValueError, OSError) as exc:
            raise RecognizerError(f"pocketsphinx could not load its English model: {exc}") from exc
        self._lock = threading.Lock()

    def transcribe(self, audio: np.ndarray, rate: int) -> str:
        data = pcm16(resampled(audio, rate))
        with self._lock:
            try:
                # Afresh for each answer: its noise estimate adapts across utterances otherwise,
                # and the same audio heard after other audio was transcribed differently.
                self._decoder.reinit_feat()
                self._decoder.start_utt()
                self._decoder.process_raw(data, full_utt=True)
                self._decoder.end_utt()
                hyp = self._decoder.hyp()
            except (RuntimeError, ValueError) as exc:
                raise RecognizerError(f"pocketsphinx failed on {len(data) // 2} samples: {exc}") from exc
        return hyp.hypstr if hyp is not None else ""


class SherpaOnnx:
    """A sherpa-onnx offline recogniser from a local dir: Whisper (``*encoder*.onnx``,
    ``*decoder*.onnx``, ``*tokens.txt``), SenseVoice (a dir named for it: ``model*.onnx`` and
    ``tokens.txt``) or Paraformer (the same files in any other dir)."""

    name = "sherpa-onnx"

    def __init__(self, model_dir: str, threads: int = 1):
        root = Path(model_dir).expanduser()
        if not root.is_dir():
            raise RecognizerError(f"--asr-model {model_dir} is not a directory")
        try:
            import sherpa_onnx
        except ImportError as exc:
            raise RecognizerError(
                "sherpa-onnx is not installed in the instances' Python: pip install sherpa-onnx"
            ) from exc
        family, files = sherpa_files(root)
        try:
            make = getattr(sherpa_onnx.OfflineRecognizer, f"from_{family}")
            self._recognizer = make(**files, num_threads=threads)
        except (AssertionError, RuntimeError, ValueError, OSError) as exc:
            raise RecognizerError(f"sherpa-onnx could not load {family} from {root}: {exc}") from exc
        self.name = f"sherpa-onnx ({family})"
        self._lock = threading.Lock()

    def transcribe(self, audio: np.ndarray, rate: int) -> str:
        with self._lock:
            try:
                stream = self._recognizer.create_stream()
                stream.accept_waveform(RATE, resampled(audio, rate))
                self._recognizer.decode_stream(stream)
                return str(stream.result.text)
            except (RuntimeError, ValueError) as exc:
                raise RecognizerError(f"sherpa-onnx failed: {exc}") from exc


def sherpa_files(root: Path) -> tuple[str, dict[str, Any]]:
    """Which sherpa-onnx family ``root`` holds, and its files as the constructor's arguments."""

    def first(*patterns: str) -> str:
        for pattern in patterns:
            found = sorted(root.glob(pattern))
            if found:
                return str(found[0])
        return ""

    tokens = first("tokens.txt", "*tokens.txt")
    encoder, decoder = first("*encoder.int8.onnx", "*encoder*.onnx"), first("*decoder.int8.onnx", "*decoder*.onnx")
    model = first("model.int8.onnx", "model.onnx", "*.onnx")
    if not tokens or not (model or (encoder and decoder)):
        raise RecognizerError(
            f"--asr-model {root} holds no sherpa-onnx model: it needs tokens.txt and model.onnx "
            "(SenseVoice, Paraformer) or *encoder*.onnx and *decoder*.onnx (Whisper)"
        )
    if encoder and decoder:
        return "whisper", {"encoder": encoder, "decoder": decoder, "tokens": tokens}
    if "sense" in root.name.lower():
        return "sense_voice", {"model": model, "tokens": tokens, "use_itn": True}
    return "paraformer", {"paraformer": model, "tokens": tokens}


# Engines ``--asr auto`` gives pocketsphinx: flite, whose voice it understands (measured). Not
# CosyVoice3: a canary whose speech fails takes its instance out, and pocketsphinx's errors on
# a cloned voice are not measured here (no weights): a false failure on every instance would
# take the service down. A CosyVoice3 box names its recogniser (--asr-model, or --asr
# pocketsphinx after trying it); until then it shows as unchecked.
POCKETSPHINX_HEARS = ("flite",)


def choose(asr: str, engine: str, model_dir: str) -> tuple[Callable[[], Recognizer] | None, str, str]:
    """The recogniser ``--asr`` names for this engine: (a maker, or None and why not; its
    language: "en", or "" for any)."""
    if asr == "off":
        return None, "the speech check is off (--asr off)", ""
    if asr == "sherpa-onnx" or (asr == "auto" and model_dir):
        return functools.partial(SherpaOnnx, model_dir), "", ""  # (picklable: it is made in a process of its own)
    if asr == "pocketsphinx" or engine in POCKETSPHINX_HEARS:
        return Pocketsphinx, "", "en"
    if engine == "cosyvoice3":
        return None, "no recogniser named: give --asr-model DIR (sherpa-onnx), or --asr pocketsphinx (English)", ""
    return None, f"no recogniser understands the {engine} engine's voice: --engine flite, or --asr-model DIR", ""
