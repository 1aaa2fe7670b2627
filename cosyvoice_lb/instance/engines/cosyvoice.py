"""The CosyVoice engine: upstream's ``AutoModel`` in the user's CosyVoice environment.

Works with CosyVoice3 model dirs (``cosyvoice3.yaml``) and also v2 and v1 ones. It adds
what upstream's own web UI forgets for v3: the ``<|endofprompt|>`` prompt format, in the
exact form of upstream's example.py. Runs where cosyvoice-lb is not installed, so it
imports only what that environment has (torch, numpy, soundfile, the checkout).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import random
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_lb.instance.engines import EngineError, SynthesisRequest, upstream_batch, upstream_vllm
from cosyvoice_lb.instance.engines.turns import Turns
from cosyvoice_lb.instance.engines.upstream_tts import drive, install, llm_seed, serialize_frontend

log = logging.getLogger("cosyvoice_lb.cosyvoice")

# In upstream AutoModel's order: a dir holding several yamls loads as the first one found.
YAMLS = {"cosyvoice.yaml": 1, "cosyvoice2.yaml": 2, "cosyvoice3.yaml": 3}
ENDOFPROMPT = "<|endofprompt|>"
SYSTEM = "You are a helpful assistant."
# Upstream ships this prompt in its checkout; its transcript is in upstream's example.py.
DEFAULT_PROMPT = ("asset/zero_shot_prompt.wav", "希望你以后能够做的比我还好呦。")


def model_version(model_dir: str | os.PathLike) -> int:
    """3, 2 or 1 by the yaml in a local model dir; ValueError (with what to do) otherwise."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(
            f"model dir {model_dir} is not a local directory: download the model first (e.g. "
            "modelscope's snapshot_download('FunAudioLLM/Fun-CosyVoice3-0.5B-2512', "
            "local_dir='pretrained_models/Fun-CosyVoice3-0.5B')) and pass its path; "
            "cosyvoice-lb never lets an instance download at start"
        )
    for name, version in YAMLS.items():
        if (path / name).is_file():
            return version
    raise ValueError(f"model dir {model_dir} has none of {', '.join(YAMLS)}: is it a CosyVoice model?")


def v3_prompt(mode: str, text: str, prompt_text: str, instruct_text: str) -> tuple[str, str, str]:
    """(text, prompt_text, instruct_text) in CosyVoice3's prompt format (upstream example.py).

    Client input never carries ``<|endofprompt|>`` (validation refuses special tokens); a
    bundled default prompt that already has it is left as it is.
    """
    if mode == "zero_shot" and ENDOFPROMPT not in prompt_text:
        prompt_text = f"{SYSTEM}{ENDOFPROMPT}{prompt_text}"
    elif mode == "cross_lingual" and ENDOFPROMPT not in text:
        text = f"{SYSTEM}{ENDOFPROMPT}{text}"
    elif mode == "instruct" and ENDOFPROMPT not in instruct_text:
        instruct_text = f"{SYSTEM} {instruct_text}{ENDOFPROMPT}"
    return text, prompt_text, instruct_text


def v2_prompt(mode: str, text: str, prompt_text: str, instruct_text: str) -> tuple[str, str, str]:
    """CosyVoice2 wants the marker after the instruction only (upstream example.py)."""
    if mode == "instruct" and ENDOFPROMPT not in instruct_text:
        instruct_text = f"{instruct_text}{ENDOFPROMPT}"
    return text, prompt_text, instruct_text


class CosyVoiceEngine:
    name = "cosyvoice3"

    def __init__(
        self,
        model_dir: str = "",
        cosyvoice_root: str = "",
        load_trt: bool = False,
        load_vllm: bool = False,
        fp16: bool = False,
        empty_cache: bool = False,
        vllm_memory: float = 0.0,
        concurrency: int = 1,
        token2wav_batch: str | int = "auto",
        token2wav_window: float = 20.0,
        on_first_chunk: Callable[[float, float], None] | None = None,
        on_batch: Callable[[str, int], None] | None = None,
    ):
        if not model_dir:
            raise EngineError("the cosyvoice3 engine needs --model-dir")
        self.model_dir = model_dir
        self.cosyvoice_root = cosyvoice_root
        self.flags = {"load_trt": load_trt, "load_vllm": load_vllm, "fp16": fp16}
        self.empty_cache = empty_cache
        self.vllm_memory = vllm_memory
        self.concurrency = max(1, concurrency)
        # flow and HiFT batched across this many syntheses at most (``upstream_batch``; auto:
        # decided at load, where the model's device is known)
        self.batch_asked = str(token2wav_batch).strip()
        self.batching = upstream_batch.Settings(size=1, window=max(0.0, token2wav_window) / 1000)
        self.batch_off = "not loaded"  # "" once the flow and HiFT are batched; else why not
        self.turns = Turns()  # seeded requests run alone (see ``turns``)
        self.vllm = False  # the model's LLM runs on vLLM (loaded with --load-vllm)
        # "" once our layer runs upstream's model (``upstream_tts``); else why upstream's own
        # ``tts`` does, whose streams share one chunk size: they then run one at a time.
        self.own_path = "not loaded"
        self.model = None
        try:  # known before loading (from the yaml), so the UI can be built meanwhile
            self.version = model_version(model_dir)
        except ValueError:
            self.version = 0  # load() says why
        self.sample_rate = 24000 if self.version != 1 else 22050
        self.modes: tuple[str, ...] = self._modes([])
        # Saved voices in upstream's speaker cache (add_zero_shot_spk): id -> its transcript.
        self.cached: dict[str, str] = {}
        self.cache_lock = threading.Lock()
        # v2/v3 streaming chunk size (tokens) as loaded: on upstream's own path, the model
        # doubles it after each streamed chunk, so each stream starts from it again.
        self.stream_hop: int | None = None
        self.voice_cache_hits = 0  # saved voices spoken from the cache / put in it (metrics)
        self.voice_cache_misses = 0
        # Hears (llm seconds, audio seconds) of each stream's first chunk, on our layer (the
        # instance's metrics; see ``upstream_tts.install``).
        self.on_first_chunk = on_first_chunk
        # Hears (stage, syntheses) of each batched step: llm (vLLM), flow, hift (the instance's
        # metrics).
        self.on_batch = on_batch

    def _modes(self, speakers: list[str]) -> tuple[str, ...]:
        modes = ["zero_shot", "cross_lingual"]
        if self.version >= 2 or speakers:
            modes.append("instruct")
        if speakers:
            modes.insert(0, "sft")
        return tuple(modes)

    # --- loading -------------------------------------------------------------------------

    def load(self) -> None:
        try:
            self.version = model_version(self.model_dir)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        if self.cosyvoice_root:  # what upstream's scripts do before importing cosyvoice
            root = Path(self.cosyvoice_root).resolve()
            for path in (root / "third_party" / "Matcha-TTS", root):
                if str(path) not in sys.path:
                    sys.path.insert(0, str(path))
        try:
            from cosyvoice.cli.cosyvoice import AutoModel
        except ImportError as exc:
            raise EngineError(
                f"cannot import upstream CosyVoice ({exc}): pass --cosyvoice-root with the "
                "checkout that holds cosyvoice/ and third_party/Matcha-TTS"
            ) from None
        kwargs: dict[str, object] = {"model_dir": self.model_dir}
        cls_name = {3: "CosyVoice3", 2: "CosyVoice2", 1: "CosyVoice"}[self.version]
        cls = getattr(sys.modules["cosyvoice.cli.cosyvoice"], cls_name, None)
        accepted = inspect.signature(cls).parameters if cls else {}
        for flag, value in self.flags.items():
            if value and flag not in accepted:
                raise EngineError(f"--{flag.replace('_', '-')} is not supported by {cls_name} models")
            if flag in accepted:
                kwargs[flag] = value
        if "trt_concurrent" in accepted:  # a TensorRT context for each synthesis at once
            kwargs["trt_concurrent"] = self.concurrency
        if self.flags["load_vllm"] and "load_vllm" in accepted:
            register_vllm(self.version, self.model_dir)
        log.info(
            "loading %s from %s (%s)", cls_name, self.model_dir, ", ".join(f"{k}={v}" for k, v in self.flags.items())
        )
        with upstream_vllm.share(self.vllm_memory if self.flags["load_vllm"] else 0.0):
            model = self.model = AutoModel(**kwargs)
        self.vllm = upstream_vllm.uses_vllm(getattr(model, "model", None))
        if self.vllm:
            upstream_vllm.seed_requests(llm_seed)
            upstream_vllm.count_steps(model.model, lambda size: self._batched("llm", size))
        self.sample_rate = int(model.sample_rate)
        self.stream_hop = getattr(getattr(model, "model", None), "token_hop_len", None)
        self.modes = self._modes(self.speakers())
        self.layer(model)
        self.batch(model)

    def layer(self, model: Any) -> None:
        """Run upstream's model through ``upstream_tts`` (v2 and v3), or say once why not."""
        frontend = getattr(model, "frontend", None)
        if frontend is not None:
            serialize_frontend(frontend, threading.RLock())  # (cross-lingual calls zero-shot inside)
        if self.version == 1:  # (its streams keep their chunk size to themselves)
            self.own_path = "CosyVoice v1 models run on upstream's own tts"
            log.info("%s", self.own_path)
            return
        problem = install(model.model, empty_cache=self.empty_cache, on_first_chunk=self._first_chunk)
        if not problem:
            self.own_path = ""
            log.info("upstream's model runs through cosyvoice-lb's layer (own chunk schedule per stream, no poll)")
            return
        self.own_path = f"upstream's model is not the shape cosyvoice-lb knows ({problem})"
        log.warning(
            "%s: upstream's own tts runs it (a 0.1 s poll per chunk, a cache flush per request%s)",
            self.own_path,
            "; streams one at a time, since they share its chunk size" if self.concurrency > 1 else "",
        )

    def batch(self, model: Any) -> None:
        """Batch the flow and HiFT of concurrent syntheses (``upstream_batch``), or say once why not."""
        size = upstream_batch.batch_size(self.batch_asked, getattr(model.model, "device", None))
        self.batching = dataclasses.replace(self.batching, size=max(1, min(size, self.concurrency)))
        self.batch_off = upstream_batch.install(model.model, self.batching, self._batched)
        if not self.batch_off:
            log.info(
                "flow and HiFT run batched: up to %d syntheses a run, gathered for %g ms",
                self.batching.size,
                self.batching.window * 1000,
            )
        elif self.batching.size > 1:
            log.warning("flow and HiFT run one synthesis at a time: %s", self.batch_off)
        else:
            log.info("flow and HiFT run one synthesis at a time: %s", self.batch_off)

    def _batched(self, stage: str, size: int) -> None:
        if self.on_batch is not None:
            self.on_batch(stage, size)

    def _first_chunk(self, llm: float, audio: float) -> None:
        if self.on_first_chunk is not None:
            self.on_first_chunk(llm, audio)

    def speakers(self) -> list[str]:
        """Built-in (SFT) speakers: v1 models only. A v2/v3 spk2info holds zero-shot
        prompts saved by add_zero_shot_spk, which inference_sft cannot speak with."""
        if self.model is None or self.version != 1:
            return []
        return [s for s in self.model.list_available_spks() if s not in self.cached]

    def default_prompt(self) -> tuple[str, str]:
        """Upstream's bundled prompt (path, transcript), from the checkout in use."""
        roots = [Path(self.cosyvoice_root)] if self.cosyvoice_root else []
        module = sys.modules.get("cosyvoice")
        source = getattr(module, "__file__", None)
        if source:
            roots.append(Path(source).resolve().parents[1])  # <checkout>/cosyvoice/__init__.py
        for root in roots:
            path = root / DEFAULT_PROMPT[0]
            if path.is_file():
                return str(path), DEFAULT_PROMPT[1]
        return "", ""

    # --- synthesis -----------------------------------------------------------------------

    def synthesize(self, request: SynthesisRequest) -> Iterator[np.ndarray]:
        if self.model is None:
            raise EngineError("the model is not loaded")
        mode = request.mode or self.modes[0]
        if mode not in self.modes:
            raise EngineError(f"mode {mode} is not available with this model ({', '.join(self.modes)})")
        # Seeded: alone. On upstream's own sampling the seed sets torch's one random generator,
        # which every synthesis draws from; on vLLM the request's sampling gets the seed in
        # the engine, but a batch of other requests moves its logits by rounding (vLLM is not
        # batch-invariant), which can change near-tie tokens. Upstream's own path: streams
        # alone too.
        alone = request.seed is not None or (request.stream and bool(self.own_path) and self.version >= 2)
        with self.turns.turn(alone):
            yield from self._synthesize(mode, request)

    def streams_text(self, mode: str) -> bool:
        """Upstream's bistream (text as a generator): CosyVoice2/3 on upstream's own LLM (not
        vLLM, which upstream refuses it), in the modes whose prompt text carries the
        end-of-prompt marker it asserts on (zero-shot, instruct)."""
        return self.version >= 2 and not self.vllm and mode in ("zero_shot", "instruct")

    def close(self) -> None:
        """Stop what outlives the process unless stopped: vLLM's engine process."""
        if self.vllm and self.model is not None:
            upstream_vllm.shutdown(self.model.model)

    def _synthesize(self, mode: str, request: SynthesisRequest) -> Iterator[np.ndarray]:
        assert self.model is not None
        if request.seed is not None:
            seed_everything(request.seed)
        text, prompt_text, instruct_text = request.text, request.prompt_text, request.instruct_text
        if request.text_stream is not None:  # (upstream's frontend takes a generator as is)
            text = (piece for piece in request.text_stream)
        if self.version == 3:
            text, prompt_text, instruct_text = v3_prompt(mode, text, prompt_text, instruct_text)
        elif self.version == 2:
            text, prompt_text, instruct_text = v2_prompt(mode, text, prompt_text, instruct_text)
        common = {"stream": request.stream, "speed": 1.0 if request.stream else request.speed}
        model = self.model
        if request.stream and self.stream_hop is not None and self.own_path:
            model.model.token_hop_len = self.stream_hop
        # A saved voice speaks from upstream's speaker cache: its prompt features were
        # extracted once, at its first use here. (Not for instruct: upstream's instruct2 with
        # a cached speaker ignores the instruction, so it gets the prompt audio instead.)
        cached = request.voice_id if request.voice_id and mode in ("zero_shot", "cross_lingual") else ""
        if cached:
            self.cache_voice(cached, request.prompt_wav, request.prompt_text)
        if mode == "sft":
            speaker = request.speaker or self.speakers()[0]
            outputs = model.inference_sft(text, speaker, **common)
        elif mode == "zero_shot" and cached:
            outputs = model.inference_zero_shot(text, "", "", zero_shot_spk_id=cached, **common)
        elif mode == "zero_shot":
            outputs = model.inference_zero_shot(text, prompt_text, request.prompt_wav, **common)
        elif mode == "cross_lingual" and cached:
            outputs = model.inference_cross_lingual(text, "", zero_shot_spk_id=cached, **common)
        elif mode == "cross_lingual":
            outputs = model.inference_cross_lingual(text, request.prompt_wav, **common)
        elif self.version >= 2:
            outputs = model.inference_instruct2(text, instruct_text, request.prompt_wav, **common)
        else:
            speaker = request.speaker or self.speakers()[0]
            outputs = model.inference_instruct(text, speaker, instruct_text, **common)
        if not self.own_path:  # (our layer: the seed and the client's cancel reach each sentence group)
            outputs = drive(outputs, request.seed, request.cancel)
        for output in outputs:
            yield output["tts_speech"].detach().cpu().numpy().reshape(-1).astype(np.float32)

    def cache_voice(self, voice_id: str, prompt_wav: str, prompt_text: str) -> None:
        """Put a saved voice (its prompt audio and transcript) in upstream's speaker cache,
        once per voice (a voice never changes; a new one gets a new id; ``prompt_wav`` is
        this request's copy of its audio). The transcript is cached in the model's zero-shot
        prompt form (v3: with the system prompt and <|endofprompt|>, which upstream's LLM
        asserts on every later call); cross-lingual drops it upstream."""
        key = prompt_text
        with self.cache_lock:
            if self.cached.get(voice_id) == key:
                self.voice_cache_hits += 1
                return
            self.voice_cache_misses += 1
            assert self.model is not None
            if self.version == 3:
                prompt_text = v3_prompt("zero_shot", "", prompt_text, "")[1]
            self.model.add_zero_shot_spk(prompt_text, prompt_wav, voice_id)
            self.cached[voice_id] = key

    def retain_voices(self, voice_ids: Iterable[str]) -> None:
        """Forget cached voices that are no longer saved (deleted): frees their features."""
        keep = set(voice_ids)
        with self.cache_lock:
            for gone in [v for v in self.cached if v not in keep]:
                del self.cached[gone]
                spk2info = getattr(getattr(self.model, "frontend", None), "spk2info", None)
                if isinstance(spk2info, dict):
                    spk2info.pop(gone, None)


def register_vllm(version: int, model_dir: str) -> None:
    """Before loading with load_vllm=True: vLLM importable, upstream's earlier export whole,
    and CosyVoice's LLM architecture known to vLLM (see ``upstream_vllm.register``)."""
    try:
        upstream_vllm.register(version)
    except upstream_vllm.VllmMissing as exc:
        raise EngineError(
            f"--load-vllm needs vLLM in the instances' Python ({exc}): on a GPU box 'pip install vllm' (a "
            "version upstream CosyVoice's README names); on a CPU box see docs/vllm.md"
        ) from None
    problem = upstream_vllm.export_problem(model_dir)
    if problem:
        raise EngineError(problem)


def seed_everything(seed: int) -> None:
    """What upstream's set_all_random_seed does: Python, numpy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        import torch

        torch.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(seed)
    except ImportError:
        pass
