"""Upstream's own streamed call, timed to its first chunk, in one long-lived process of the
upstream Python (what bench/concurrency.py sets beside the cluster's first chunk).

    <upstream python> bench/upstream_first_chunk.py --cosyvoice-root CHECKOUT --model-dir DIR \\
        --prompt-wav WAV --transcript TEXT

Loads ``AutoModel`` once, adds the prompt as a zero-shot speaker once (``add_zero_shot_spk``,
the transcript in CosyVoice3's form), prints one JSON line ``{"ready": ...}`` (the load, torch's
threads, the model's hop, what upstream's tqdm and logging cost per call), then reads one JSON
request a line on stdin and answers one JSON line each, until stdin ends:

    {"text": "...", "variant": "own" | "own_hop_reset" | "layer" | "floor"}
    -> {"first": s, "total": s, "chunks": n, "hop_before": n, "frontend": s}

``own``: ``inference_zero_shot(text, '', '', zero_shot_spk_id=ID, stream=True)`` as it is, the
model's shared ``token_hop_len`` as the last stream left it; ``own_hop_reset``: the same with
the hop set back to its loaded value first (what the first call of a fresh process sees);
``layer``: the same call with cosyvoice-lb's layer (``upstream_tts``) in place of
``model.tts``. ``first``: seconds from the call to its first yielded chunk; ``frontend``:
seconds of upstream's frontend calls (text normalisation, token and prompt features) in it.

``floor``: no serving code at all, cosyvoice-lb's or upstream's ``tts``: the frontend's inputs
made first (not timed), then upstream's modules called directly for the first chunk, timed
from the LLM's prefill: ``model.llm.inference`` until the first chunk's tokens are there
(the loaded hop, the prompt's pad and the flow's lookahead), then ``token2wav`` on them
(flow and HiFT). ``first`` is that whole; ``llm`` its LLM part. The compute floor of a first
chunk, measured outside the layer whose own timer (``cosyvoice_first_chunk_compute_seconds``)
the cluster reports.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import sys
import time
from contextlib import redirect_stderr
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEAKER = "bench"
SYSTEM = "You are a helpful assistant.<|endofprompt|>"


def load(args: argparse.Namespace):
    root = Path(args.cosyvoice_root).resolve()
    for path in (root / "third_party" / "Matcha-TTS", root, ROOT):
        sys.path.insert(0, str(path))
    from cosyvoice.cli.cosyvoice import AutoModel

    return AutoModel(model_dir=args.model_dir)


class Frontend:
    """Seconds spent in the frontend's calls (wrapped on the loaded object only)."""

    def __init__(self, frontend) -> None:
        self.seconds = 0.0
        for name in ("text_normalize", "frontend_zero_shot"):
            setattr(frontend, name, self.timed(getattr(frontend, name)))

    def timed(self, method):
        def call(*args, **kwargs):
            began = time.monotonic()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.monotonic() - began

        return call


def per_call_noise(count: int = 200) -> float:
    """Seconds upstream's per-call tqdm bar and its logging.info lines cost (one segment, a
    first chunk: one bar, two log lines), as this process is set up."""
    from tqdm import tqdm

    sink = io.StringIO()
    began = time.monotonic()
    with redirect_stderr(sink):
        for _ in range(count):
            for _segment in tqdm(["x"]):
                logging.info("synthesis text %s", "x")
                logging.info("yield speech len %s, rtf %s", 1.0, 0.5)
    return (time.monotonic() - began) / count


def floor(model, hop: int, request: dict) -> dict:
    """The first chunk on upstream's modules alone (see the module's doc)."""
    import torch

    m = model.model
    text = next(iter(model.frontend.text_normalize(request["text"], split=True, text_frontend=True)))
    inputs = model.frontend.frontend_zero_shot(text, "", "", model.sample_rate, SPEAKER)
    prompt = inputs["flow_prompt_speech_token"]
    pad = -(-prompt.shape[1] // hop) * hop - prompt.shape[1]
    need = hop + pad + int(m.flow.pre_lookahead_len)

    def length(t):
        return torch.tensor([t.shape[1]], dtype=torch.int32)

    began = time.monotonic()
    tokens: list[int] = []
    with torch.inference_mode():
        for token in m.llm.inference(
            text=inputs["text"],
            text_len=length(inputs["text"]),
            prompt_text=inputs["prompt_text"],
            prompt_text_len=length(inputs["prompt_text"]),
            prompt_speech_token=inputs["llm_prompt_speech_token"],
            prompt_speech_token_len=length(inputs["llm_prompt_speech_token"]),
            embedding=inputs["llm_embedding"],
        ):
            tokens.append(token)
            if len(tokens) >= need:
                break
        llm = time.monotonic() - began
        m.hift_cache_dict["floor"] = None
        try:
            m.token2wav(token=torch.tensor(tokens).unsqueeze(dim=0), prompt_token=prompt,
                        prompt_feat=inputs["prompt_speech_feat"], embedding=inputs["flow_embedding"],
                        token_offset=0, uuid="floor", stream=True, finalize=False)  # fmt: skip
        finally:
            m.hift_cache_dict.pop("floor", None)
    first = time.monotonic() - began
    return {"variant": "floor", "first": first if len(tokens) >= need else None, "total": first, "chunks": 1,
            "hop_before": hop, "frontend": 0.0, "llm": llm, "tokens": len(tokens)}  # fmt: skip


def one(model, layered, own, hop: int, frontend: Frontend, request: dict) -> dict:
    variant = request.get("variant", "own")
    if variant == "floor":
        model.model.tts = own
        return floor(model, hop, request)
    model.model.tts = layered if variant == "layer" else own
    if variant == "own_hop_reset":
        model.model.token_hop_len = hop
    hop_before = int(model.model.token_hop_len)
    frontend.seconds = 0.0
    began = time.monotonic()
    first = None
    chunks = 0
    for _ in model.inference_zero_shot(request["text"], "", "", zero_shot_spk_id=SPEAKER, stream=True):
        if first is None:
            first = time.monotonic() - began
        chunks += 1
    return {
        "variant": variant,
        "first": first,
        "total": time.monotonic() - began,
        "chunks": chunks,
        "hop_before": hop_before,
        "frontend": frontend.seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cosyvoice-root", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--prompt-wav", required=True)
    parser.add_argument("--transcript", required=True)
    args = parser.parse_args()
    began = time.monotonic()
    model = load(args)
    import torch

    from cosyvoice_lb.instance.engines.upstream_tts import install

    model.add_zero_shot_spk(SYSTEM + args.transcript, args.prompt_wav, SPEAKER)
    own, hop = model.model.tts, int(model.model.token_hop_len)
    problem = install(model.model)
    layered = model.model.tts
    model.model.tts = own
    frontend = Frontend(model.frontend)
    ready = {
        "ready": True,
        "load": time.monotonic() - began,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "hop": hop,
        "max_hop": int(model.model.token_max_hop_len),
        "layer": problem or "installed",
        "noise_per_call": per_call_noise(),
        "log_level": logging.getLogger().level,
    }
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(one(model, layered, own, hop, frontend, json.loads(line))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
