#!/usr/bin/env python3
"""CosyVoice3 on upstream's own code (CPU, a small random-weight model): the first chunk
through the cluster against upstream's own call, and audio-seconds per second by syntheses
per process and processes.

    python bench/concurrency.py --cosyvoice-root CHECKOUT --python UPSTREAM_PYTHON \\
        --model-dir SMALL_MODEL [--requests 40] [--seconds 60] [--quick]

(tests/upstream_support.py builds the Python and the model: see bench/README.md.) Starts
clusters with the CLI on free 127.0.0.1 ports (``--engine cosyvoice3``, canaries off) and
always takes them down again, also on Ctrl-C and SIGTERM.

a. first chunk, in turns (one cluster request, then each upstream call, repeated, so all
   see the same load), ``--requests`` each, one instance at --instance-concurrency 1:
   - cluster: a streamed ``/v1/tts`` through nginx with a saved voice, to the first audio
     byte after the WAV header;
   - upstream's own ``inference_zero_shot(text, '', '', zero_shot_spk_id=ID, stream=True)``
     in one long-lived process of the upstream Python (bench/upstream_first_chunk.py), to
     its first chunk: as it is (``own``), with the shared hop set back first
     (``own_hop_reset``), and through cosyvoice-lb's layer (``layer``);
   - the floor measured apart (``floor``), in that same process: upstream's modules called
     directly, no serving code (LLM prefill + the first chunk's tokens, flow, HiFT);
   - the instance's own timer: its ``cosyvoice_first_chunk_compute_seconds`` (llm and
     audio, means of the run) and its ``cosyvoice_first_package_seconds``.
b. audio-seconds per second, non-streamed, the same text, closed loop of one client per
   synthesis slot, bounded in time and count: 1 instance x 1, 2, 4 syntheses; 2 x 2; 4 x 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import load  # noqa: E402  (bench/load.py)

PROMPT = ROOT / "tests" / "fake_cosyvoice" / "asset" / "zero_shot_prompt.wav"  # 4.4 s at 16 kHz
TRANSCRIPT = "希望你以后能够做的比我还好呦。"
TEXT = "今天天气很好，我们一起去公园散步吧。"
VARIANTS = ("own", "own_hop_reset", "layer", "floor")
LABELS = {
    "cluster": "cluster: nginx → instance, saved voice, first audio byte",
    "own": "upstream's own call, long-lived process (hop as the last stream left it)",
    "own_hop_reset": "upstream's own call, its hop set back to the loaded 25 first",
    "layer": "upstream's call through cosyvoice-lb's layer, same process",
    "floor": "the floor, measured apart: upstream's modules alone (LLM prefill + the chunk's tokens, flow, HiFT)",
}
SHAPES = "1x1,1x2,1x4,2x2,4x1"  # processes x syntheses each (1x1 also runs the first chunk)
HEADER_BYTES = 44


# --- the pure parts ----------------------------------------------------------------------


def turns(count: int, kinds: Sequence[str]) -> list[str]:
    """``count`` rounds of every kind in order: cluster, upstream, cluster, upstream, ..."""
    return [kind for _ in range(count) for kind in kinds]


def shapes_of(text: str) -> list[tuple[int, int]]:
    """ "1x1,2x2" -> [(1, 1), (2, 2)]: (instances, syntheses each)."""
    shapes = []
    for part in text.split(","):
        instances, _, each = part.strip().lower().partition("x")
        shape = (int(instances), int(each))
        if min(shape) < 1:
            raise ValueError(f"{part!r}: processes and syntheses are at least 1")
        shapes.append(shape)
    return shapes


@dataclass(frozen=True)
class Spread:
    count: int  # successful measurements
    failed: int
    p50: float
    p90: float
    mean: float = math.nan

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Spread:
        values = list(values)
        good = sorted(v for v in values if v is not None and math.isfinite(v))
        mean = statistics.fmean(good) if good else math.nan
        return cls(len(good), len(values) - len(good), percentile(good, 50), percentile(good, 90), mean)


def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear between closest ranks (numpy's default) over sorted values; NaN when none."""
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    """Prometheus text: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How much the samples of ``name`` matching ``labels`` grew, summed over the rest."""
    want = set(labels.items())

    def total(samples: Samples) -> float:
        return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))

    return total(after) - total(before)


def mean_of(before: Samples, after: Samples, histogram: str, **labels: str) -> tuple[float, int]:
    """(mean, count) of a histogram's observations between two scrapes."""
    count = delta(before, after, f"{histogram}_count", **labels)
    total = delta(before, after, f"{histogram}_sum", **labels)
    return (total / count if count else math.nan), int(count)


@dataclass(frozen=True)
class Floor:
    llm: float
    audio: float
    count: int
    first_package: float  # the instance's arrival -> first chunk, mean

    @property
    def total(self) -> float:
        return self.llm + self.audio

    @classmethod
    def of(cls, before: Samples, after: Samples) -> Floor:
        llm, count = mean_of(before, after, "cosyvoice_first_chunk_compute_seconds", part="llm")
        audio, _ = mean_of(before, after, "cosyvoice_first_chunk_compute_seconds", part="audio")
        first, _ = mean_of(before, after, "cosyvoice_first_package_seconds", route="api")
        return cls(llm, audio, count, first)


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table; floats with 3 decimals, NaN as "–"."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return "–" if math.isnan(value) else f"{value:.3f}"
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def first_chunk_rows(spreads: dict[str, Spread], floor: Floor) -> list[list[object]]:
    """One row per kind, each with how far its mean is above the floor measured apart (the
    ``floor`` kind: upstream's modules, no serving code), and the instance's own timer."""
    bare = spreads["floor"].mean if "floor" in spreads else floor.total
    rows: list[list[object]] = []
    for kind, spread in spreads.items():
        rows.append([LABELS.get(kind, kind), spread.count, spread.failed, spread.p50, spread.p90, spread.mean,
                     spread.mean - bare])  # fmt: skip
    rows.append(["compute floor, the instance's own timer (llm + audio)", floor.count, 0, math.nan, math.nan,
                 floor.total, floor.total - bare])  # fmt: skip
    return rows


@dataclass
class Throughput:
    instances: int
    each: int
    ok: int
    failed: int
    seconds: float
    audio: float  # seconds of audio made (the instances' histograms)
    cpu: float = math.nan  # CPU seconds the instances' processes used (process_cpu_seconds_total)

    def row(self) -> list[object]:
        rate = self.audio / self.seconds if self.seconds else math.nan
        per_audio = self.cpu / self.audio if self.audio else math.nan
        busy = self.cpu / self.seconds if self.seconds else math.nan
        return [f"{self.instances} × {self.each}", self.instances * self.each, self.ok, self.failed,
                self.seconds, self.audio, rate, busy, per_audio]  # fmt: skip


# --- the cluster and upstream's process ------------------------------------------------------


def uptime() -> str:
    with open("/proc/loadavg") as f:
        return "load average " + " ".join(f.read().split()[:3])


@dataclass
class Cluster:
    args: argparse.Namespace
    instances: int
    each: int
    state: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cvlb-cc-", dir="/tmp")))

    def __post_init__(self) -> None:
        self.port = load.free_port_block(self.instances + 1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = requests.Session()
        self.http.trust_env = False

    def command(self) -> list[str]:
        a = self.args
        return [*load.cli_command(), "up", "--engine", "cosyvoice3", "--model-dir", a.model_dir,
                "--cosyvoice-root", a.cosyvoice_root, "--python", a.python, "--instances", str(self.instances),
                "--instance-concurrency", str(self.each), "--port", str(self.port), "--base-port",
                str(self.port + 1), "--state-dir", str(self.state), "--canary-interval", "0",
                "--host-memory-per-instance", "1GiB", "--footprint", "1GiB", "--no-ui",
                "--request-timeout", "300"]  # fmt: skip

    def __enter__(self) -> Cluster:
        env = {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE_LB_")}
        try:
            done = subprocess.run(self.command(), capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
        except BaseException:
            self.__exit__()
            raise
        if done.returncode != 0:
            self.__exit__()
            raise SystemExit(f"cosyvoice-lb up failed:\n{done.stdout}\n{done.stderr}")
        return self

    def __exit__(self, *_exc: object) -> None:
        with load.shielded():
            subprocess.run([*load.cli_command(), "down", "--state-dir", str(self.state)],
                           capture_output=True, timeout=300, cwd=ROOT)  # fmt: skip
            shutil.rmtree(self.state, ignore_errors=True)

    def voice(self) -> str:
        with open(PROMPT, "rb") as prompt:
            r = self.http.post(self.url + "/v1/audio/voices", timeout=60,
                               data={"name": "bench", "prompt_text": TRANSCRIPT, "consent": "yes"},
                               files={"audio_sample": ("prompt.wav", prompt, "audio/wav")})  # fmt: skip
        r.raise_for_status()
        return r.json()["id"]

    def scrape(self) -> Samples:
        samples: Samples = {}
        for i in range(self.instances):
            text = self.http.get(f"http://127.0.0.1:{self.port + 1 + i}/metrics", timeout=30).text
            for (name, labels), value in parse_metrics(text).items():
                samples[(name, labels)] = samples.get((name, labels), 0.0) + value
        return samples

    def first_byte(self, voice: str) -> float | None:
        """Seconds to the first audio byte of a streamed answer, which is read to its end."""
        began, first, got = time.monotonic(), None, 0
        body = {"text": TEXT, "voice": voice, "stream": True}
        with self.http.post(self.url + "/v1/tts", json=body, stream=True, timeout=300) as r:
            if r.status_code != 200:
                return None
            for chunk in r.iter_content(4096):
                got += len(chunk)
                if first is None and got > HEADER_BYTES:
                    first = time.monotonic() - began
        return first


class Upstream:
    """bench/upstream_first_chunk.py in the upstream Python, one JSON line each way."""

    def __init__(self, args: argparse.Namespace, log: Path):
        self.log = open(log, "w")
        self.process = subprocess.Popen(
            [args.python, str(ROOT / "bench" / "upstream_first_chunk.py"), "--cosyvoice-root", args.cosyvoice_root,
             "--model-dir", args.model_dir, "--prompt-wav", str(PROMPT), "--transcript", TRANSCRIPT],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT,
        )  # fmt: skip
        self.ready = self.answer()

    def answer(self) -> dict:
        assert self.process.stdout is not None
        for line in self.process.stdout:  # (upstream may print lines of its own)
            if line.startswith("{"):
                return json.loads(line)
        raise SystemExit(f"upstream's process ended (exit {self.process.wait()}): see {self.log.name}")

    def call(self, variant: str) -> dict:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"text": TEXT, "variant": variant}) + "\n")
        self.process.stdin.flush()
        return self.answer()

    def close(self) -> None:
        with load.shielded():
            if self.process.stdin is not None:
                self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.log.close()
            if self.process.returncode == 0:  # (kept when it failed: its traceback is there)
                Path(self.log.name).unlink(missing_ok=True)


# --- the runs ----------------------------------------------------------------------------------


def first_chunk(args: argparse.Namespace, cluster: Cluster, voice: str) -> tuple[str, dict]:
    upstream = Upstream(args, cluster.state.parent / f"{cluster.state.name}-upstream.log")
    try:
        cluster.first_byte(voice)  # warm: the voice in the instance's speaker cache, first calls
        for variant in VARIANTS:
            upstream.call(variant)
        before = cluster.scrape()
        times: dict[str, list[float | None]] = {kind: [] for kind in ("cluster", *VARIANTS)}
        calls: list[dict] = []
        began = time.monotonic()
        for kind in turns(args.requests, ("cluster", *VARIANTS)):
            if time.monotonic() - began > args.first_chunk_limit:
                break
            if kind == "cluster":
                times[kind].append(cluster.first_byte(voice))
            else:
                calls.append(upstream.call(kind))
                times[kind].append(calls[-1]["first"])
        floor = Floor.of(before, cluster.scrape())
    finally:
        upstream.close()
    spreads = {kind: Spread.of(values) for kind, values in times.items()}
    header = ["path", "count", "failed", "p50 s", "p90 s", "mean s", "mean − floor measured apart s"]
    text = table(header, first_chunk_rows(spreads, floor))
    facts = {"floor": floor, "ready": upstream.ready, "calls": calls, "spreads": spreads}
    return text, facts


def first_chunk_notes(facts: dict) -> str:
    floor, ready, calls = facts["floor"], facts["ready"], facts["calls"]
    own = [c for c in calls if c["variant"] == "own"]
    long_hop = sum(1 for c in own if c["hop_before"] > ready["hop"])
    one_chunk = sum(1 for c in own if c["chunks"] == 1)
    frontend = statistics.mean(c["frontend"] for c in calls) if calls else math.nan
    return "\n".join([
        f"- compute floor: llm {floor.llm:.3f} s + audio {floor.audio:.3f} s (means of {floor.count}); the "
        f"instance's own first package (arrival → first chunk) {floor.first_package:.3f} s",
        f"- `own`: the shared hop was {ready['max_hop']} (not {ready['hop']}) before {long_hop} of {len(own)} calls; "
        f"{one_chunk} of them came as a single chunk (first chunk = whole synthesis)",
        f"- upstream's frontend per call (text normalisation, zero-shot inputs from the cached speaker): "
        f"{frontend * 1000:.1f} ms mean; its tqdm bar and logging.info lines: {ready['noise_per_call'] * 1e6:.0f} µs",
        f"- torch threads in upstream's process: {ready['torch_threads']} intra-op, "
        f"{ready['torch_interop_threads']} inter-op (the instance sets none: torch's defaults too)",
    ])  # fmt: skip


def throughput(args: argparse.Namespace, cluster: Cluster, voice: str) -> Throughput:
    slots = cluster.instances * cluster.each
    body = {"text": TEXT, "voice": voice}
    url = cluster.url + "/v1/tts"
    load.run(load.closed_loop(url, slots, 300, body, timeout=300, max_requests=2 * slots))  # warm
    before = cluster.scrape()
    results, seconds = load.run(
        load.closed_loop(url, slots, args.seconds, body, timeout=300, max_requests=args.max_requests)
    )
    after = cluster.scrape()
    audio = delta(before, after, "cosyvoice_audio_duration_seconds_sum")
    cpu = delta(before, after, "process_cpu_seconds_total")
    ok = sum(1 for r in results if r.status == 200)
    return Throughput(cluster.instances, cluster.each, ok, len(results) - ok, seconds, audio, cpu)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cosyvoice-root", required=True, help="upstream CosyVoice's checkout")
    parser.add_argument("--python", required=True, help="the Python that runs upstream's code")
    parser.add_argument("--model-dir", required=True, help="a CosyVoice3 model dir (the small test model)")
    parser.add_argument("--requests", type=int, default=40, help="first-chunk measurements of each kind")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of load per throughput shape")
    parser.add_argument("--max-requests", type=int, default=400, help="at most this many requests per shape")
    parser.add_argument("--first-chunk-limit", type=float, default=600.0, help="seconds the turns may take")
    parser.add_argument("--shapes", type=shapes_of, default=shapes_of(SHAPES), help=f"default {SHAPES}")
    parser.add_argument("--quick", action="store_true", help="12 turns each, 15 s per shape")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.seconds, args.first_chunk_limit = 12, 15.0, 200.0
    load.stop_on_sigterm()
    command = " ".join(["python", "bench/concurrency.py", *sys.argv[1:]])
    out = [f"$ {command}", "", f"{os.cpu_count()} cores; at the start: {uptime()}", ""]
    rows, began = [], time.monotonic()
    for instances, each in args.shapes:
        print(f"# {instances} instance(s) × {each} syntheses, at {time.monotonic() - began:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
        with Cluster(args, instances, each) as cluster:
            voice = cluster.voice()
            if (instances, each) == (1, 1):
                text, facts = first_chunk(args, cluster, voice)
                out += ["### a. first chunk (seconds; one instance, text " + f"{TEXT!r})", "", text, "",
                        first_chunk_notes(facts), ""]  # fmt: skip
                print("\n".join(out), file=sys.stderr, flush=True)
            rows.append(throughput(args, cluster, voice).row())
    header = ["processes × syntheses", "clients", "ok", "failed", "seconds", "audio s", "audio s per s",
              "cores busy", "CPU s per audio s"]  # fmt: skip
    out += ["### b. audio-seconds per second (non-streamed, closed loop)", "", table(header, rows), "",
            f"at the end: {uptime()}; {time.monotonic() - began:.0f} s in all"]  # fmt: skip
    print("\n".join(out), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (KeyboardInterrupt, load.Interrupted):
        sys.exit(130)
