#!/usr/bin/env python3
"""Long text across the cluster against one instance doing it alone.

    python bench/long_text.py [--chars 5000] [--instances 4] [--repeats 3] [--csv PATH]

Starts two clusters of the simulated engine (a GPU-bound instance's load model: a wait of
--ms-per-char per character, one synthesis at a time per instance) with the CLI, one after
the other, on free 127.0.0.1 ports, and always takes them down again (also on Ctrl-C and
SIGTERM):

  cluster   --instances N: a text past --max-chars is split and its segments fanned out
  one       1 instance: the same segments, one after another (what one instance does alone)

Per cluster and repeat it sends the same text (a seeded mix of sentence lengths) twice:
streamed (``"stream": true``), timing the first audio bytes after the WAV header, and
whole, timing the full answer. "one segment" is a single request of one typical segment's
length on the cluster. Prints a table (median of the repeats, min-max beside it) and the
ratios the targets are about: total <= 0.3 x one instance, first audio <= 1.5 x one segment.
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import load  # noqa: E402  (bench/load.py: SIGTERM stops the run as Ctrl-C does)
from cosyvoice_lb.instance.audio.segments import split_text  # noqa: E402
from cosyvoice_lb.launcher.cluster.ports import free_port_block  # noqa: E402

WORDS = "the a cluster splits long texts at sentence ends and speaks every segment at once on its instances".split()


def text_of(chars: int, seed: int = 1) -> str:
    rng = random.Random(seed)
    sentences, total = [], 0
    while total < chars:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30))).capitalize() + ". "
        sentences.append(sentence)
        total += len(sentence)
    return "".join(sentences)[:chars].rstrip() + "."


class Cluster:
    def __init__(self, instances: int, args: argparse.Namespace):
        self.state = Path(tempfile.mkdtemp(prefix="cvlb-lt-", dir="/tmp"))
        self.port = free_port_block(instances + 1)
        base = self.port + 1
        self.command = [
            sys.executable, "-m", "cosyvoice_lb.launcher.cli", "up", "--engine", "simulated", "--instances", str(instances),
            "--port", str(self.port), "--base-port", str(base), "--state-dir", str(self.state),
            "--simulated-ms-per-char", str(args.ms_per_char), "--max-chars", "500",
            "--segment-chars", str(args.segment_chars), "--request-timeout", "600", "--hang-timeout", "300",
        ]  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Cluster:
        load.cluster_up(self.command, self.state, ROOT)
        return self

    def __exit__(self, *_exc: object) -> None:
        load.cluster_down(self.state, ROOT)


def streamed(http: requests.Session, url: str, text: str) -> tuple[float, float]:
    """(seconds to the first audio after the WAV header, seconds to the end)."""
    t0 = time.monotonic()
    first = None
    with http.post(url + "/v1/tts", json={"text": text, "stream": True}, stream=True, timeout=600) as r:
        r.raise_for_status()
        got = 0
        for chunk in r.iter_content(4096):
            got += len(chunk)
            if first is None and got > 44:
                first = time.monotonic() - t0
    return first or float("nan"), time.monotonic() - t0


def whole(http: requests.Session, url: str, text: str) -> float:
    t0 = time.monotonic()
    r = http.post(url + "/v1/tts", json={"text": text}, timeout=600)
    r.raise_for_status()
    return time.monotonic() - t0


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f}  ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chars", type=int, default=5000)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ms-per-char", type=float, default=4.0)
    parser.add_argument("--segment-chars", type=int, default=200)
    parser.add_argument("--csv", default=str(ROOT / "bench" / "results" / "long_text.csv"))
    args = parser.parse_args()
    load.stop_on_sigterm()
    text = text_of(args.chars)
    segments = split_text(text, args.segment_chars, first_chars=args.segment_chars // 2)
    typical = sorted(segments, key=len)[len(segments) // 2]
    http = requests.Session()
    http.trust_env = False
    rows: dict[str, dict[str, list[float]]] = {}
    for name, instances in (("cluster", args.instances), ("one", 1)):
        print(f"# {name}: {instances} instance(s), {len(text)} characters in {len(segments)} segments", flush=True)
        with Cluster(instances, args) as cluster:
            whole(http, cluster.url, typical)  # warm: connections, first requests
            row = rows[name] = {"first": [], "streamed total": [], "total": [], "one segment": []}
            for _ in range(args.repeats):
                first, end = streamed(http, cluster.url, text)
                row["first"].append(first)
                row["streamed total"].append(end)
                row["total"].append(whole(http, cluster.url, text))
                row["one segment"].append(whole(http, cluster.url, typical))
    print(f"\n$ python bench/long_text.py --chars {args.chars} --instances {args.instances} --repeats {args.repeats}")
    print(f"simulated engine, {args.ms_per_char:g} ms/char; {len(segments)} segments of <= {args.segment_chars} "
          f"characters (median {len(typical)}); seconds, median (min-max) of {args.repeats}")  # fmt: skip
    print(f"{'':16}{'total':>24}{'first audio':>24}{'streamed total':>24}{'one segment':>24}")
    for name in ("cluster", "one"):
        r = rows[name]
        print(f"{name:16}{spread(r['total']):>24}{spread(r['first']):>24}{spread(r['streamed total']):>24}"
              f"{spread(r['one segment']):>24}")  # fmt: skip
    total_ratio = statistics.median(rows["cluster"]["total"]) / statistics.median(rows["one"]["total"])
    first_ratio = statistics.median(rows["cluster"]["first"]) / statistics.median(rows["cluster"]["one segment"])
    print(f"\ntotal: cluster / one instance = {total_ratio:.3f} (target <= 0.3)")
    print(f"first audio / one segment = {first_ratio:.3f} (target <= 1.5)")
    with open(args.csv, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["cluster", "measure", "repeat", "seconds"])
        for name, r in rows.items():
            for measure, values in r.items():
                for i, value in enumerate(values):
                    writer.writerow([name, measure, i, f"{value:.4f}"])
    return 0 if total_ratio <= 0.3 and first_ratio <= 1.5 else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (KeyboardInterrupt, load.Interrupted):
        sys.exit(130)
