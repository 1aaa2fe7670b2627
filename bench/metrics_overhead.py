#!/usr/bin/env python3
"""What the instance's metrics cost: each synthesis and each API request with the metrics
on against the same with them off, and what one scrape of /metrics takes.

    python bench/metrics_overhead.py [--syntheses 20000] [--requests 2000] [--repeats 5]

In one process, no network: an engine that makes three 0.1 s chunks at once, so what is
timed is the instance's own bookkeeping, not speech (a real synthesis takes 100-1000 times
longer). "off" is the same pipeline with its metrics disabled (as an instance whose Python
lacks prometheus_client runs); the request counter and its log line stay in both. Prints
the median of the repeats with their min-max, and the ratio on/off.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cosyvoice_lb.instance.metrics import Metrics  # noqa: E402
from cosyvoice_lb.instance.speech.admission import Admission  # noqa: E402
from cosyvoice_lb.instance.speech.pipeline import Pipeline  # noqa: E402


class Instant:
    """Three 0.1 s chunks of audio, made at once."""

    name, sample_rate, modes = "instant", 16000, ("sft",)
    chunk = np.full(1600, 0.1, dtype=np.float32)

    def speakers(self):
        return []

    def load(self):
        pass

    def synthesize(self, request):
        yield from (self.chunk, self.chunk, self.chunk)


def pipeline(metrics_on: bool) -> Pipeline:
    metrics = Metrics("instant")
    if not metrics_on:
        metrics = Metrics.__new__(Metrics)
        metrics.enabled, metrics.live = False, dict
    p = Pipeline(Instant(), Admission(), metrics=metrics)
    p.load()
    return p


def per_synthesis(p: Pipeline, count: int) -> float:
    job = p.prepare({"text": "hello"})
    started = time.perf_counter()
    for _ in range(count):
        p.synthesize(job)
    return (time.perf_counter() - started) / count


def per_request(p: Pipeline, count: int) -> float:
    from fastapi.testclient import TestClient

    from cosyvoice_lb.instance.server import build_app

    with TestClient(build_app(p, "instant", 7860)) as client:
        client.post("/v1/tts", json={"text": "warm"})
        started = time.perf_counter()
        for _ in range(count):
            client.post("/v1/tts", json={"text": "hello"})
        return (time.perf_counter() - started) / count


def per_scrape(p: Pipeline, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        p.metrics.exposition()
    return (time.perf_counter() - started) / count


def spread(values: list[float]) -> str:
    us = [v * 1e6 for v in values]
    return f"{statistics.median(us):9.1f} µs ({min(us):.1f}-{max(us):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--syntheses", type=int, default=20000)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--scrapes", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    logging.getLogger("cosyvoice_lb").setLevel(logging.WARNING)  # (the request line is formatted, not written)
    print(
        f"$ python bench/metrics_overhead.py --syntheses {args.syntheses} --requests {args.requests} "
        f"--scrapes {args.scrapes} --repeats {args.repeats}"
    )
    rows = []
    for what, measure, count in (
        ("synthesis (pipeline)", per_synthesis, args.syntheses),
        ("API request (/v1/tts)", per_request, args.requests),
    ):
        on, off = [], []
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            off.append(measure(pipeline(False), count))
            on.append(measure(pipeline(True), count))
        ratio = statistics.median(on) / statistics.median(off)
        extra = (statistics.median(on) - statistics.median(off)) * 1e6
        rows.append((what, spread(off), spread(on), f"{ratio:.3f}", f"{extra:+.1f} µs"))
    loaded = pipeline(True)
    per_synthesis(loaded, 1000)  # (series for one route filled in)
    scrape = [per_scrape(loaded, args.scrapes) for _ in range(args.repeats)]
    size = len(loaded.metrics.exposition()[0])
    print(f"\n{'':24}{'metrics off':>28}{'metrics on':>28}{'on/off':>9}{'added':>12}")
    for what, off_text, on_text, ratio_text, extra_text in rows:
        print(f"{what:24}{off_text:>28}{on_text:>28}{ratio_text:>9}{extra_text:>12}")
    print(f"{'one scrape of /metrics':24}{'':28}{spread(scrape):>28}   ({size} bytes)")


if __name__ == "__main__":
    main()
