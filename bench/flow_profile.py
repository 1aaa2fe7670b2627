"""Where a batched synthesis's time goes on this box: upstream's flow estimator (the DiT, one
Euler step of the classifier-free-guided pair) and HiFT (run as the batcher runs a group),
at 1, 2, 4 and 8 utterances a run, milliseconds per utterance (bench/batching.py prints it).

    <upstream python> bench/flow_profile.py --cosyvoice-root CHECKOUT --model-dir DIR [--frames 300]

If the time per utterance stays flat as the batch grows, the stage is bound by compute here
and batching it cannot make it faster on this box; where it falls, batching pays.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def timed(call, repeats: int) -> float:
    call()  # (warm)
    began = time.monotonic()
    for _ in range(repeats):
        call()
    return (time.monotonic() - began) / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cosyvoice-root", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--frames", type=int, default=300, help="mel frames an utterance has (prompt included)")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    root = Path(args.cosyvoice_root).resolve()
    sys.path[:0] = [str(root / "third_party" / "Matcha-TTS"), str(root)]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch
    from hyperpyyaml import load_hyperpyyaml

    from cosyvoice_lb.instance.engines.upstream_batch import hift_group

    model = Path(args.model_dir)
    with open(model / "cosyvoice3.yaml") as f:
        configs = load_hyperpyyaml(f, overrides={"qwen_pretrain_path": str(model / "CosyVoice-BlankEN"), "llm": None})
    flow, hift = configs["flow"], configs["hift"]
    flow.load_state_dict(torch.load(model / "flow.pt", map_location="cpu"))
    hift.load_state_dict(
        {k.replace("generator.", ""): v for k, v in torch.load(model / "hift.pt", map_location="cpu").items()}
    )
    flow.eval()
    hift.eval()
    estimator, frames = flow.decoder.estimator, args.frames
    rows = []
    with torch.inference_mode():
        for n in (int(x) for x in args.batches.split(",")):
            rows2 = 2 * n  # (each utterance is a guided and an unguided row)
            x, mu, cond = (torch.randn(rows2, 80, frames) for _ in range(3))
            mask, t, spks = torch.ones(rows2, 1, frames), torch.rand(rows2), torch.randn(rows2, 80)
            step = timed(lambda: estimator(x, mask, mu, t, spks, cond, streaming=False), args.repeats)
            calls = [{"feat": torch.randn(1, 80, frames), "finalize": True, "fp16": False} for _ in range(n)]
            vocoder = timed(lambda: hift_group(hift, calls), args.repeats)  # (as the batcher runs it)
            rows.append({"utterances": n, "dit_step_ms": step * 1000, "dit_step_ms_each": step * 1000 / n,
                         "hift_ms": vocoder * 1000, "hift_ms_each": vocoder * 1000 / n})  # fmt: skip
    print(json.dumps({"frames": frames, "threads": torch.get_num_threads(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
