"""The engine's share of the settings: which engine every instance runs, and its options.

:class:`~cosyvoice_lb.common.settings.Settings` inherits these fields first, so they lead
the CLI's options, ``cluster.json`` and docs/settings.md as before. Standard library only:
the instance imports it with the settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from cosyvoice_lb.common.checks import concurrency, fraction, not_negative
from cosyvoice_lb.common.declaration import setting

ENGINES = ("auto", "espeak", "flite", "cosyvoice3", "simulated")


@dataclass(frozen=True)
class EngineSettings:
    """The engine every instance runs, and what it is given."""

    engine: str = setting(
        "auto",
        "Speech engine of every instance: cosyvoice3 (with --model-dir; v2 and v1 model "
        "dirs work too), espeak (embedded, no weights), flite (embedded, English, built-in voices "
        "slt, rms, awb, kal: the voice a speech recogniser understands); auto picks cosyvoice3 when "
        "--model-dir is given. simulated is a load model for benchmarks, not speech "
        "(a quiet tone, 40 ms a character, after a wait proportional to the text).",
        choices=ENGINES,
        instance=True,
    )
    model_dir: str = setting(
        "",
        "CosyVoice model dir (local, holding cosyvoice3.yaml, cosyvoice2.yaml or cosyvoice.yaml).",
        metavar="DIR",
        instance="cosyvoice3",
    )
    cosyvoice_root: str = setting(
        "",
        "Upstream CosyVoice checkout (holds cosyvoice/ and third_party/Matcha-TTS); "
        "not needed when --python's env imports cosyvoice already.",
        metavar="DIR",
        instance="cosyvoice3",
    )
    load_trt: bool = setting(
        False, "CosyVoice: TensorRT flow decoder (more GPU memory per instance).", is_flag=True, instance="cosyvoice3"
    )
    load_vllm: bool = setting(
        False,
        "CosyVoice2/3: vLLM for the LLM (it reserves --vllm-memory of the card per instance).",
        is_flag=True,
        instance="cosyvoice3",
    )
    fp16: bool = setting(False, "CosyVoice: half precision.", is_flag=True, instance="cosyvoice3")
    simulated_ms_per_char: float = setting(
        4.0,
        "--engine simulated: milliseconds of service time per character of text.",
        type=float,
        check=not_negative,
        instance="simulated",
    )
    simulated_base_ms: float = setting(
        0.0,
        "--engine simulated: milliseconds of service time per request.",
        type=float,
        check=not_negative,
        instance="simulated",
    )
    simulated_load_seconds: float = setting(
        0.0,
        "--engine simulated: seconds its model load takes (CosyVoice3 takes minutes), for roll-out benchmarks.",
        type=float,
        check=not_negative,
        instance="simulated",
    )
    simulated_faults: bool = setting(
        False,
        "--engine simulated: a text holding CRASH-NOW kills the instance, HANG-NOW hangs it (chaos runs).",
        is_flag=True,
        instance="simulated",
    )
    vllm_memory: float = setting(
        0.0,
        "--load-vllm: the share of the card's memory each instance's vLLM reserves, above 0 and "
        "below 1 (upstream hard-codes 0.2: at most four instances a card); 0: what the planner "
        "works out for the instance's concurrency (docs/planning.md).",
        type=float,
        check=fraction,
        instance="cosyvoice3",
    )
    empty_cache: bool = setting(
        False,
        "CosyVoice: free the CUDA cache after every synthesis, as upstream does (a device-wide "
        "synchronize per request, which stalls the other syntheses of the instance); off: the "
        "memory stays with the process for the next one.",
        is_flag=True,
        instance="cosyvoice3",
    )
    token2wav_batch: str = setting(
        "auto",
        "CosyVoice3: at most this many syntheses of one instance share one run of the flow and "
        "one of HiFT (their token2wav work, gathered for --token2wav-window; each one's audio as "
        "alone); 1: each runs its own, as upstream does; auto: 8 on a GPU, 1 on a CPU (measured: "
        "no gain there, docs/vllm.md). At most --instance-concurrency.",
        check=concurrency,
        instance="cosyvoice3",
    )
    token2wav_window: float = setting(
        20.0,
        "CosyVoice3: milliseconds the first synthesis at the flow or HiFT waits for others to "
        "join its run (none once every synthesis in the instance's token2wav has joined).",
        type=float,
        check=not_negative,
        instance="cosyvoice3",
    )
    simulated_fault_dir: str = setting(
        "",
        "--engine simulated: a file in this dir named after an instance's port makes that "
        "instance's audio bad, as the file says (nan, silence, loud or short), for tests and "
        "chaos runs (empty: never).",
        metavar="DIR",
        instance="simulated",
    )
