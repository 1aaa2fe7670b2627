#!/usr/bin/env python3
"""What the speech check costs and what it says: pocketsphinx on real speech (each flite
voice), espeak-ng's voice, a tone and noise, in one run.

    python bench/speech_check.py [--repeats 5]

For each source: the sentences below synthesized once, then each transcribed ``--repeats``
times by the speech check's own recogniser adapter (``instance/quality/recognizers.py``) and
scored by its scorer (``score.py``). Prints, per source, the audio seconds, the error
(WER) mean and worst, and the recogniser's CPU milliseconds (thread time) and wall
milliseconds per second of audio: median of the repeats, with their min-max. The check runs
in a worker of its own, after an answer was sent: this is the CPU it takes beside the
engine, not a delay any client sees.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cosyvoice_lb.instance.engines import SynthesisRequest, create_engine  # noqa: E402
from cosyvoice_lb.instance.quality.recognizers import Pocketsphinx  # noqa: E402
from cosyvoice_lb.instance.quality.score import score  # noqa: E402

SENTENCES = (
    "Hello, this is a short check of the voice.",
    "The weather is nice today.",
    "Please call me back at your earliest convenience.",
    "The birch canoe slid on the smooth planks.",
    "Thank you for calling, how can I help you today?",
)
RATE = 16000


def sources() -> list[tuple[str, list[tuple[str, np.ndarray, int]]]]:
    """(name, [(text, audio, rate)]) for every source."""
    made = []
    flite = create_engine("flite")
    flite.load()
    for voice in flite.speakers():
        said = [np.concatenate(list(flite.synthesize(SynthesisRequest(text=t, speaker=voice)))) for t in SENTENCES]
        made.append((f"flite {voice}", [(t, a, flite.sample_rate) for t, a in zip(SENTENCES, said)]))
    espeak = create_engine("espeak")
    espeak.load()
    said = [np.concatenate(list(espeak.synthesize(SynthesisRequest(text=t)))) for t in SENTENCES]
    made.append(("espeak-ng", [(t, a, espeak.sample_rate) for t, a in zip(SENTENCES, said)]))
    t = np.arange(3 * RATE) / RATE
    made.append(
        ("220 Hz tone, 3 s", [(s, (0.5 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), RATE) for s in SENTENCES])
    )
    noise = np.random.default_rng(0).normal(0, 0.3, t.size).astype(np.float32)
    made.append(("noise, 3 s", [(s, noise, RATE) for s in SENTENCES]))
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    started = time.monotonic()
    t0 = time.thread_time()
    recognizer = Pocketsphinx()
    load_cpu = time.thread_time() - t0
    print(f"$ python bench/speech_check.py --repeats {args.repeats}\n")
    print(f"pocketsphinx loaded in {load_cpu * 1000:.0f} ms of CPU\n")
    print(
        "| source | sentences | audio s | WER mean | WER worst | CPU ms per audio s (min-max) | wall ms per audio s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, items in sources():
        seconds = sum(a.size / r for _, a, r in items)
        cpu, wall, errors = [], [], []
        for _ in range(args.repeats):
            c0, w0 = time.thread_time(), time.perf_counter()
            heard = [recognizer.transcribe(a, r) for _, a, r in items]
            cpu.append((time.thread_time() - c0) * 1000 / seconds)
            wall.append((time.perf_counter() - w0) * 1000 / seconds)
            errors = [score(t, h).ratio for (t, _, _), h in zip(items, heard)]
        print(
            f"| {name} | {len(items)} | {seconds:.1f} | {statistics.mean(errors):.2f} | {max(errors):.2f} | "
            f"{statistics.median(cpu):.0f} ({min(cpu):.0f}-{max(cpu):.0f}) | {statistics.median(wall):.0f} |"
        )
    print(f"\n{time.monotonic() - started:.0f} s in all")


if __name__ == "__main__":
    main()
