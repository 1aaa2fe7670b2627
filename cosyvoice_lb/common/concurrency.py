"""How many syntheses one instance runs at once: ``--instance-concurrency N``, or ``auto``.

``auto`` is a documented default per engine and flag set (docs/planning.md), the planner's
and the instance's alike (the planner lowers it on a card that cannot hold one instance at
it, and passes every instance its number). Pure and standard library only: the instance
imports it too.
"""

from __future__ import annotations

# (engine, uses vLLM, on a GPU) -> syntheses at once. vLLM batches the LLM steps of all the
# requests an instance holds, so it needs several at once to batch anything (on a GPU and on
# a CPU: measured on 2 cores, 8 at once make 3.8x the speech tokens a second of 1 with
# Qwen2-0.5B's dimensions, 5-10x on the small test model); a plain GPU instance overlaps one
# request's LLM with another's flow and vocoder; on a CPU without vLLM, torch already
# spreads one synthesis over every core (8 threads at once: 1.2x), and espeak and the
# simulated engine are a process and a sleep per request: scale those with instances.
# `cosyvoice-lb calibrate` replaces these with the knee it measures on the box.
AUTO_VLLM = 8
AUTO_GPU = 2
AUTO_OTHER = 1


def auto_concurrency(engine: str, load_vllm: bool = False, gpu: bool = True) -> int:
    """What ``auto`` stands for with this engine (``cosyvoice3``, ``espeak``, ...)."""
    if engine != "cosyvoice3":
        return AUTO_OTHER
    if load_vllm:
        return AUTO_VLLM
    return AUTO_GPU if gpu else AUTO_OTHER


def concurrency(value: str | int, engine: str, load_vllm: bool = False, gpu: bool = True) -> int:
    """The number ``value`` (a setting's text: ``auto`` or N) stands for."""
    text = str(value).strip()
    return auto_concurrency(engine, load_vllm, gpu) if text == "auto" else max(1, int(text))


def auto_reason(engine: str, load_vllm: bool = False, gpu: bool = True) -> str:
    """Why ``auto`` stands for what it does, in a few words (the plan says it)."""
    if engine != "cosyvoice3":
        return f"for {engine}" if gpu else "without a GPU"
    if load_vllm:
        return "with --load-vllm"
    return "for cosyvoice3 on a GPU" if gpu else "without a GPU"


def explain(value: str | int, engine: str, load_vllm: bool = False, gpu: bool = True) -> str:
    """``--instance-concurrency auto = 8 with --load-vllm``, or ``--instance-concurrency 4``."""
    text = str(value).strip()
    if text != "auto":
        return f"--instance-concurrency {concurrency(text, engine, load_vllm, gpu)}"
    return f"--instance-concurrency auto = {auto_concurrency(engine, load_vllm, gpu)} {auto_reason(engine, load_vllm, gpu)}"
