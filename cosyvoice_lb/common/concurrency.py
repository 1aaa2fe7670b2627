"""How many syntheses one instance runs at once: ``--instance-concurrency N``, or ``auto``.

``auto`` is a documented default per engine and flag set (docs/planning.md), the planner's
and the instance's alike. Pure and standard library only: the instance imports it too.
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
