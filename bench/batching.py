#!/usr/bin/env python3
"""Batching, measured on upstream's code on this box: today's threads, vLLM, and vLLM with
the flow and HiFT batched, side by side in one run.

    python bench/batching.py --cosyvoice-root CHECKOUT --plain-python PY --vllm-python VPY \\
        --small-model DIR [--full-model DIR] [--levels 1,4,8] [--rounds 1]

For each model (the small random-weight one, and with --full-model upstream's full size with
random weights, built there by tests/upstream/build_model.py --full when missing), each path
and each of whole and streamed syntheses, closed loops of 1, 4 and 8 syntheses at once in
one instance's engine (bench/batching_worker.py, in the path's own Python: the plain
upstream environment for threads, the vLLM one for the others):

- LLM tokens/s: speech tokens all syntheses' LLM made, per wall second;
- audio s/s: seconds of audio made per wall second;
- first chunk p50/p90: seconds from a synthesis' start to its first chunk (streamed), or to
  its audio (whole);
- CPU s per audio s: CPU seconds of the engine's process and its children (vLLM's engine
  process) per second of audio.

Then the ratios the targets are about, at the most syntheses at once: vLLM's LLM tokens/s
over the threads', and the batched path's audio s/s over vLLM's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from concurrency import percentile, table, uptime  # noqa: E402  (bench/concurrency.py)

PROMPT = ROOT / "tests" / "fake_cosyvoice" / "asset" / "zero_shot_prompt.wav"
PATHS = ("threads", "vllm", "batched")
TEXT = "The weather is nice today, so let us take a walk in the park."
FULL_TEXT = "Nice weather today."  # (upstream's full-size flow on 2 cores: ~13 s per 6 s of mel)
WORKER = ROOT / "bench" / "batching_worker.py"


def label(result: dict) -> str:
    """The path, and for the batched one its window when not the default."""
    window = result.get("window", 20.0)
    return result["path"] + (f" ({window:g} ms)" if result["path"] == "batched" and window != 20.0 else "")


def rows_of(model: str, results: list[dict]) -> list[list[object]]:
    """One table row per path, mode and level."""
    rows: list[list[object]] = []
    for r in results:
        first = sorted(r["first"])
        wall = r["wall"] or math.nan
        rows.append([model, label(r), r["mode"], r["concurrency"], r["syntheses"], len(r["failed"]),
                     r["tokens"] / wall, r["audio"] / wall, percentile(first, 50), percentile(first, 90),
                     r["cpu"] / r["audio"] if r["audio"] else math.nan])  # fmt: skip
    return rows


def ratios(model: str, results: list[dict], level: int) -> list[list[object]]:
    """At ``level`` at once, per mode: vLLM's LLM tokens/s over the threads', the batched
    path's audio s/s over vLLM's."""

    def rate(path: str, mode: str, key: str) -> float:
        found = [r for r in results if (label(r), r["mode"], r["concurrency"]) == (path, mode, level)]
        return found[0][key] / found[0]["wall"] if found and found[0]["wall"] else math.nan

    rows: list[list[object]] = []
    for mode in sorted({r["mode"] for r in results}):
        llm = over(rate("vllm", mode, "tokens"), rate("threads", mode, "tokens"))
        audio = over(rate("batched", mode, "audio"), rate("vllm", mode, "audio"))
        rows.append([model, mode, level, llm, audio])
    return rows


def over(a: float, b: float) -> float:
    """a / b, NaN where b is nothing (a path or a quantity not measured)."""
    return a / b if b and not math.isnan(b) else math.nan


def run_worker(
    python: str, path: str, model_dir: str, args: argparse.Namespace, log: Path, text: str, window: float = 20.0
) -> list[dict]:
    command = [python, str(WORKER), "--cosyvoice-root", args.cosyvoice_root, "--model-dir", model_dir,
               "--path", path, "--levels", args.levels, "--rounds", str(args.rounds), "--modes", args.modes,
               "--prompt", str(PROMPT), "--text", text, "--window", str(window)]  # fmt: skip
    with open(log, "a") as err:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, timeout=args.limit)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{path} on {model_dir} failed (exit {done.returncode}): see {log}")
    print(f"# {path}: loaded in {lines[0]['ready']:.0f} s ({lines[0]})", file=sys.stderr, flush=True)
    return lines[1:]


def profile(args: argparse.Namespace, model_dir: str) -> list[list[object]]:
    """bench/flow_profile.py in upstream's environment: its rows."""
    done = subprocess.run([args.plain_python, str(ROOT / "bench" / "flow_profile.py"), "--cosyvoice-root",
                           args.cosyvoice_root, "--model-dir", model_dir], capture_output=True, text=True,
                          cwd=ROOT, timeout=args.limit)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"bench/flow_profile.py failed: {done.stderr[-2000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    return [[r["utterances"], r["dit_step_ms"], r["dit_step_ms_each"], r["hift_ms"], r["hift_ms_each"]] for r in found]


def full_model(args: argparse.Namespace) -> str:
    where = Path(args.full_model)
    if not (where / "llm.pt").is_file():
        print(f"# building the full-size model into {where} (about a minute)", file=sys.stderr, flush=True)
        subprocess.run([args.plain_python, str(ROOT / "tests" / "upstream" / "build_model.py"), "--cosyvoice-root",
                        args.cosyvoice_root, "--out", str(where), "--full"], check=True, timeout=1800)  # fmt: skip
    return str(where)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cosyvoice-root", required=True, help="upstream CosyVoice's checkout")
    parser.add_argument(
        "--plain-python", required=True, help="upstream's environment (tests/upstream/requirements.txt)"
    )
    parser.add_argument("--vllm-python", required=True, help="the vLLM one (tests/upstream/requirements-vllm.txt)")
    parser.add_argument("--small-model", required=True, help="the small model, LLM 128 wide (--llm-width 128)")
    parser.add_argument("--full-model", default="", help="a dir for the full-size random-weight model (built once)")
    parser.add_argument("--levels", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=1, help="syntheses each client makes per level")
    parser.add_argument("--full-rounds", type=int, default=1)
    parser.add_argument("--text", default=TEXT, help="what each synthesis says (the small model)")
    parser.add_argument("--full-text", default=FULL_TEXT, help="what each synthesis says (the full-size model)")
    parser.add_argument("--modes", default="whole,stream")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--windows", default="", help="also the batched path at these --token2wav-window (ms)")
    parser.add_argument("--limit", type=float, default=7200.0, help="seconds one path may take")
    parser.add_argument("--log", default="/tmp/cvlb-batching.log")
    args = parser.parse_args()
    command = " ".join(["python", "bench/batching.py", *sys.argv[1:]])
    out = [f"$ {command}", "", f"{os.cpu_count()} cores; at the start: {uptime()}", ""]
    pythons = {"threads": args.plain_python, "vllm": args.vllm_python, "batched": args.vllm_python}
    models = [("small", args.small_model, args.rounds, args.text)]
    if args.full_model:
        models.append(("full", full_model(args), args.full_rounds, args.full_text))
    rows, ratio_rows, began = [], [], time.monotonic()
    most = max(int(x) for x in args.levels.split(","))
    for name, model_dir, rounds, text in models:
        results: list[dict] = []
        for path in args.paths.split(","):
            print(f"# {name} model, {path}, at {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
            args.rounds = rounds
            results += run_worker(pythons[path], path, model_dir, args, Path(args.log), text)
        for window in (w for w in args.windows.split(",") if w.strip()):
            print(f"# {name} model, batched at {window} ms, at {time.monotonic() - began:.0f} s", file=sys.stderr)
            results += run_worker(args.vllm_python, "batched", model_dir, args, Path(args.log), text, float(window))
        rows += rows_of(name, results)
        ratio_rows += ratios(name, results, most)
        print("\n".join(out + [table(HEADER, rows)]), file=sys.stderr, flush=True)
    profiles = [[name, *cells] for name, model_dir, _r, _t in models for cells in profile(args, model_dir)]
    out += ["### LLM tokens, audio and first chunks by path", "", table(HEADER, rows), "",
            "### where a batch's time goes: upstream's flow (one DiT step) and HiFT, per utterance "
            "(bench/flow_profile.py, 300 mel frames)", "",
            table(["model", "utterances a run", "DiT step ms", "DiT step ms each", "HiFT ms", "HiFT ms each"],
                  profiles), "",
            f"### at {most} at once", "", table(["model", "mode", "at once", "vLLM ÷ threads: LLM tokens/s",
                                                   "batched ÷ vLLM: audio s/s"], ratio_rows), "",
            f"at the end: {uptime()}; {time.monotonic() - began:.0f} s in all"]  # fmt: skip
    print("\n".join(out), flush=True)
    return 0


HEADER = ["model", "path", "mode", "at once", "syntheses", "failed", "LLM tokens/s", "audio s/s",
          "first chunk p50 s", "first chunk p90 s", "CPU s per audio s"]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
