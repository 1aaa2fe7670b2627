#!/usr/bin/env python3
"""Long-form jobs: a big job across the cluster against one instance, and what a job running
does to short interactive requests.

    python bench/jobs.py [--chars 50000] [--instances 4] [--repeats 2] [--requests 1000]
                         [--rate 12] [--ms-per-char 1] [--job-slots auto]
                         [--fairness-only | --scale-only] [--csv PATH]

Starts clusters of the simulated engine (a GPU-bound instance's load model: a wait of
--ms-per-char per character, one synthesis at a time per instance) with the CLI, one after
the other, on free 127.0.0.1 ports, and always takes them down again (also on Ctrl-C and
SIGTERM):

  cluster      --instances N, --job-slots auto (the default: jobs take all N while no
               interactive request comes and yield down to a quarter, at least 1, the moment
               one does; --job-slots K here instead)
  all slots    --instances N, --job-slots N (what the job alone could use)
  one          1 instance (--job-slots auto is then 1)

Scale: per cluster and repeat, a --chars job (a seeded mix of sentence lengths) is posted to
``/v1/audio/jobs`` and polled every 0.1 s until it succeeded: seconds from the POST.

Fairness, on "cluster": --requests short texts (``/v1/tts``, one common sentence, as many
clients send) at --rate per second, Poisson arrivals (open loop: a slow answer does not slow
the offered load down), first with no job, then while jobs of --max-job-chars run (enough
of them queued that they outlast the load; checked after). p50/p90/p99 of each, and the
ratio during / without. --fairness-only: "cluster" alone, its job once, then the load.
--scale-only: "cluster" and "all slots", the job --repeats times on each, no load (the job's
throughput at --job-slots against all of the slots).

Prints the command, a table per part and the ratios the targets are about: the job on N
instances <= 0.3 x one instance, the short requests' p99 during a job <= 1.5 x without.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import load  # noqa: E402  (bench/load.py: the load, SIGTERM as Ctrl-C, the shield)
from cosyvoice_lb.launcher.cluster.ports import free_port_block  # noqa: E402
from long_text import spread, text_of  # noqa: E402  (the same seeded mix of sentence lengths)

SHORT = "Your order has shipped."  # a common short text: many clients send the same one
MAX_JOB_CHARS = 200_000  # the default --max-job-chars: the fairness part's jobs are this big
POLL = 0.1
ACTIVE = ("queued", "running")


class Cluster:
    def __init__(self, instances: int, args: argparse.Namespace, job_slots: str = "auto"):
        self.state = Path(tempfile.mkdtemp(prefix="cvlb-jb-", dir="/tmp"))
        self.port = free_port_block(instances + 1)
        self.command = [
            *load.cli_command(), "up", "--engine", "simulated", "--instances", str(instances),
            "--port", str(self.port), "--base-port", str(self.port + 1), "--state-dir", str(self.state),
            "--simulated-ms-per-char", str(args.ms_per_char), "--simulated-base-ms", str(args.base_ms),
            "--segment-chars", str(args.segment_chars), "--job-slots", job_slots,
            "--max-queue", "64",
        ]  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = requests.Session()
        self.http.trust_env = False

    def __enter__(self) -> Cluster:
        load.cluster_up(self.command, self.state, ROOT)
        return self

    def __exit__(self, *_exc: object) -> None:
        load.cluster_down(self.state, ROOT)

    def post(self, text: str) -> dict:
        answer = self.http.post(self.url + "/v1/audio/jobs", json={"input": text, "response_format": "wav"}, timeout=60)
        if answer.status_code != 202:
            raise SystemExit(f"POST /v1/audio/jobs answered {answer.status_code}: {answer.text}")
        return answer.json()

    def job(self, job_id: str) -> dict:
        answer = self.http.get(f"{self.url}/v1/audio/jobs/{job_id}", timeout=30)
        answer.raise_for_status()
        return answer.json()

    def cancel(self, job_id: str) -> None:
        self.http.delete(f"{self.url}/v1/audio/jobs/{job_id}", timeout=30)


def job_seconds(cluster: Cluster, text: str, limit: float) -> float:
    """Seconds from the POST until the job succeeded (polled every POLL s, at most ``limit``)."""
    t0 = time.monotonic()
    job = cluster.post(text)
    while job["status"] in ACTIVE:
        if time.monotonic() - t0 > limit:
            cluster.cancel(job["id"])
            raise SystemExit(f"the job did not finish in {limit:.0f} s: {job}")
        time.sleep(POLL)
        job = cluster.job(job["id"])
    if job["status"] != "succeeded":
        raise SystemExit(f"the job {job['status']}: {job}")
    return time.monotonic() - t0


def short_load(cluster: Cluster, args: argparse.Namespace, seed: int) -> list[load.Result]:
    seconds = args.requests / args.rate
    results = load.run(
        load.open_loop(
            cluster.url + "/v1/tts",
            args.rate,
            seconds * 3,  # (the count bounds it: --requests arrivals at most)
            lambda _rng: ("short", {"text": SHORT}),
            seed=seed,
            max_requests=args.requests,
        )
    )
    return results


def percentiles(results: list[load.Result]) -> tuple[float, float, float]:
    good = np.array([r.latency for r in results if r.status == 200]) * 1000
    if not good.size:
        return (math.nan,) * 3
    p50, p90, p99 = np.percentile(good, [50, 90, 99])
    return float(p50), float(p90), float(p99)


def write_csv(path: str, scale: dict[str, list[float]], fairness: dict[str, list[load.Result]]) -> None:
    with open(path, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["part", "setup", "repeat_or_request", "status", "seconds"])
        for name, values in scale.items():
            for i, value in enumerate(values):
                writer.writerow(["job", name, i, 200, f"{value:.4f}"])
        for name, results in fairness.items():
            for i, r in enumerate(results):
                writer.writerow(["short", name, i, r.status, f"{r.latency:.5f}"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chars", type=int, default=50_000)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--requests", type=int, default=1000, help="short requests per condition")
    parser.add_argument("--rate", type=float, default=12.0, help="short requests per second (Poisson)")
    parser.add_argument("--ms-per-char", type=float, default=1.0)
    parser.add_argument("--base-ms", type=float, default=10.0)
    parser.add_argument("--segment-chars", type=int, default=200)
    parser.add_argument("--job-slots", default="auto", help='the "cluster" setup\'s --job-slots')
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--fairness-only", action="store_true", help='"cluster" only, its job once')
    only.add_argument("--scale-only", action="store_true", help='"cluster" and "all slots", no load')
    parser.add_argument("--csv", default=str(ROOT / "bench" / "results" / "jobs.csv"))
    args = parser.parse_args()
    load.stop_on_sigterm()
    text = text_of(args.chars)
    limit = 3 * args.chars * args.ms_per_char / 1000 + 120  # (a bound on one job: 3x one instance's work)
    n = args.instances
    setups: tuple[tuple[str, int, str], ...] = (
        ("cluster", n, args.job_slots),
        ("all slots", n, str(n)),
        ("one", 1, "auto"),
    )
    if args.fairness_only:
        setups, args.repeats = setups[:1], 1
    if args.scale_only:
        setups = setups[:2]
    scale: dict[str, list[float]] = {}
    fairness: dict[str, list[load.Result]] = {}
    job_progress = ""
    for name, instances, slots in setups:
        print(f"# {name}: {instances} instance(s), --job-slots {slots}", flush=True)
        with Cluster(instances, args, slots) as cluster:
            cluster.http.post(cluster.url + "/v1/tts", json={"text": SHORT}, timeout=60)  # (warm)
            scale[name] = [job_seconds(cluster, text, limit) for _ in range(args.repeats)]
            print(f"  {args.chars} characters: {' '.join(f'{s:.2f}' for s in scale[name])} s", flush=True)
            if name != "cluster" or args.scale_only:
                continue
            print(f"  {args.requests} short requests at {args.rate:g}/s, no job", flush=True)
            fairness["no job"] = short_load(cluster, args, seed=1)
            # jobs enough to outlast the load: (load seconds x slots) of engine time, and one more
            work = args.requests / args.rate * max(1, n - 1) * 1000 / args.ms_per_char
            big = text_of(MAX_JOB_CHARS - 100, seed=2)
            jobs = [cluster.post(big) for _ in range(int(work // MAX_JOB_CHARS) + 2)]
            while cluster.job(jobs[0]["id"])["status"] == "queued":
                time.sleep(POLL)
            print(f"  the same during {len(jobs)} jobs of {MAX_JOB_CHARS} characters", flush=True)
            fairness["during a job"] = short_load(cluster, args, seed=1)
            states = [cluster.job(j["id"]) for j in jobs]
            running = [s for s in states if s["status"] in ACTIVE]
            if not running:
                raise SystemExit("the jobs finished before the load did: raise --requests / --rate, or lower it")
            job_progress = ", ".join(f"{s['status']} {s['progress']['done']}/{s['progress']['total']}" for s in states)
            for j in jobs:
                cluster.cancel(j["id"])
    command = (f"$ python bench/jobs.py --chars {args.chars} --instances {n} --repeats {args.repeats} "
               f"--requests {args.requests} --rate {args.rate:g} --ms-per-char {args.ms_per_char:g}"
               f"{' --job-slots ' + args.job_slots if args.job_slots != 'auto' else ''}"
               f"{' --fairness-only' if args.fairness_only else ''}{' --scale-only' if args.scale_only else ''}")  # fmt: skip
    print(f"\n{command}")
    print(f"simulated engine, {args.ms_per_char:g} ms/char + {args.base_ms:g} ms; segments of <= {args.segment_chars} "
          f"characters\n")  # fmt: skip
    print(f"a {args.chars}-character job, POST to succeeded; seconds, median (min-max) of {args.repeats}")
    print(f"{'':12}{'instances':>10}{'job slots':>10}{'seconds':>26}{'/ one':>8}")
    one = statistics.median(scale["one"]) if "one" in scale else math.nan
    for name, instances, slots in setups:
        ratio = statistics.median(scale[name]) / one
        print(f"{name:12}{instances:>10}{slots:>10}{spread(scale[name]):>26}{ratio:>8.3f}")
    if args.scale_only:
        ratio = statistics.median(scale["cluster"]) / statistics.median(scale["all slots"])
        print(f"\njob with --job-slots {args.job_slots} / with all {n} slots: {ratio:.3f} (target <= 1.1)")
        write_csv(args.csv, scale, fairness)
        return 0 if ratio <= 1.1 else 1
    print(f"\nshort requests ({SHORT!r}, {args.rate:g}/s Poisson, {args.requests} each) on {n} instances")
    print(f"{'':14}{'requests':>9}{'failed':>7}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'beyond p99':>11}")
    ps = {}
    for name, results in fairness.items():
        ps[name] = percentiles(results)
        failed = sum(1 for r in results if r.status != 200)
        beyond = sum(1 for r in results if r.status == 200 and r.latency * 1000 > ps[name][2])
        print(f"{name:14}{len(results):>9}{failed:>7}" + "".join(f"{p:>9.1f}" for p in ps[name]) + f"{beyond:>11}")
    print(f"(the jobs when the load ended: {job_progress})")
    scale_ratio = statistics.median(scale["cluster"]) / one
    all_ratio = statistics.median(scale["all slots"]) / one if "all slots" in scale else math.nan
    p99_ratio = ps["during a job"][2] / ps["no job"][2]
    p50_ratio = ps["during a job"][0] / ps["no job"][0]
    print(f"\njob: {n} instances / one = {scale_ratio:.3f} with --job-slots {args.job_slots}, {all_ratio:.3f} with all "
          f"{n} (target <= 0.3)")  # fmt: skip
    print(f"short requests during a job / without: p99 {p99_ratio:.3f} (target <= 1.5), p50 {p50_ratio:.3f}")
    write_csv(args.csv, scale, fairness)
    return 0 if min(scale_ratio, all_ratio) <= 0.3 and p99_ratio <= 1.5 else 1  # (nan: not met)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (KeyboardInterrupt, load.Interrupted):
        sys.exit(130)
