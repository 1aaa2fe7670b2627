#!/usr/bin/env python3
"""CosyVoice3 on one GPU: processes × concurrency, with and without MPS, plain, --fp16 and
--load-vllm, on a full-size model with random weights (no download).

    python bench/gpu.py --cosyvoice-root CHECKOUT [--python PY] [--model-dir DIR] [--out FILE]
    python bench/gpu.py --smoke --cosyvoice-root CHECKOUT --python PY   # a CPU, the small model

The model is built first (once per --work dir, then reused) by tests/upstream/build_model.py
--full with the instances' Python: upstream's own recipe config (the 0.5B Qwen2 LLM, the
22-layer DiT flow, HiFT) with random weights, so the speed and memory are the real model's
while the audio is noise (the LLM is set to end its utterances as a trained one does, at
a length that follows the text). Every row runs on a real cluster that ``cosyvoice-lb up
--engine cosyvoice3 --no-ui`` starts on 127.0.0.1 and ``down`` takes down, also on Ctrl-C.

The grid: per setup (plain, --fp16, each without and with --mps, then --load-vllm, then
--load-vllm with the flow and HiFT of each instance's syntheses batched; every other setup
runs them one synthesis at a time, --token2wav-batch 1, as upstream does) ONE
cluster of 4 instances with --instance-concurrency 4; its rows take 1, 2 or 4 of them in
nginx's rotation (the others drained by hand: idle, they take no GPU time) and keep c = 1
or 4 streamed syntheses per serving instance in flight (a closed loop through nginx,
``/v1/tts`` with a saved voice, so each instance extracts its prompt once). Order per
cluster: c=1 on 1, 2, 4 instances, then c=4 on 4, 2, 1, so that no instance has served
more at once than its row asks when its memory is read. Each row: --seconds of load (6);
before the first, one synthesis on each instance (straight to its port), and before the
first row at c=4 one per client, none of them timed.

Time on one H200 (16 cores), planned: the model build about 40 s (once per --work dir);
per setup `up` about 40 s (the 4 instances load at once), the warm-up and 6 rows × about
8 s, `down` about 5 s: ~95 s; 6 setups ~570 s (the 4 without vLLM ~380 s); about 10
minutes in all. vLLM's rows come last and only where vllm imports in the instances' Python.
--budget (560 s, counted from
the start) bounds the run: a setup that would not finish inside it (judged by the last
one's time) is not started, nor a row with under --seconds + 20 s left, and the table says
so (rerun with --only to fill them in); only the last `down` runs past it.
Rows are skipped, with the reason, for MPS without nvidia-cuda-mps-control (or without a
GPU), --fp16 without a GPU (upstream runs float32 then) and vLLM where it does not import.

Columns: audio seconds made per second of wall time (all serving instances together),
the first audio chunk's latency p50 and p99 with the number of samples they rest on (from
sending the request to its first audio byte through nginx), and the largest GPU memory
any serving instance held during its row (NVML per process, sampled every 0.5 s; "≈":
NVML saw no per-process figure, as under MPS, so the card's use over the number of
instances; "—": no NVML).

--smoke: the small test model (tests/upstream/build_model.py), 2 instances, 1 and 2 at once,
3 s a row: runs on a CPU in about two minutes (tests/integration/test_gpu_bench_smoke.py).
What the GPU box must be given (no package index there): bench/README.md's GPU section and
bench/gpu_wheels.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]  # (a checkout where cosyvoice-lb is not installed)
import load  # noqa: E402  (bench/load.py)
import run  # noqa: E402  (bench/run.py: the CLI runner, the log, the markdown table)
from cosyvoice_lb.launcher.plan.gpu import device_used, process_gpu_memory  # noqa: E402

BUILDER = ROOT / "tests" / "upstream" / "build_model.py"
PROMPT = ROOT / "tests" / "fake_cosyvoice" / "asset" / "zero_shot_prompt.wav"  # 4.4 s of a voice
TRANSCRIPT = "希望你以后能够做的比我还好呦。"
TEXT = "The quick brown fox jumps over the lazy dog, then it runs far away into the woods."
VOICE = "gpu-bench"


@dataclass(frozen=True)
class Plan:
    processes: tuple[int, ...]
    concurrency: tuple[int, ...]
    seconds: float  # of load per row
    budget: float  # seconds for the whole run
    full: bool  # the full-size model (else the small test model)


FULL = Plan(processes=(1, 2, 4), concurrency=(1, 4), seconds=6.0, budget=560.0, full=True)
SMOKE = Plan(processes=(1, 2), concurrency=(1, 2), seconds=3.0, budget=400.0, full=False)


@dataclass(frozen=True)
class Setup:
    precision: str  # plain, fp16, vllm
    mps: bool
    batched: bool = False  # the flow and HiFT of an instance's syntheses batched (--token2wav-batch)

    @property
    def name(self) -> str:
        return self.precision + (" + batched flow/HiFT" if self.batched else "") + (" + MPS" if self.mps else "")

    def flags(self) -> list[str]:
        extra = {"plain": [], "fp16": ["--fp16"], "vllm": ["--load-vllm"]}[self.precision]
        # (without: one synthesis at a time through the flow and HiFT, as upstream runs them)
        return extra + ([] if self.batched else ["--token2wav-batch", "1"]) + (["--mps"] if self.mps else [])


SETUPS = (
    Setup("plain", False),
    Setup("fp16", False),
    Setup("plain", True),
    Setup("fp16", True),
    Setup("vllm", False),
    Setup("vllm", False, batched=True),
)


def setups(gpu: bool, mps_problem: str, vllm_problem: str) -> list[tuple[Setup, str]]:
    """Every setup in the order they run, each with why it is skipped ("": it runs)."""
    chosen = []
    for setup in SETUPS:
        why = ""
        if setup.precision != "plain" and not gpu:
            why = "no GPU (upstream runs float32 on a CPU)" if setup.precision == "fp16" else "no GPU"
        elif setup.precision == "vllm" and vllm_problem:
            why = vllm_problem
        if not why and setup.mps:
            why = mps_problem
        chosen.append((setup, why))
    return chosen


def cells(processes: tuple[int, ...], concurrency: tuple[int, ...]) -> list[tuple[int, int]]:
    """(serving instances, syntheses each) in the order a cluster runs them: the lowest c
    first, instances going up, then down at the next c (see the module's docstring)."""
    order = []
    for i, c in enumerate(sorted(concurrency)):
        order += [(p, c) for p in (sorted(processes) if i % 2 == 0 else sorted(processes, reverse=True))]
    return order


@dataclass
class Row:
    setup: str
    processes: int | str  # (a skipped setup's row names them all)
    concurrency: int | str
    requests: int = 0
    ok: int = 0
    audio_seconds: float = 0.0
    seconds: float = 0.0
    first: list[float] = field(default_factory=list)  # seconds to the first audio byte, answered requests
    memory: str = "—"
    note: str = ""

    def as_dict(self) -> dict[str, str]:
        first = np.array(self.first) * 1000
        p50, p99 = (f"{v:.0f}" for v in np.percentile(first, [50, 99])) if first.size else ("—", "—")
        rate = f"{self.audio_seconds / self.seconds:.2f}" if self.seconds else "—"
        return {
            "setup": self.setup,
            "processes": str(self.processes),
            "concurrency": str(self.concurrency),
            "requests": f"{self.ok}/{self.requests}" if not self.note else self.note,
            "rate": rate,
            "p50": p50,
            "p99": f"{p99} (n={first.size})" if first.size else p99,
            "memory": self.memory,
        }


COLUMNS = [
    ("setup", "setup", ""),
    ("processes", "processes", ""),
    ("concurrency", "concurrency", ""),
    ("requests", "ok/requests", ""),
    ("rate", "audio s per s", ""),
    ("p50", "first chunk p50 ms", ""),
    ("p99", "first chunk p99 ms (samples)", ""),
    ("memory", "GPU MiB per process (max)", ""),
]


def skipped(setup: Setup, plan: Plan, why: str) -> Row:
    """One row for a setup that does not run, and why."""
    listed = (", ".join(map(str, values)) for values in (plan.processes, plan.concurrency))
    return Row(setup.name, next(listed), next(listed), note=f"skipped: {why}")


def memory_cell(per_pid: dict[int, int], device_delta: int, instances: int, nvml: bool) -> str:
    """The memory column: the largest per-process figure (MiB), else the card's use spread
    over the instances ("≈"), else "—" without NVML."""
    if per_pid:
        return f"{max(per_pid.values()) / 2**20:.0f}"
    if nvml and device_delta > 0:
        return f"≈{device_delta / instances / 2**20:.0f}"
    return "—"


# --- the edges: the model, the instances' Python, the cluster, the load ------------------


def model_dir(python: str, root: Path, work: Path, full: bool) -> Path:
    """The model built by tests/upstream/build_model.py into ``work`` (kept, reused)."""
    target = work / ("model-full" if full else "model-small")
    if not (target / "llm.pt").is_file():
        run.log(f"building the {'full-size' if full else 'small'} random-weight model into {target}")
        args = [python, str(BUILDER), "--cosyvoice-root", str(root), "--out", str(target)]
        subprocess.run(args + (["--full"] if full else []), check=True, timeout=900)
    return target


def probe(python: str, code: str) -> str:
    """What ``python -c code`` says went wrong ("" when it exits 0)."""
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    return "" if done.returncode == 0 else (done.stderr.strip().splitlines() or ["failed"])[-1][:120]


class Cluster:
    """One `up` of ``instances`` cosyvoice3 instances on 127.0.0.1; ``down`` at the end."""

    def __init__(self, args: argparse.Namespace, model: Path, setup: Setup, instances: int, concurrency: int):
        self.port = load.free_port_block(instances + 1)
        self.state_dir = Path(tempfile.mkdtemp(prefix="cg", dir="/tmp"))  # short: unix sockets live here
        self.names = [f"instance-{i}" for i in range(instances)]
        options = {
            "--engine": "cosyvoice3",
            "--model-dir": str(model),
            "--cosyvoice-root": str(args.cosyvoice_root),
            "--python": args.python,
            "--instances": str(instances),
            "--instance-concurrency": str(concurrency),
            "--max-queue": str(2 * concurrency),
            "--canary-interval": "0",  # (no syntheses of its own between the rows)
            "--host": "127.0.0.1",
            "--port": str(self.port),
            "--base-port": str(self.port + 1),
            "--state-dir": str(self.state_dir),
            "--voices-dir": str(args.work / "voices"),
            **({"--nginx": args.nginx} if args.nginx else {}),
        }
        self.up = ["up", "--no-ui", *(word for pair in options.items() for word in pair), *setup.flags()]
        self.url = f"http://127.0.0.1:{self.port}"
        self.active = instances

    def __enter__(self) -> Cluster:
        run.log(f"cosyvoice-lb {shlex.join(self.up)}")
        try:
            run.cli(*self.up, timeout=900)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        with load.shielded():
            try:
                run.cli("down", "--state-dir", str(self.state_dir), timeout=300)
            finally:
                shutil.rmtree(self.state_dir, ignore_errors=True)

    def status(self) -> dict:
        done = subprocess.run(
            [*load.cli_command(), "status", "--json", "--state-dir", str(self.state_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return json.loads(done.stdout)

    def serve_with(self, count: int) -> list[int]:
        """``count`` instances in rotation (the others drained by hand); their pids."""
        if count != self.active:
            wanted, others = self.names[:count], self.names[count:]
            run.cli("undrain", "--state-dir", str(self.state_dir), *wanted)
            if others:
                run.cli("drain", "--state-dir", str(self.state_dir), *others)
            self.active = count
        deadline = time.monotonic() + 60
        while True:  # (the health loop puts them back after its good probes)
            serving = [i for i in self.status().get("instances", []) if i.get("in_rotation")]
            if {i["name"] for i in serving} == set(self.names[:count]):
                return [int(i["pid"]) for i in serving]
            if time.monotonic() > deadline:
                raise RuntimeError(f"the rotation never became {self.names[:count]}: {serving}")
            time.sleep(0.5)

    def warm_each(self) -> None:
        """One synthesis on each instance, straight to its port, all at once: each extracts
        the saved voice's prompt and runs its first kernels before any row is timed."""
        body = {"text": TEXT, "voice": self.voice(), "stream": True}
        urls = [f"http://127.0.0.1:{self.port + 1 + i}/v1/tts" for i in range(len(self.names))]

        async def each() -> None:
            await asyncio.gather(*(streamed(url, body, 1, 0, True) for url in urls))

        load.run(each())

    def voice(self) -> str:
        """The saved voice the load speaks with (registered once in the shared voices dir)."""
        with httpx.Client(trust_env=False, timeout=120) as http:
            known = http.get(self.url + "/v1/audio/voices").json().get("data", [])
            if any(v.get("name") == VOICE for v in known):
                return VOICE
            files = {"audio_sample": ("prompt.wav", PROMPT.read_bytes(), "audio/wav")}
            data = {"name": VOICE, "prompt_text": TRANSCRIPT, "consent": "yes"}
            answer = http.post(self.url + "/v1/audio/voices", data=data, files=files)
            answer.raise_for_status()
        return VOICE


class MemoryWatch:
    """The most GPU memory each pid held while it ran (NVML every 0.5 s), in a thread."""

    def __init__(self, pids: list[int]):
        self.pids, self.peak, self.device_peak = set(pids), {}, 0
        self.baseline = device_used(0)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self) -> None:
        while not self.stop.is_set():
            for pid, used in process_gpu_memory(self.pids).items():
                self.peak[pid] = max(self.peak.get(pid, 0), used)
            self.device_peak = max(self.device_peak, device_used(0))
            self.stop.wait(0.5)

    def __enter__(self) -> MemoryWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)


async def streamed(url: str, body: dict, clients: int, seconds: float, warm: bool) -> tuple[list[tuple], float]:
    """``clients`` closed loops of streamed syntheses for ``seconds`` (after one unmeasured
    each when ``warm``): per answer (status, seconds to the first audio byte, audio seconds),
    and the seconds the measured part took."""
    load.loopback_only(url)
    results: list[tuple] = []

    async def one(http: httpx.AsyncClient, keep: bool) -> None:
        sent, first, size, rate = time.monotonic(), None, 0, 24000
        try:
            async with http.stream("POST", url, json=body) as answer:
                rate = int(answer.headers.get("x-sample-rate", rate))
                async for chunk in answer.aiter_raw():
                    first = first if first is not None else time.monotonic() - sent
                    size += len(chunk)
                status = answer.status_code
        except httpx.HTTPError:
            status = 0
        if keep:
            results.append((status, first, max(0, size - 44) / 2 / rate))

    async def client(http: httpx.AsyncClient, began: float) -> None:
        for _ in range(10_000):  # (bounded: a row's seconds end it long before)
            if time.monotonic() - began >= seconds:
                return
            await one(http, True)

    async with load.client(timeout=300) as http:
        if warm:
            await asyncio.gather(*(one(http, False) for _ in range(clients)))
        began = time.monotonic()
        await asyncio.gather(*(client(http, began) for _ in range(clients)))
        return results, time.monotonic() - began


def measure(cluster: Cluster, setup: Setup, processes: int, concurrency: int, seconds: float, warm: bool) -> Row:
    pids = cluster.serve_with(processes)
    body = {"text": TEXT, "voice": cluster.voice(), "stream": True}
    with MemoryWatch(pids) as memory:
        answers, took = load.run(streamed(cluster.url + "/v1/tts", body, processes * concurrency, seconds, warm))
    good = [a for a in answers if a[0] == 200]
    nvml = bool(memory.baseline or memory.device_peak)
    return Row(
        setup.name,
        processes,
        concurrency,
        requests=len(answers),
        ok=len(good),
        audio_seconds=sum(a[2] for a in good),
        seconds=took,
        first=[a[1] for a in good if a[1] is not None],
        memory=memory_cell(memory.peak, memory.device_peak - memory.baseline, len(cluster.names), nvml),
    )


def run_setup(args: argparse.Namespace, plan: Plan, model: Path, setup: Setup, ends: float) -> list[Row]:
    rows: list[Row] = []
    order = cells(plan.processes, plan.concurrency)
    with Cluster(args, model, setup, max(plan.processes), max(plan.concurrency)) as cluster:
        cluster.warm_each()
        seen = {1}  # (one at a time: each instance has done that; more at once is warmed per row)
        for processes, concurrency in order:
            if time.monotonic() + plan.seconds + 20 > ends:
                rows.append(Row(setup.name, processes, concurrency, note="skipped: out of --budget"))
                continue
            run.log(f"{setup.name}: {processes} instance(s) × {concurrency} at once, {plan.seconds:g} s")
            rows.append(measure(cluster, setup, processes, concurrency, plan.seconds, concurrency not in seen))
            seen.add(concurrency)
    return rows


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cosyvoice-root", type=Path, default=os.environ.get("CVLB_UPSTREAM") or None, required=False)
    parser.add_argument("--python", default=sys.executable, help="the instances' Python (default: this one)")
    parser.add_argument("--model-dir", type=Path, help="a model dir to use (default: built into --work)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "cvlb-gpu-bench")
    parser.add_argument("--smoke", action="store_true", help="the small model, a tiny grid: runs on a CPU")
    parser.add_argument("--seconds", type=float, help="seconds of load per row")
    parser.add_argument("--budget", type=float, help="seconds for the whole run")
    parser.add_argument("--only", default="", help="run these setups only, e.g. 'fp16,plain + MPS'")
    parser.add_argument("--nginx", default="", help="the nginx binary (default: nginx on PATH or in /usr/sbin)")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    if args.cosyvoice_root is None:
        parser.error("--cosyvoice-root: name an upstream CosyVoice checkout (or set CVLB_UPSTREAM)")
    args.cosyvoice_root = args.cosyvoice_root.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.monotonic()
    base = SMOKE if args.smoke else FULL
    plan = Plan(base.processes, base.concurrency, args.seconds or base.seconds, args.budget or base.budget, base.full)
    ends = started + plan.budget
    load.stop_on_sigterm()
    # (the launcher, its supervisord and its programs import cosyvoice_lb from this checkout)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    args.work.mkdir(parents=True, exist_ok=True)
    model = (
        args.model_dir.resolve()
        if args.model_dir
        else model_dir(args.python, args.cosyvoice_root, args.work, plan.full)
    )
    gpu = not probe(args.python, "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)")
    vllm = probe(args.python, "import vllm") and "vllm does not import in the instances' Python"
    from cosyvoice_lb.launcher.cluster.mps import mps_problem

    mps = "" if gpu else "no GPU"
    mps = mps or mps_problem().split(" (")[0]  # (e.g. "--mps needs nvidia-cuda-mps-control")
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    rows: list[Row] = []
    cost = 60 + len(cells(plan.processes, plan.concurrency)) * (plan.seconds + 4)  # (up, the rows, down)
    for setup, why in setups(gpu, mps, vllm):
        if only and setup.name not in only:
            continue
        if not why and time.monotonic() + cost > ends:
            why = "out of --budget (rerun with --only)"
        if why:
            rows.append(skipped(setup, plan, why))
            continue
        began = time.monotonic()
        rows += run_setup(args, plan, model, setup, ends)
        cost = time.monotonic() - began  # (the next setup takes about as long as this one)
    command = shlex.join(["python", "bench/gpu.py", *(argv if argv is not None else sys.argv[1:])])
    lines = [
        f"CosyVoice3 ({'full-size' if plan.full else 'small test'} model, random weights) on "
        f"{'the GPU' if gpu else 'the CPU'}: {TEXT!r} streamed with a saved voice, {plan.seconds:g} s a row",
        "",
        run.table([r.as_dict() for r in rows], COLUMNS),
        "",
        f"`{command}` ({time.monotonic() - started:.0f} s)",
    ]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0 if all(r.note or (r.requests and r.ok == r.requests) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
