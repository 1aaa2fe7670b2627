"""One path of bench/batching.py, in the Python that runs it: cosyvoice-lb's CosyVoice engine
on upstream's code, loaded once, then closed loops of N syntheses at once.

    <env python> bench/batching_worker.py --cosyvoice-root CHECKOUT --model-dir DIR \\
        --path threads|vllm|batched --levels 1,4,8 --rounds 1 --modes whole,stream --prompt WAV

``threads``: today's path, each synthesis a thread of its own in one model (upstream's plain
PyTorch LLM); ``vllm``: upstream's ``load_vllm``, the LLM steps of all batched by vLLM;
``batched``: vLLM and the flow and HiFT batched across syntheses (--token2wav-batch). Modes:
``whole`` and ``stream`` syntheses, and ``llm``: upstream's ``llm_job`` alone, as each
synthesis's LLM thread calls it (speech tokens, no audio: the LLM's own throughput). Prints
one JSON line per level and mode: syntheses, wall seconds, audio seconds, speech tokens the
LLM made, each synthesis' seconds to its first chunk (streamed) or to its audio (whole), CPU
seconds of this process and its children (vLLM's engine process) in that time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = "The weather is nice today, so let us take a walk in the park."


def cpu_seconds() -> float:
    """CPU seconds (user and system) of this process and its descendants, from /proc (the
    upstream environment has no psutil): vLLM's engine process is one."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    mine, total = {os.getpid()}, 0.0
    while True:  # (descendants, generation by generation)
        more = {pid for pid, (parent, _) in stats.items() if parent in mine and pid not in mine}
        if not more:
            break
        mine |= more
    return total + sum(stats[pid][1] for pid in mine if pid in stats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cosyvoice-root", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--path", choices=("threads", "vllm", "batched"), required=True)
    parser.add_argument("--levels", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--modes", default="whole,stream", help="whole, stream, llm (upstream's llm_job alone)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--window", type=float, default=20.0, help="--token2wav-window (ms) for batched")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from cosyvoice_lb.instance.engines import SynthesisRequest
    from cosyvoice_lb.instance.engines.cosyvoice import CosyVoiceEngine

    levels = [int(x) for x in args.levels.split(",")]
    began = time.monotonic()
    engine = CosyVoiceEngine(
        model_dir=args.model_dir,
        cosyvoice_root=args.cosyvoice_root,
        load_vllm=args.path != "threads",
        concurrency=max(levels),
        token2wav_batch=8 if args.path == "batched" else 1,
        token2wav_window=args.window,
    )
    engine.load()
    assert engine.model is not None
    model = engine.model.model
    made = {"tokens": 0}
    lock = threading.Lock()
    job = model.llm_job

    def counted(text, prompt_text, llm_prompt_speech_token, llm_embedding, uuid):
        try:
            job(text, prompt_text, llm_prompt_speech_token, llm_embedding, uuid)
        finally:
            with lock:
                made["tokens"] += len(model.tts_speech_token_dict.get(uuid) or [])

    model.llm_job = counted
    print(json.dumps({"ready": time.monotonic() - began, "own_path": engine.own_path, "batch": engine.batch_off}),
          flush=True)  # fmt: skip

    front = engine.model.frontend.frontend_zero_shot(  # (the prompt's transcript: tests/fake_cosyvoice)
        args.text,
        "You are a helpful assistant.<|endofprompt|>希望你以后能够做的比我还好呦。",
        args.prompt,
        engine.sample_rate,
        "",
    )
    llm_inputs = (front["text"], front["prompt_text"], front["llm_prompt_speech_token"], front["llm_embedding"])

    def llm_only(out: list) -> None:
        """Upstream's llm_job alone, as a synthesis's LLM thread calls it: tokens, no audio."""
        key = f"bench-{threading.get_ident()}-{time.monotonic_ns()}"
        with model.lock:
            model.tts_speech_token_dict[key], model.llm_end_dict[key] = [], False
        started = time.monotonic()
        counted(*llm_inputs, key)
        with model.lock:
            model.tts_speech_token_dict.pop(key, None)
            model.llm_end_dict.pop(key, None)
        out.append({"first": time.monotonic() - started, "audio": 0.0})

    def one(stream: bool, out: list) -> None:
        request = SynthesisRequest(text=args.text, mode="cross_lingual", prompt_wav=args.prompt, stream=stream)
        started, first, samples = time.monotonic(), None, 0
        try:
            for chunk in engine.synthesize(request):
                first = first if first is not None else time.monotonic() - started
                samples += chunk.size
        except Exception as exc:  # noqa: BLE001 - counted as failed
            out.append({"failed": f"{type(exc).__name__}: {exc}"})
            return
        out.append({"first": first, "audio": samples / engine.sample_rate})

    for mode in args.modes.split(","):
        stream = mode == "stream"
        run = (lambda out: llm_only(out)) if mode == "llm" else (lambda out, stream=stream: one(stream, out))
        run([])  # warm: the first calls of this mode
        for level in levels:
            results: list = []

            def client(results=results, run=run) -> None:
                for _ in range(args.rounds):
                    run(results)

            tokens, cpu, started = made["tokens"], cpu_seconds(), time.monotonic()
            threads = [threading.Thread(target=client) for _ in range(level)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            wall = time.monotonic() - started
            good = [r for r in results if "failed" not in r]
            print(json.dumps({
                "path": args.path, "window": args.window, "mode": mode, "concurrency": level, "syntheses": len(results),
                "failed": [r["failed"] for r in results if "failed" in r], "wall": wall,
                "audio": sum(r["audio"] for r in good), "tokens": made["tokens"] - tokens,
                "first": [r["first"] for r in good if r["first"] is not None], "cpu": cpu_seconds() - cpu,
            }), flush=True)  # fmt: skip
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
