"""Flow and HiFT batched across concurrent syntheses, over upstream's own CosyVoice3 modules.

Upstream's ``token2wav`` runs the flow (the DiT decoder: 10 Euler steps of a classifier-free
guided pass, a batch of 2) and HiFT (the vocoder) for one utterance at a time. With vLLM
batching the LLM, those are the serial part of a synthesis. :func:`install` puts two hand-offs
on the loaded model object (no upstream file changes, nothing on upstream's classes):

- ``flow.decoder.forward``: the decoder call that ``flow.inference`` makes, with its ``mu``,
  ``mask``, ``spks``, ``cond`` for one utterance, goes to a :class:`~batching.Batcher`; a
  group runs as one Euler solve of batch ``2 x n`` through upstream's estimator (the DiT),
  each row padded to the group's longest with its mask zero there. Each row's noise is the
  prefix of upstream's fixed ``rand_noise`` of its own length, as alone.
- ``hift.inference``: the mels of a group run through upstream's f0 predictor, source module
  and convolutions as one batch, padded on the right; every layer of CosyVoice3's HiFT is
  causal or looks ahead a fixed few frames, which the zero padding gives as alone, so each
  row's valid part is its own. The STFT of its source and the inverse STFT of its output
  are taken row by row on its own length (their centred windows would otherwise read
  across the padding).

So each synthesis's audio is what it gets alone, up to the rounding of batched arithmetic
(tests/integration/test_upstream_batching.py measures it on upstream's code). Everything
the layer relies on is checked at load (:func:`shape_problem`, against upstream ace7c47,
the commit the tests run); anything else keeps the per-utterance path and says why once.
Runs in the user's CosyVoice environment: torch, through the model.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from cosyvoice_lb.instance.engines.batching import Batcher

log = logging.getLogger("cosyvoice_lb.batching")

DECODER_CLASS, HIFT_CLASS = "CausalConditionalCFM", "CausalHiFTGenerator"
DECODER_FORWARD = ("mu", "mask", "n_timesteps", "temperature", "spks", "cond", "streaming")
HIFT_PARTS = (
    "f0_predictor",
    "f0_upsamp",
    "m_source",
    "conv_pre",
    "ups",
    "source_downs",
    "source_resblocks",
    "resblocks",
    "reflection_pad",
    "conv_post",
    "_stft",
    "_istft",
    "upsample_rates",
    "istft_params",
)
HIFT_NUMBERS = ("num_kernels", "num_upsamples", "lrelu_slope", "audio_limit", "conv_pre_look_right")


@dataclass(frozen=True)
class Settings:
    """``size``: at most this many syntheses per flow or HiFT run (1: no batching);
    ``window``: seconds the first waits for others that may still come."""

    size: int = 8
    window: float = 0.02
    waste: float = 0.25  # at most this share of a group's work is padding (groups by length)


AUTO_GPU, AUTO_CPU = 8, 1  # --token2wav-batch auto (bench/README.md: batching on 2 CPU cores buys nothing)


def batch_size(asked: str, device: Any) -> int:
    """What --token2wav-batch stands for on the model's ``device`` (upstream's ``model.device``):
    ``auto`` is 8 on a GPU and 1 on a CPU, where the flow's DiT is bound by compute (the same
    milliseconds per utterance at 1 and 8 a run) and HiFT is slower per utterance in a batch."""
    if asked != "auto":
        return max(1, int(asked))
    return AUTO_GPU if getattr(device, "type", str(device)) == "cuda" else AUTO_CPU


def shape_problem(model: Any) -> str:
    """What about upstream's model object (``AutoModel(...).model``) is not the shape this
    layer knows ("" when all of it is)."""
    flow = getattr(model, "flow", None)
    decoder: Any = getattr(flow, "decoder", None)
    if type(decoder).__name__ != DECODER_CLASS:
        return f"the flow's decoder is not upstream's {DECODER_CLASS}"
    try:
        params = tuple(inspect.signature(type(decoder).forward).parameters)
    except (TypeError, ValueError):
        return "the flow decoder's forward() has no readable signature"
    if params[1:] != DECODER_FORWARD:
        return f"the flow decoder's forward() takes ({', '.join(params[1:])}), not ({', '.join(DECODER_FORWARD)})"
    import torch

    if not isinstance(getattr(decoder, "estimator", None), torch.nn.Module):
        return "the flow decoder's estimator is not a torch module (TensorRT runs it at batch 2 only)"
    for name in ("rand_noise", "t_scheduler", "inference_cfg_rate"):
        if not hasattr(decoder, name):
            return f"the flow decoder has no {name}"
    hift: Any = getattr(model, "hift", None)
    if type(hift).__name__ != HIFT_CLASS:
        return f"the vocoder is not upstream's {HIFT_CLASS}"
    for name in HIFT_PARTS:
        if not hasattr(hift, name):
            return f"the vocoder has no {name}"
    for name in HIFT_NUMBERS:
        if not isinstance(getattr(hift, name, None), (int, float)):
            return f"the vocoder has no number {name}"
    if not hasattr(getattr(hift.f0_predictor, "condnet", [None])[0], "causal_padding"):
        return "the vocoder's f0 predictor has no causal_padding"
    if not isinstance(hift.istft_params, dict) or not {"hop_len", "n_fft"} <= set(hift.istft_params):
        return "the vocoder's istft_params has no hop_len and n_fft"
    return ""


class Stages:
    """The two batchers of one model, and the syntheses inside its ``token2wav`` (those that
    may still bring an item: a group goes once they all have)."""

    def __init__(self, model: Any, settings: Settings, heard: Callable[[str, int], None]):
        self.model = model
        self.active = 0
        self.lock = threading.Lock()

        def expected() -> int:
            return self.active

        decoder, hift = model.flow.decoder, model.hift

        def batcher(stage: str, group: Callable, alone: Callable) -> Batcher:
            return Batcher(
                group,
                settings.size,
                settings.window,
                settings.waste,
                single=alone,
                expected=expected,
                heard=lambda n: heard(stage, n),
            )

        self.flow = batcher("flow", lambda calls: flow_group(decoder, calls), lambda call: flow_alone(decoder, call))
        self.hift = batcher("hift", lambda calls: hift_group(hift, calls), lambda call: hift_alone(hift, call))

    @contextmanager
    def inside(self) -> Iterator[None]:
        with self.lock:
            self.active += 1
        try:
            yield
        finally:
            with self.lock:
                self.active -= 1


def install(model: Any, settings: Settings, heard: Callable[[str, int], None] = lambda stage, n: None) -> str:
    """Put the flow's and HiFT's hand-offs on this model object; returns what stopped it
    ("" when installed). ``heard(stage, n)`` hears each group's size."""
    if settings.size <= 1:
        return "one synthesis a run (--token2wav-batch 1, or auto on a CPU, or --instance-concurrency 1)"
    problem = shape_problem(model)
    if problem:
        return problem
    stages = Stages(model, settings, heard)
    token2wav = model.token2wav
    decoder, hift = model.flow.decoder, model.hift
    fp16 = bool(getattr(model, "fp16", False))

    def counted(*args: Any, **kwargs: Any) -> Any:
        with stages.inside():
            return token2wav(*args, **kwargs)

    def decode(mu, mask, n_timesteps, temperature=1.0, spks=None, cond=None, streaming=False):  # upstream's names
        call = {"mu": mu, "mask": mask, "spks": spks, "cond": cond, "fp16": fp16}
        key = ("flow", int(n_timesteps), float(temperature), bool(streaming), str(mu.dtype), str(mu.device))
        return stages.flow.submit(
            key, {**call, "n": int(n_timesteps), "t": float(temperature), "s": streaming}, int(mu.shape[2])
        )

    def vocode(speech_feat, finalize=True):  # upstream's names
        key = ("hift", bool(finalize), str(speech_feat.dtype), str(speech_feat.device))
        return stages.hift.submit(
            key, {"feat": speech_feat, "finalize": bool(finalize), "fp16": fp16}, int(speech_feat.shape[2])
        )

    model.token2wav = counted
    decoder.forward = decode
    hift.inference = vocode
    return ""


# --- the flow: upstream's Euler solve, for n utterances at once -------------------------------


def flow_alone(decoder: Any, call: dict) -> Any:
    """One utterance: upstream's own decoder forward (its class's), as without this layer."""
    return type(decoder).forward(
        decoder,
        call["mu"],
        call["mask"],
        call["n"],
        call["t"],
        spks=call["spks"],
        cond=call["cond"],
        streaming=call["s"],
    )


def flow_group(decoder: Any, calls: Sequence[dict]) -> list[tuple[Any, None]]:
    """``CausalConditionalCFM.forward`` (upstream ace7c47, cosyvoice/flow/flow_matching.py)
    for every call at once: ``(feat, None)`` each, feat cut to its own length."""
    import torch

    with torch.inference_mode(), _autocast(calls[0]["fp16"]):
        lengths = [int(c["mu"].shape[2]) for c in calls]
        longest = max(lengths)
        mu = _padded([c["mu"] for c in calls], longest)
        cond = _padded([c["cond"] for c in calls], longest)
        mask = _padded([c["mask"] for c in calls], longest)
        spks = torch.cat([c["spks"] for c in calls], dim=0)
        first = calls[0]
        n, temperature, streaming = first["n"], first["t"], first["s"]
        z = decoder.rand_noise[:, :, :longest].to(mu.device).to(mu.dtype).expand(len(calls), -1, -1) * temperature
        t_span = torch.linspace(0, 1, n + 1, device=mu.device, dtype=mu.dtype)
        if decoder.t_scheduler == "cosine":
            t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
        feat = _solve_euler(decoder, z, t_span, mu, mask, spks, cond, streaming)
    return [(feat[i : i + 1, :, :length], None) for i, length in enumerate(lengths)]


def _solve_euler(decoder: Any, x: Any, t_span: Any, mu: Any, mask: Any, spks: Any, cond: Any, streaming: bool) -> Any:
    """Upstream's ``solve_euler`` with ``n`` rows: the guided rows first, then the unguided
    ones (zero mu, speaker and condition), as upstream lays out its batch of 2."""
    import torch

    rows = x.size(0)
    t, dt = t_span[0], t_span[1] - t_span[0]
    t = t.unsqueeze(dim=0)
    dtype = spks.dtype
    zeros_mu, zeros_spks, zeros_cond = torch.zeros_like(mu), torch.zeros_like(spks), torch.zeros_like(cond)
    mask_in = torch.cat([mask, mask], dim=0).to(dtype)
    mu_in = torch.cat([mu, zeros_mu], dim=0).to(dtype)
    spks_in = torch.cat([spks, zeros_spks], dim=0).to(dtype)
    cond_in = torch.cat([cond, zeros_cond], dim=0).to(dtype)
    steps = len(t_span)
    for step in range(1, steps):
        x_in = torch.cat([x, x], dim=0).to(dtype)
        t_in = t.expand(2 * rows).to(dtype)
        dphi_dt = decoder.forward_estimator(x_in, mask_in, mu_in, t_in, spks_in, cond_in, streaming)
        dphi_dt, cfg_dphi_dt = torch.split(dphi_dt, [rows, rows], dim=0)
        dphi_dt = (1.0 + decoder.inference_cfg_rate) * dphi_dt - decoder.inference_cfg_rate * cfg_dphi_dt
        x = x + dt * dphi_dt
        t = t + dt
        if step < steps - 1:
            dt = t_span[step + 1] - t
    return x.float()


# --- HiFT: upstream's causal vocoder, for n mels at once -------------------------------------


def hift_alone(hift: Any, call: dict) -> Any:
    """One mel: upstream's own ``inference`` (its class's), as without this layer."""
    return type(hift).inference(hift, speech_feat=call["feat"], finalize=call["finalize"])


def hift_group(hift: Any, calls: Sequence[dict]) -> list[tuple[Any, Any]]:
    """``CausalHiFTGenerator.inference`` (upstream ace7c47, cosyvoice/hifigan/generator.py)
    for every call at once: ``(speech, source)`` each, as long as alone."""
    import numpy as np
    import torch

    finalize = calls[0]["finalize"]
    lookahead = int(hift.f0_predictor.condnet[0].causal_padding)
    with torch.inference_mode(), _autocast(calls[0]["fp16"]):
        feats = [c["feat"] for c in calls]
        lengths = [int(f.shape[2]) for f in feats]
        mel = _padded(feats, max(lengths))
        hift.f0_predictor.to(torch.float64)
        f0 = hift.f0_predictor(mel.to(torch.float64), finalize=finalize).to(mel)
        s = hift.f0_upsamp(f0[:, None]).transpose(1, 2)
        s, _, _ = hift.m_source(s)
        s = s.transpose(1, 2)
        valid = lengths if finalize else [n - lookahead for n in lengths]
        x = mel if finalize else mel[:, :, :-lookahead]
        speech = _decode(hift, x, s, valid, finalize, int(np.prod(hift.upsample_rates)))
    samples = int(np.prod(hift.upsample_rates)) * int(hift.istft_params["hop_len"])
    return [(speech[i], s[i : i + 1, :, : valid[i] * samples]) for i in range(len(calls))]


def _decode(hift: Any, x: Any, s: Any, valid: list[int], finalize: bool, upsample: int) -> list[Any]:
    """Upstream's ``CausalHiFTGenerator.decode`` for a padded batch: the source's STFT and the
    output's inverse STFT row by row (each on its own length), the convolutions at once."""
    import torch
    import torch.nn.functional as F

    hop = int(hift.istft_params["hop_len"])
    frames = []
    for i, length in enumerate(valid):
        real, imag = hift._stft(s[i : i + 1, 0, : length * upsample * hop])
        frames.append(torch.cat([real, imag], dim=1))
    look = int(hift.conv_pre_look_right)
    if finalize:
        x = hift.conv_pre(x)
    else:
        x = hift.conv_pre(x[:, :, :-look], x[:, :, -look:])
        frames = [f[:, :, : -upsample * look] for f in frames]
    s_stft = _padded(frames, max(int(f.shape[2]) for f in frames))
    for i in range(hift.num_upsamples):
        x = F.leaky_relu(x, hift.lrelu_slope)
        x = hift.ups[i](x)
        if i == hift.num_upsamples - 1:
            x = hift.reflection_pad(x)
        si = hift.source_downs[i](s_stft)
        si = hift.source_resblocks[i](si)
        x = x + si
        xs = None
        for j in range(hift.num_kernels):
            out = hift.resblocks[i * hift.num_kernels + j](x)
            xs = out if xs is None else xs + out
        x = xs / hift.num_kernels
    x = F.leaky_relu(x)
    x = hift.conv_post(x)
    half = hift.istft_params["n_fft"] // 2 + 1
    magnitude, phase = torch.exp(x[:, :half, :]), torch.sin(x[:, half:, :])
    out = []
    for i, length in enumerate(valid):
        used = (length if finalize else length - look) * upsample + 1  # (reflection_pad adds one frame)
        speech = hift._istft(magnitude[i : i + 1, :, :used], phase[i : i + 1, :, :used])
        if not finalize:
            speech = speech[:, : -upsample * hop]
        out.append(torch.clamp(speech, -hift.audio_limit, hift.audio_limit))
    return out


# --- shared ------------------------------------------------------------------------------------


def _padded(tensors: Sequence[Any], length: int) -> Any:
    """Tensors of shape (1, C, T_i) as one (n, C, length), zeros after each's own end."""
    import torch
    import torch.nn.functional as F

    return torch.cat([F.pad(t, (0, length - int(t.shape[2]))) for t in tensors], dim=0)


@contextmanager
def _autocast(fp16: bool) -> Iterator[None]:
    """The autocast upstream's ``token2wav`` runs the flow and HiFT under (thread-local, so
    the thread that runs a group sets it again)."""
    import torch

    if fp16 and torch.cuda.is_available():
        with torch.autocast("cuda", enabled=True):
            yield
    else:
        yield
