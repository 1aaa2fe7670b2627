"""The speech check's share of the settings: which recogniser transcribes answers, how many
of them, and when a warm-up's or canary's speech fails (see ``instance/quality``). Standard
library only: the instance imports it with the settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cosyvoice_lb.common.checks import finite
from cosyvoice_lb.common.declaration import setting

RECOGNIZERS = ("auto", "pocketsphinx", "sherpa-onnx", "off")


def share(flag: str, value: Any) -> str:
    """A share from 0 to 1, both included."""
    return finite(flag, value) or ("" if 0 <= value <= 1 else f"{flag} must be from 0 to 1, got {value}")


def positive(flag: str, value: Any) -> str:
    return finite(flag, value) or ("" if value > 0 else f"{flag} must be above 0, got {value}")


@dataclass(frozen=True)
class SpeechCheckSettings:
    """The speech check every instance runs (off the hot path, in a worker of its own)."""

    asr: str = setting(
        "auto",
        "Speech recogniser of the speech check (answers transcribed and scored against their "
        "text: WER, or CER for Chinese and Japanese): pocketsphinx (English, offline; pip install "
        "pocketsphinx in the instances' Python), sherpa-onnx (SenseVoice, Paraformer or Whisper "
        "from --asr-model), off. auto: sherpa-onnx with --asr-model, else pocketsphinx for the "
        "flite engine; an instance without a recogniser shows as unchecked.",
        choices=RECOGNIZERS,
        instance=True,
    )
    asr_model: str = setting(
        "",
        "A local sherpa-onnx model dir for the speech check (its model.onnx or encoder/decoder "
        "and tokens.txt); nothing is downloaded.",
        metavar="DIR",
        instance=True,
    )
    asr_sample: float = setting(
        0.02,
        "Share of live answers the speech check transcribes, after they were sent (0-1); the "
        "warm-up and every canary are always checked.",
        type=float,
        check=share,
        instance=True,
    )
    asr_max_error: float = setting(
        0.6,
        "The most error (WER or CER) a warm-up's or canary's speech may have; above it the "
        "instance is taken out like for bad audio.",
        type=float,
        check=positive,
        instance=True,
    )
    canary_prompt: str = setting(
        "",
        "A WAV the warm-up and canary speak with on a model that only clones (else the first "
        "saved voice, the model's own prompt, or a prompt cosyvoice-lb ships); with "
        "--canary-prompt-text.",
        metavar="WAV",
        instance=True,
    )
    canary_prompt_text: str = setting(
        "",
        "The transcript of --canary-prompt.",
        metavar="TEXT",
        instance=True,
    )
