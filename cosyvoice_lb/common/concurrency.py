"""How many syntheses one instance runs at once: ``--instance-concurrency N``, or ``auto``.

``auto`` is a documented default per engine and flag set (docs/planning.md), the planner's
and the instance's alike (the planner lowers it on a card that cannot hold one instance at
it, and passes every instance its number). Pure and standard library only: the instance
imports it too.
"""

from __future__ import annotations

# (engine, uses vLLM, on a GPU) -> syntheses at once. vLLM batches the LLM steps of all the
# requests an instance holds, so it needs several at once to batch anything; a plain GPU
# instance overlaps one request's LLM with another's flow and vocoder; on a CPU, torch
# already spreads one synthesis over every core, and espeak and the simulated engine are a
# process and a sleep per request: scale those with instances.
AUTO_VLLM = 8
AUTO_GPU = 2
AUTO_OTHER = 1


def auto_concurrency(engine: str, load_vllm: bool = False, gpu: bool = True) -> int:
    """What ``auto`` stands for with this engine (``cosyvoice3``, ``espeak``, ...)."""
    if engine != "cosyvoice3" or not gpu:
        return AUTO_OTHER
    return AUTO_VLLM if load_vllm else AUTO_GPU


def concurrency(value: str | int, engine: str, load_vllm: bool = False, gpu: bool = True) -> int:
    """The number ``value`` (a setting's text: ``auto`` or N) stands for."""
    text = str(value).strip()
    return auto_concurrency(engine, load_vllm, gpu) if text == "auto" else max(1, int(text))


def auto_reason(engine: str, load_vllm: bool = False, gpu: bool = True) -> str:
    """Why ``auto`` stands for what it does, in a few words (the plan says it)."""
    if not gpu:
        return "without a GPU"
    if engine != "cosyvoice3":
        return f"for {engine}"
    return "with --load-vllm" if load_vllm else "for cosyvoice3 on a GPU"


def explain(value: str | int, engine: str, load_vllm: bool = False, gpu: bool = True) -> str:
    """``--instance-concurrency auto = 8 with --load-vllm``, or ``--instance-concurrency 4``."""
    text = str(value).strip()
    if text != "auto":
        return f"--instance-concurrency {concurrency(text, engine, load_vllm, gpu)}"
    return f"--instance-concurrency auto = {auto_concurrency(engine, load_vllm, gpu)} {auto_reason(engine, load_vllm, gpu)}"
