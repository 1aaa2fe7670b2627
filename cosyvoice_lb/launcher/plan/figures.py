"""The figures the planner uses where nothing was measured on this box, with where each one
comes from (docs/planning.md has them as a table). `cosyvoice-lb calibrate` replaces the
GPU figures of an engine and flag set with a measurement; ``--footprint`` replaces them all.

Sizes are bytes. Nothing here reads the box: :mod:`~cosyvoice_lb.launcher.plan.footprint`
turns these and the settings into the planner's :class:`~cosyvoice_lb.launcher.plan.model.Budget`.
"""

from __future__ import annotations

from cosyvoice_lb.common.sizes import GiB

# Memory one instance needs at one synthesis at a time, per engine: GPU memory on GPU boxes,
# host RAM on CPU-only boxes. The espeak engine uses no GPU: on a GPU box it stands in for
# CosyVoice3 and is planned with CosyVoice3's footprint, so its plan is the model's plan.
# CosyVoice3 (plain, no TRT/vLLM): ~4.5 GB peak reported on an RTX 3060 in upstream's issues,
# rounded up for fragmentation and the warm-up peak.
ENGINE_FOOTPRINTS: dict[str, dict[str, str]] = {
    # espeak's host figure is measured: an instance's peak RSS (espeak-ng, Gradio UI), sampled
    # every 50 ms, while 20,000-character texts go through `up --instances 2` (the script of
    # tests/integration/test_long_text_memory.py, which holds the bound): ~200 MiB at rest,
    # 425/488 MiB one text at a time, 433/471 MiB two at once; one instance alone (its own
    # balancer) 422 MiB, two at once 585 MiB. 640 MiB covers them all.
    "espeak": {"gpu": "5GiB", "host": "640MiB"},
    # flite: the same instance with another program run per sentence (its peak RSS: 16 MiB).
    "flite": {"gpu": "5GiB", "host": "640MiB"},
    # CosyVoice3 on CPU (no GPU): weights plus activations in host RAM.
    "cosyvoice3": {"gpu": "5GiB", "host": "6GiB"},
    # The benchmark load model stands in for CosyVoice3 on a GPU box, like espeak.
    "simulated": {"gpu": "5GiB", "host": "256MiB"},
}

# --- what each further synthesis at once adds (--instance-concurrency N) ---------------------
# GPU memory per synthesis beyond the first, outside vLLM's reservation: an estimate, not a
# measurement. Upstream runs each synthesis in its own thread and its token2wav (flow, then
# HiFT) holds no lock, so N syntheses hold N sets of flow and vocoder activations at once;
# HiFT's upsampled layers (tens of channels at 24 kHz for one text segment) are the largest.
# The LLM's own cache without vLLM is small beside them (Qwen2-0.5B: 24 layers x 2 KV heads
# x 64 x 4 bytes x K and V = 24 KiB a token, ~50 MiB for a segment). Rounded up to 1 GiB;
# the stand-ins (espeak, simulated) are planned as CosyVoice3, like their base figure.
GPU_PER_SYNTHESIS = 1 * GiB
# Host RAM per synthesis beyond the first, on CPU slots: CosyVoice3's activations live in RAM
# there (the same estimate as on a GPU); espeak runs espeak-ng as a process of its own per
# text (an instance's RSS with two texts at once stayed within its 640 MiB, measured above);
# the simulated engine only sleeps.
HOST_PER_SYNTHESIS: dict[str, int] = {"cosyvoice3": 1 * GiB, "espeak": 0, "flite": 0, "simulated": 0}

# --- CosyVoice's engine flags ---------------------------------------------------------------
# One TensorRT context of the flow decoder ~4.5 GB (upstream issue #835, v2 reports); the
# engine makes one context per synthesis at once (upstream's ``trt_concurrent``), so this is
# added once per synthesis.
TRT_PER_CONTEXT = 9 * GiB // 2

# vLLM (--load-vllm). Upstream's load_vllm starts vLLM with gpu_memory_utilization=0.2
# (cosyvoice/cli/model.py): a fifth of the card whatever the model needs, so at most four
# instances fit any card. --vllm-memory replaces it; 0 plans it from what vLLM holds:
UPSTREAM_VLLM_FRACTION = 0.2
# the LLM as upstream exports it for vLLM (export_cosyvoice2_vllm: bfloat16): Qwen2-0.5B's
# 24 layers (~0.36 B parameters) and the speech-token embedding and decoder, ~0.7 GiB;
VLLM_WEIGHTS = 1 * GiB
# vLLM's profiling peak (a forward pass of a full batch of tokens) and its sampler;
VLLM_ACTIVATIONS = 1 * GiB
# its KV cache: Qwen2-0.5B keeps 24 layers x 2 KV heads x 64 dims x 2 bytes x K and V a token,
VLLM_KV_PER_TOKEN = 24 * 2 * 64 * 2 * 2  # 12 KiB
# a synthesis' sequence: a prompt of up to 15 s of speech (25 tokens a second: 375), its text
# and the text to speak, and up to 20 speech tokens per text token (upstream's
# max_token_text_ratio) for a segment of upstream's text split: ~2,200 tokens, doubled;
VLLM_TOKENS_PER_SYNTHESIS = 4096
# and vLLM refuses to start unless its cache holds one sequence of the model's whole length
# (the exported Qwen2 config's max_position_embeddings), whatever the concurrency;
VLLM_MAX_MODEL_LEN = 32768
# plus a tenth for what these estimates miss; the share is rounded up to 0.001 of the card.
VLLM_HEADROOM = 0.1
# Outside the reservation, beside the rest of the model: vLLM's engine process has a CUDA
# context of its own, and the CUDA graphs it captures are not in its budget in every version.
VLLM_OUTSIDE = 1 * GiB
# On a CPU slot (a CPU build of vLLM) there is no card: the engine process holds the LLM and
# vLLM's compiled graphs in host RAM, measured on this kind of box at 2.3 GB RSS with the
# small test model and 4.2 GB with Qwen2-0.5B's dimensions (random weights), rounded up;
VLLM_CPU_ENGINE = 9 * GiB // 2
# and its KV cache is VLLM_CPU_KVCACHE_SPACE whole GiB (vLLM's own default, unset, is 4),
# planned as on a card: a synthesis' sequence each, at least one of the model's whole length.
# (The rest of the model keeps the plain footprint: upstream loads the whole LLM in torch
# first and drops its layers only once vLLM runs, so the load peaks with both — reported
# ~8 GB with TRT + vLLM + fp16, spiking to 14 GB as vLLM starts.)
