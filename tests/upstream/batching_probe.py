"""Flow and HiFT batched across syntheses on upstream's code: each synthesis's audio, alone
and in a batch, as one JSON object.

    <upstream env python> batching_probe.py --cosyvoice-root CHECKOUT --model-dir DIR --prompt WAV

Upstream's ``token2wav`` runs for several token sequences of different lengths, as a whole
utterance (``finalize``) and as the chunks of a stream (upstream's schedule: a first hop of 25
tokens plus the prompt's pad, then 50, then 100, then the rest), first one at a time on
upstream's own modules, then all at once from threads through ``upstream_batch`` (a window
long enough that they meet). Printed: how far each batched result is from its lone one
(largest absolute difference, and whether the lengths match), the group sizes the batchers
ran, and what ``shape_problem`` says of the model and of one whose estimator is not a module.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = (31, 58, 77, 104, 150)  # speech tokens of each utterance (25 a second)


def calls(model, prompt: dict, lengths=LENGTHS) -> list[list[dict]]:
    """For each utterance, the token2wav calls upstream makes for it whole and streamed."""
    import torch

    generator = torch.Generator().manual_seed(0)
    made = []
    for n in lengths:
        tokens = torch.randint(0, 6561, (1, n), generator=generator, dtype=torch.int32)
        whole = [{"token": tokens, "token_offset": 0, "finalize": True, "stream": False}]
        stream, offset, hop = [], 0, int(model.token_hop_len)
        pad = int(-(-prompt["prompt_token"].shape[1] // hop) * hop - prompt["prompt_token"].shape[1])
        lookahead = int(model.flow.pre_lookahead_len)
        while True:
            this = hop + pad if offset == 0 else hop
            if n - offset < this + lookahead:
                break
            stream.append(
                {
                    "token": tokens[:, : offset + this + lookahead],
                    "token_offset": offset,
                    "finalize": False,
                    "stream": True,
                }
            )
            offset += this
            hop = min(int(model.token_max_hop_len), hop * int(model.stream_scale_factor))
        stream.append({"token": tokens, "token_offset": offset, "finalize": True, "stream": False})
        made += [whole, stream]
    return made


def speak(model, prompt: dict, sequence: list[dict], start: threading.Barrier | None = None) -> list:
    """One utterance's token2wav calls in order, as upstream makes them (its own cache state)."""
    key = str(uuid.uuid1())
    with model.lock:
        model.hift_cache_dict[key] = None
    if start is not None:
        start.wait()
    out = []
    for call in sequence:
        out.append(model.token2wav(uuid=key, **prompt, **call).cpu())
    with model.lock:
        model.hift_cache_dict.pop(key, None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cosyvoice-root", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--prompt", required=True)
    args = parser.parse_args()
    root = Path(args.cosyvoice_root).resolve()
    sys.path[:0] = [str(root / "third_party" / "Matcha-TTS"), str(root), str(ROOT)]
    import torch
    from cosyvoice.cli.cosyvoice import AutoModel

    from cosyvoice_lb.instance.engines import upstream_batch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    loaded = AutoModel(model_dir=args.model_dir)
    model = loaded.model
    front = loaded.frontend.frontend_zero_shot(
        "Hello.", "You are a helpful assistant.<|endofprompt|>希望你以后能够做的比我还好呦。", args.prompt, 24000, ""
    )
    prompt = {
        "prompt_token": front["flow_prompt_speech_token"],
        "prompt_feat": front["prompt_speech_feat"],
        "embedding": front["flow_embedding"],
    }
    sequences = calls(model, prompt)
    alone = [speak(model, prompt, s) for s in sequences]

    sizes: dict[str, list[int]] = {"flow": [], "hift": []}
    problem = upstream_batch.install(
        model, upstream_batch.Settings(size=16, window=2.0), lambda stage, n: sizes[stage].append(n)
    )
    start = threading.Barrier(len(sequences), timeout=60)
    together: list = [None] * len(sequences)

    def run(i: int) -> None:
        together[i] = speak(model, prompt, sequences[i], start)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sequences))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)

    diffs, same_length = [], True
    for lone, batched in zip(alone, together):
        for a, b in zip(lone, batched or []):
            same_length &= a.shape == b.shape
            if a.shape == b.shape and a.numel():
                diffs.append(float((a - b).abs().max()))
        same_length &= len(lone) == len(batched or [])
    peak = max(float(t.abs().max()) for chunks in alone for t in chunks if t.numel())
    trt_like = type(model.flow.decoder).__new__(type(model.flow.decoder))
    torch.nn.Module.__init__(trt_like)
    object.__setattr__(trt_like, "estimator", object())
    print(
        json.dumps(
            {
                "installed": problem,
                "calls": sum(len(s) for s in sequences),
                "same_length": same_length,
                "max_diff": max(diffs),
                "peak": peak,
                "sizes": sizes,
                "trt_problem": upstream_batch.shape_problem(
                    type("Model", (), {"flow": type("Flow", (), {"decoder": trt_like})(), "hift": model.hift})()
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
