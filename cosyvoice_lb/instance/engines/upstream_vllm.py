"""Upstream's vLLM path (``load_vllm``), made fit to serve.

Upstream's ``CosyVoice2Model.load_vllm`` exports the LLM into ``<model dir>/vllm`` and starts
one vLLM ``LLMEngine``; ``Qwen2LM.inference_wrapper`` then adds each request to it and steps
it under a lock, so the LLM steps of every synthesis in the process run as one batch. What
it leaves to the caller, and this module sees to:

- **Registration.** A CosyVoice2 LLM is exported as ``CosyVoice2ForCausalLM``, which vLLM
  learns from upstream's ``cosyvoice/vllm/cosyvoice2.py``; that file annotates with
  ``Union`` without importing it, so on vLLM >= 0.11 importing it raises ``NameError`` (an
  upstream bug). It is loaded here with that one name given. A CosyVoice3 LLM is exported as
  vLLM's own ``Qwen2ForCausalLM``: nothing to register, nothing imported.
- **Its share of the card** (``share``): upstream hard-codes ``gpu_memory_utilization=0.2``.
- **Seeds** (``seed_requests``): upstream's ``SamplingParams`` carry no seed, so vLLM samples
  from its engine process's own generator and a request's seed changed nothing (torch's
  seed in this process never reaches it). Each request's sampling gets its seed (vLLM's
  per-request generator), so a seeded request gives the same tokens again. Not whatever
  else runs beside it: vLLM's batches are not batch-invariant (other sequences in a step
  move a request's logits by rounding, and near ties then fall the other way; measured on
  the small test model, whose choices are all near ties), so a seeded request still runs
  alone (``turns``).
- **A client that leaves** (``abort``): its request is taken out of the engine at once
  (``abort_request``), not run to its end.
- **Shutdown** (``shutdown``): upstream never stops the engine; its ``EngineCore`` process
  (2-4 GB) would outlive the instance. (A SIGKILLed instance cannot call anything: the
  engine process watches its parent itself, see ``lineage``.)

Runs in the user's CosyVoice environment; vLLM is imported only when the model uses it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import threading
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("cosyvoice_lb.vllm")

UPSTREAM_MODULE = "cosyvoice.vllm.cosyvoice2"  # CosyVoice2ForCausalLM, as upstream's vllm_example.py registers it
SHUTDOWN_SECONDS = 15.0


class VllmMissing(ImportError):
    """vLLM cannot be imported in this Python: the message says how to install it."""


def uses_vllm(model: Any) -> bool:
    """Whether upstream's model object (``AutoModel(...).model``) runs its LLM on vLLM."""
    return hasattr(getattr(model, "llm", None), "vllm")


def register(version: int) -> None:
    """Make vLLM know the LLM architecture upstream exports for this model version (before
    ``AutoModel(..., load_vllm=True)``)."""
    try:
        import vllm
    except ImportError as exc:
        raise VllmMissing(str(exc)) from None
    if version != 2:  # (v3: Qwen2ForCausalLM, vLLM's own)
        return
    module = sys.modules.get(UPSTREAM_MODULE) or _load_with_union(UPSTREAM_MODULE)
    vllm.ModelRegistry.register_model("CosyVoice2ForCausalLM", module.CosyVoice2ForCausalLM)


def _load_with_union(name: str) -> Any:
    """Import upstream's module with ``typing.Union`` in its namespace, which its annotations
    use and its imports do not bring on vLLM >= 0.11."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"upstream's {name} is not in this checkout")
    module = importlib.util.module_from_spec(spec)
    module.__dict__.setdefault("Union", typing.Union)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


@contextlib.contextmanager
def share(fraction: float) -> Iterator[None]:
    """While upstream loads: every vLLM ``EngineArgs`` it makes reserves ``fraction`` of the
    card (--vllm-memory) instead of the 0.2 that upstream's ``load_vllm`` hard-codes; 0:
    upstream's own. vLLM is imported by name at the call (``from vllm import EngineArgs``),
    so the module's attribute is what it gets; restored after the load."""
    if not fraction:
        yield
        return
    import vllm

    made = vllm.EngineArgs

    def engine_args(*args: Any, **kwargs: Any) -> Any:
        kwargs["gpu_memory_utilization"] = fraction
        return made(*args, **kwargs)

    vllm.EngineArgs = engine_args
    try:
        yield
    finally:
        vllm.EngineArgs = made
    log.info("vLLM reserves %.3f of the card (--vllm-memory)", fraction)


def seed_requests(seed_of: Callable[[], int | None]) -> None:
    """Every ``SamplingParams`` upstream makes (``from vllm import SamplingParams`` in its LLM
    thread, once per request) carries ``seed_of()`` when that is not None: the seed of the
    request whose LLM thread asks. Once per process; the original stays reachable."""
    import vllm

    made = vllm.SamplingParams
    if getattr(made, "cosyvoice_lb_seeded", False):
        return

    def sampling_params(*args: Any, **kwargs: Any) -> Any:
        seed = seed_of()
        if seed is not None and kwargs.get("seed") is None:
            kwargs["seed"] = seed
        return made(*args, **kwargs)

    sampling_params.cosyvoice_lb_seeded = True  # type: ignore[attr-defined]
    sampling_params.original = made  # type: ignore[attr-defined]
    vllm.SamplingParams = sampling_params


def count_steps(model: Any, hear: Callable[[int], None]) -> None:
    """``hear(n)`` after each step of the vLLM engine of upstream's model object: ``n``
    sequences made a token in it (the LLM's batch). On that one engine object."""
    engine = model.llm.vllm
    step = engine.step

    def counted() -> Any:
        outputs = step()
        if outputs:
            hear(len(outputs))
        return outputs

    engine.step = counted


def abort(llm: Any, key: str) -> None:
    """Take request ``key`` out of upstream's vLLM engine, with the queue upstream keeps for
    it, under upstream's own lock (another thread's ``step`` fills those queues)."""
    with llm.lock:
        try:
            llm.vllm.abort_request([key])
        finally:
            llm.vllm_output_queue.pop(key, None)


def shutdown(model: Any, timeout: float = SHUTDOWN_SECONDS) -> bool:
    """Stop the vLLM engine of upstream's model object and its engine process (bounded:
    a stuck engine does not hold the instance's exit). True when it stopped in time."""
    engine = getattr(getattr(model, "llm", None), "vllm", None)
    core = getattr(engine, "engine_core", None)
    stop = getattr(core, "shutdown", None)
    if stop is None:
        return True
    failed: list[BaseException] = []

    def run() -> None:
        try:
            stop()
        except Exception as exc:  # noqa: BLE001 - said below
            failed.append(exc)

    thread = threading.Thread(target=run, name="vllm-shutdown", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive() or failed:
        log.warning("vLLM's engine did not stop cleanly (%s)", failed[0] if failed else f"after {timeout:g}s")
        return False
    log.info("vLLM's engine stopped")
    return True


def export_problem(model_dir: str) -> str:
    """What is wrong with upstream's export of the LLM for vLLM (``<model dir>/vllm``; ""
    when it is whole or not made yet). Upstream exports only when that dir is missing, so an
    export cut short (a killed first load) would be loaded at every start after it."""
    where = Path(model_dir) / "vllm"
    if not where.exists():
        return ""
    if not (where / "config.json").is_file() or not any(where.glob("*.safetensors")):
        return (
            f"{where} is an incomplete export of the LLM for vLLM (no config.json or weights: a first "
            "load cut short?): remove that dir, and the next start exports it again"
        )
    return ""
