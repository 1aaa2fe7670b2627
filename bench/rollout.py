#!/usr/bin/env python3
"""Roll-outs and crashes under a steady load: how much serving capacity each variant keeps.

    python bench/rollout.py [--load-seconds 20] [--scenario rolling,crash] [--plot docs/rollout-capacity.svg]

Each variant starts its own 4-instance ``--engine simulated`` cluster (a model load of
--load-seconds, then a wait proportional to the text per request) in a fresh state dir on a
free 127.0.0.1 port block, puts a closed-loop API load of --clients workers on it (short
texts through nginx; bounded in requests and seconds), and always takes it down again
(``cosyvoice-lb down``, then any process still naming the state dir is killed).

rolling  ``cosyvoice-lb restart --all --rolling``: drain-first (one instance out, restarted,
         serving again before the next) against ``--surge 1`` (a replacement on a parked
         slot serves before an old one is drained).
crash    SIGKILL one instance in rotation, without and with ``--spares 1`` (a loaded
         instance out of rotation that takes the dead one's place).

Capacity is the number of instances in nginx's rotation: the ``server`` lines of
``upstream cvlb_api`` in STATE/nginx/upstreams.conf without ``down`` (the file the health
loop rewrites and nginx reloads), sampled every 0.25 s from just before the restart or the
kill until capacity is back (health.json's in_rotation count is kept beside it). Prints one
table per scenario, variants side by side, each after the command that reproduces it;
writes every trace to bench/results/rollout-<timestamp>.json and, with --plot, capacity
over time as a hand-written SVG.

Variants that need --surge/--spares are skipped (and say so) when ``cosyvoice-lb up`` does
not have those flags.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from html import escape
from pathlib import Path

import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

from cosyvoice_lb.launcher.state.health_report import Track, read_report
from cosyvoice_lb.launcher.state.layout import Layout, layout_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos import Load  # noqa: E402  (bench/chaos.py: its bounded closed-loop clients)
from load import Interrupted, cli_command, free_port_block, stop_on_sigterm  # noqa: E402  (bench/load.py)

# --- bounds ------------------------------------------------------------------------------

SAMPLE_S = 0.25  # capacity sampling period
PRE_S = 2.0  # load and sampling before the restart or the kill
TAIL_S = 2.0  # and after capacity is back
MAX_REQUESTS = 20000  # per variant (the default of --max-requests)
BACK_WAIT_S = 30.0  # after the restart command returned, for capacity to be back
UP_TIMEOUT_S = 300.0
DOWN_TIMEOUT_S = 120.0
MS_PER_CHAR = 4.0
TEXT = "A short sentence for the roll-out bench."  # 40 characters: 160 ms of service

# --- pure parts: rotation, traces, latency, the plot ---------------------------------------

_SERVER = re.compile(r"^\s*server\s+(?P<address>\S+)(?P<params>[^;#]*);\s*(?:#\s*(?P<name>\S+))?")


def rotation(upstreams_conf: str, upstream: str = "cvlb_api") -> list[str]:
    """The instances nginx's ``upstream`` block sends requests to: its ``server`` lines
    without ``down`` (nor the ``backup`` last resort), by the name in their trailing comment
    (else their address)."""
    block = re.search(rf"upstream\s+{re.escape(upstream)}\s*\{{(.*?)\}}", upstreams_conf, re.S)
    names = []
    for line in block.group(1).splitlines() if block else []:
        match = _SERVER.match(line)
        if match and not {"down", "backup"} & set(match["params"].split()):  # (backup: the last resort)
            names.append(match["name"] or match["address"])
    return names


Trace = list[tuple[float, int]]  # (seconds since the restart or the kill, capacity)


def level_before(trace: Trace, t: float = 0.0) -> int:
    """Capacity at the last sample before ``t`` (the first sample's when none is; 0 without any)."""
    before = [c for s, c in trace if s < t]
    return before[-1] if before else trace[0][1] if trace else 0


def seconds_below(trace: Trace, level: int, start: float = 0.0, end: float = math.inf) -> float:
    """How long capacity was under ``level`` within [start, end], each sample holding until
    the next one (the last sample holds for nothing)."""
    total = 0.0
    for (t, c), (nxt, _) in zip(trace, trace[1:]):
        if c < level:
            total += max(0.0, min(nxt, end) - max(t, start))
    return total


def first_at(trace: Trace, level: int, after: float = 0.0) -> float | None:
    """The first sample at or after ``after`` with capacity at least ``level``."""
    return next((t for t, c in trace if t >= after and c >= level), None)


@dataclass(frozen=True)
class Latency:
    samples: int
    p50_ms: float
    p99_ms: float
    at_or_above_p99: int  # how many samples the p99 rests on

    @classmethod
    def of(cls, seconds: list[float]) -> Latency:
        if not seconds:
            return cls(0, math.nan, math.nan, 0)
        ms = np.array(seconds) * 1000
        p50, p99 = (float(v) for v in np.percentile(ms, [50, 99]))
        return cls(len(ms), p50, p99, int((ms >= p99).sum()))


COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd")


def svg(panels: list[tuple[str, str, dict[str, Trace]]], width: int = 640, panel_height: int = 240) -> str:
    """Capacity (0..5) over time as step lines, one panel per (title, x label, traces by
    variant) stacked, each with a legend and a dashed line at x = 0."""
    left, right, top, bottom = 48, 16, 28, 40
    y_max = max([5] + [c for _, _, traces in panels for trace in traces.values() for _, c in trace])
    parts = []
    for p, (title, xlabel, traces) in enumerate(panels):
        oy = p * panel_height
        times = [t for trace in traces.values() for t, _ in trace] or [0.0, 1.0]
        x0, x1 = min(times + [0.0]), max(times + [1.0])
        step = next(s for s in (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1e9) if (x1 - x0) / s <= 10)
        w, h = width - left - right, panel_height - top - bottom

        def x(t: float, x0: float = x0, x1: float = x1, w: int = w) -> float:
            return left + (t - x0) / (x1 - x0) * w

        def y(c: float, oy: int = oy, h: int = h) -> float:
            return oy + top + h - c / y_max * h

        parts.append(f'<text x="{left}" y="{oy + 18}" font-weight="bold">{escape(title)}</text>')
        for c in range(y_max + 1):
            parts.append(f'<line x1="{left}" x2="{left + w}" y1="{y(c):.1f}" y2="{y(c):.1f}" stroke="#ddd"/>')
            parts.append(f'<text x="{left - 6}" y="{y(c) + 4:.1f}" text-anchor="end">{c}</text>')
        for tick in range(math.ceil(x0 / step), math.floor(x1 / step) + 1):
            parts.append(
                f'<text x="{x(tick * step):.1f}" y="{y(0) + 16:.1f}" text-anchor="middle">{tick * step:g}</text>'
            )
        parts.append(
            f'<line x1="{x(0):.1f}" x2="{x(0):.1f}" y1="{y(0):.1f}" y2="{y(y_max):.1f}" stroke="#888" '
            'stroke-dasharray="4 3"/>'
        )
        parts.append(
            f'<text x="{left + w / 2:.1f}" y="{oy + panel_height - 6}" text-anchor="middle">{escape(xlabel)}</text>'
        )
        parts.append(
            f'<text transform="translate(14 {y(y_max / 2):.1f}) rotate(-90)" text-anchor="middle">capacity</text>'
        )
        legend = [
            f'<rect x="{left + w - 160}" y="{y(0) - 10 - 16 * len(traces)}" width="156" '
            f'height="{6 + 16 * len(traces)}" fill="white" stroke="#ccc"/>'
        ]  # bottom right, over the lines
        for i, (label, trace) in enumerate(traces.items()):
            color = COLORS[i % len(COLORS)]
            steps = [(t, c) for (t, c), (nxt, _) in zip(trace, trace[1:]) for t in (t, nxt)] or trace
            points = " ".join(f"{x(t):.1f},{y(c):.1f}" for t, c in steps)
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{points}"/>')
            ly = y(0) - 10 - 16 * (len(traces) - 1 - i)
            legend.append(
                f'<line x1="{left + w - 152}" x2="{left + w - 132}" y1="{ly - 4:.1f}" y2="{ly - 4:.1f}" '
                f'stroke="{color}" stroke-width="2"/>'
            )
            legend.append(f'<text x="{left + w - 126}" y="{ly:.1f}">{escape(label)}</text>')
        parts += legend
    height = panel_height * len(panels)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">\n'
        f'<rect width="{width}" height="{height}" fill="white"/>\n' + "\n".join(parts) + "\n</svg>\n"
    )


# --- the cluster ---------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[rollout {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE_LB_")}


def cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*cli_command(), *args], capture_output=True, text=True, timeout=timeout, env=clean_env(), check=False
    )


def flags_of(command: str) -> str:
    done = cli(command, "--help", timeout=60)
    return done.stdout


@dataclass(frozen=True)
class Variant:
    scenario: str  # "rolling" or "crash"
    label: str
    up_args: tuple[str, ...] = ()
    restart_args: tuple[str, ...] = ()
    extra_slots: int = 0  # spares and surge slots: more ports
    spares: int = 0
    skipped: str = ""  # why it is not run


class Cluster:
    """One variant's cluster on 127.0.0.1 in a fresh state dir; down (and nothing left) at the end."""

    def __init__(self, args: argparse.Namespace, variant: Variant):
        self.port = free_port_block(args.instances + variant.extra_slots + 1)
        self.state_dir = Path(tempfile.mkdtemp(prefix="cr", dir="/tmp"))  # short: supervisord's socket lives here
        self.layout: Layout = layout_for(str(self.state_dir))
        self.up_args = [
            "up",
            "--engine",
            "simulated",
            "--simulated-load-seconds",
            f"{args.load_seconds:g}",
            "--simulated-ms-per-char",
            f"{MS_PER_CHAR:g}",
            "--instances",
            str(args.instances),
            *variant.up_args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--base-port",
            str(self.port + 1),
            "--state-dir",
            str(self.state_dir),
        ]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Cluster:
        return self

    def up(self, timeout: float) -> None:
        done = cli(*self.up_args, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"cosyvoice-lb up exited {done.returncode}:\n{(done.stdout + done.stderr)[-2000:]}")

    def __exit__(self, *exc: object) -> None:
        try:
            done = cli("down", "--state-dir", str(self.state_dir), timeout=DOWN_TIMEOUT_S)
            log(f"down: {(done.stdout + done.stderr).strip()[-200:]}")
        except subprocess.TimeoutExpired:
            log(f"down did not finish within {DOWN_TIMEOUT_S:.0f} s")
        finally:
            for proc in self.leftovers():
                log(f"down left pid {proc.pid} ({proc.name()}): killing it")
                proc.kill()
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def leftovers(self) -> list[psutil.Process]:
        """Processes whose command line names this (unique) state dir: ours."""
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if proc.pid != os.getpid() and any(str(self.state_dir) in part for part in proc.info["cmdline"] or []):
                    found.append(proc)
            except psutil.Error:
                continue
        return found

    def in_rotation(self) -> list[str] | None:
        try:
            return rotation(self.layout.upstreams_conf.read_text())
        except OSError:
            return None

    def tracks(self) -> dict[str, Track]:
        return read_report(self.layout).tracks

    def settle(self, instances: int, loaded: int, within: float) -> None:
        """Until ``instances`` are in rotation and ``loaded`` (serving and spares) have been ready."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            names = self.in_rotation() or []
            ready = [n for n, t in self.tracks().items() if t.pid and t.ever_ready and not t.failed]
            if len(names) >= instances and len(ready) >= loaded:
                return
            time.sleep(0.25)
        raise RuntimeError(
            f"not settled within {within:.0f} s: in rotation {self.in_rotation()}, tracks {self.tracks()}"
        )

    def pid_of(self, name: str) -> int:
        done = cli("status", "--json", "--state-dir", str(self.state_dir), timeout=60)
        for item in json.loads(done.stdout)["instances"]:
            if item["name"] == name and item["pid"]:
                return int(item["pid"])
        raise RuntimeError(f"no pid for {name} in status --json")


# --- load and sampling ----------------------------------------------------------------------


class Sampler:
    """Capacity every SAMPLE_S in a thread: (monotonic time, names in rotation, health.json's count)."""

    def __init__(self, cluster: Cluster, seconds: float):
        self.cluster, self.deadline = cluster, time.monotonic() + seconds
        self.samples: list[tuple[float, list[str], int]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)

    def run(self) -> None:
        due = time.monotonic()
        while not self.stopping.is_set() and time.monotonic() < self.deadline:
            names = self.cluster.in_rotation()
            if names is not None:
                health = sum(t.in_rotation for t in self.cluster.tracks().values())
                self.samples.append((time.monotonic(), names, health))
            due += SAMPLE_S
            self.stopping.wait(max(0.0, due - time.monotonic()))

    def latest(self) -> list[str] | None:
        return self.samples[-1][1] if self.samples else None

    def trace(self, t0: float) -> Trace:
        return [(t - t0, len(names)) for t, names, _ in list(self.samples)]

    def detail(self, t0: float) -> list[dict]:
        return [
            {"t": round(t - t0, 3), "capacity": len(n), "health_in_rotation": h, "in_rotation": n}
            for t, n, h in list(self.samples)
        ]


def wait_until(predicate: Callable[[], bool], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(SAMPLE_S / 2)
    return False


# --- the scenarios --------------------------------------------------------------------------


@dataclass
class Outcome:
    variant: str
    commands: list[str]
    trace: Trace = field(default_factory=list)
    detail: list[dict] = field(default_factory=list)
    start_capacity: int = 0
    min_capacity: int = 0
    max_capacity: int = 0
    below_s: float = 0.0
    requests: int = 0
    failed: int = 0
    latency: Latency = Latency(0, math.nan, math.nan, 0)
    restart_s: float | None = None  # rolling: the restart command's wall time
    out_s: float | None = None  # crash: the killed instance seen out of rotation
    back_s: float | None = None  # capacity back at the start level
    notes: list[str] = field(default_factory=list)
    error: str = ""


def budget(args: argparse.Namespace) -> float:
    """The longest a roll-out of every instance may take: each loads, then proves ready."""
    return args.instances * (args.load_seconds + 45) + 60


def run_variant(args: argparse.Namespace, variant: Variant) -> Outcome:
    outcome = Outcome(variant.label, [])
    try:
        with Cluster(args, variant) as cluster:
            outcome.commands.append(shlex.join(["cosyvoice-lb", *cluster.up_args]))
            log(f"{variant.scenario} / {variant.label}: up in {cluster.state_dir}")
            cluster.up(UP_TIMEOUT_S + 2 * args.load_seconds)
            cluster.settle(args.instances, args.instances + variant.spares, args.load_seconds + 60)
            (rolling if variant.scenario == "rolling" else crash)(args, variant, cluster, outcome)
    except (Exception, KeyboardInterrupt, Interrupted) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        log(f"{variant.label}: {outcome.error}")
        if isinstance(exc, (KeyboardInterrupt, Interrupted)):
            raise
    return outcome


def rolling(args: argparse.Namespace, variant: Variant, cluster: Cluster, outcome: Outcome) -> None:
    restart = ["restart", "--all", "--rolling", *variant.restart_args, "--state-dir", str(cluster.state_dir)]
    outcome.commands.append(shlex.join(["cosyvoice-lb", *restart]))
    bound = PRE_S + budget(args) + BACK_WAIT_S + TAIL_S + 10
    with Sampler(cluster, bound) as sampler, Load(cluster.url, args.clients, args.max_requests, bound, (TEXT,)) as load:
        time.sleep(PRE_S)
        start = len(sampler.latest() or [])
        t0 = time.monotonic()
        log(f"{variant.label}: restart --all --rolling")
        try:
            done = cli(*restart, timeout=budget(args))
            if done.returncode != 0:
                outcome.notes.append(f"restart exited {done.returncode}: {(done.stdout + done.stderr).strip()[-300:]}")
        except subprocess.TimeoutExpired:
            outcome.notes.append(f"restart still running after {budget(args):.0f} s")
        outcome.restart_s = time.monotonic() - t0
        if not wait_until(lambda: len(sampler.latest() or []) >= start, BACK_WAIT_S):
            outcome.notes.append(f"capacity not back at {start} within {BACK_WAIT_S:.0f} s of the restart's end")
        time.sleep(TAIL_S)
    summarize(outcome, sampler, load, t0, outcome.restart_s)


def crash(args: argparse.Namespace, variant: Variant, cluster: Cluster, outcome: Outcome) -> None:
    names = cluster.in_rotation() or []
    target = names[0]
    pid = cluster.pid_of(target)
    outcome.notes.append(f"killed {target} (pid {pid})")
    bound = PRE_S + args.load_seconds + 60 + TAIL_S + 10
    with Sampler(cluster, bound) as sampler, Load(cluster.url, args.clients, args.max_requests, bound, (TEXT,)) as load:
        time.sleep(PRE_S)
        start = len(sampler.latest() or [])
        outcome.commands.append(f"kill -KILL {pid}  # {target}, in rotation")
        log(f"{variant.label}: SIGKILL {target} (pid {pid})")
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()

        def back() -> bool:  # the dead one was taken out (or replaced) and capacity is whole again
            seen = [n for t, n, _ in list(sampler.samples) if t >= t0]
            out = next((i for i, n in enumerate(seen) if target not in n or len(n) < start), None)
            return out is not None and any(len(n) >= start for n in seen[out:])

        if not wait_until(back, args.load_seconds + 60):
            outcome.notes.append(f"capacity not back at {start} within {args.load_seconds + 60:.0f} s")
        time.sleep(TAIL_S)
    outcome.out_s = next(
        (t - t0 for t, n, _ in sampler.samples if t >= t0 and (target not in n or len(n) < start)), None
    )
    if outcome.out_s is not None:
        outcome.back_s = first_at(sampler.trace(t0), start, after=outcome.out_s)
    summarize(outcome, sampler, load, t0, None)  # latency: everything sent after the kill


def summarize(outcome: Outcome, sampler: Sampler, load: Load, t0: float, until: float | None) -> None:
    """Everything from the trace and the requests; latency of the 200s sent from ``t0`` until
    ``until`` (seconds after it; None: to the end)."""
    outcome.trace, outcome.detail = sampler.trace(t0), sampler.detail(t0)
    outcome.start_capacity = level_before(outcome.trace)
    after = [c for t, c in outcome.trace if t >= 0]
    outcome.min_capacity = min(after) if after else outcome.start_capacity
    outcome.max_capacity = max(after) if after else outcome.start_capacity
    outcome.below_s = seconds_below(outcome.trace, outcome.start_capacity)
    records = list(load.records)
    outcome.requests = len(records)
    outcome.failed = sum(not r.ok for r in records)
    last = math.inf if until is None else t0 + until
    outcome.latency = Latency.of([r.end - r.start for r in records if r.ok and t0 <= r.start <= last])
    if load.issued >= load.limit:
        outcome.notes.append(f"the load stopped at its cap of {load.limit} requests")


# --- report ----------------------------------------------------------------------------------


def num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return "—"
    return f"{a / b:.2f}"


def table(title: str, rows: list[tuple[str, list[str], str]], variants: list[str], ratio_header: str) -> Table:
    grid = Table(title=title, title_justify="left")
    grid.add_column("")
    for label in variants:
        grid.add_column(label, justify="right")
    grid.add_column(ratio_header, justify="right")
    for name, cells, r in rows:
        grid.add_row(name, *cells, r)
    return grid


Row = tuple[str, Callable[["Outcome"], str], Callable[["Outcome"], float | None] | None]

START: Row = ("starting capacity", lambda o: str(o.start_capacity), None)
CAPACITY: list[Row] = [
    ("min / max capacity", lambda o: f"{o.min_capacity} / {o.max_capacity}", None),
    ("s below starting capacity", lambda o: num(o.below_s), lambda o: o.below_s),
]


def load_rows(during: str) -> list[Row]:
    """The rows both scenarios end with: requests, latency ``during`` the event, notes."""
    return [
        ("requests sent / failed", lambda o: f"{o.requests} / {o.failed}", None),
        (f"p50 ms {during}", lambda o: num(o.latency.p50_ms, 0), lambda o: o.latency.p50_ms),
        (f"p99 ms {during}", lambda o: num(o.latency.p99_ms, 0), lambda o: o.latency.p99_ms),
        ("p99 rests on", lambda o: f"{o.latency.samples} samples, top {o.latency.at_or_above_p99}", None),
        ("notes", lambda o: "; ".join(o.notes), None),
    ]


ROLLING_ROWS: list[Row] = [
    START,
    *CAPACITY,
    ("restart wall s", lambda o: num(o.restart_s), lambda o: o.restart_s),
    *load_rows("during roll-out"),
]

CRASH_ROWS: list[Row] = [
    START,
    ("out of rotation after s", lambda o: num(o.out_s, 2), lambda o: o.out_s),
    ("capacity back after s", lambda o: num(o.back_s, 2), lambda o: o.back_s),
    *CAPACITY,
    *load_rows("after the kill"),
]


def cells(outcomes: list[Outcome | str], spec: list[Row]) -> list[tuple[str, list[str], str]]:
    """One row per metric: each variant's cell (or why it has none), and the second
    variant's value over the first's."""
    done = [o for o in outcomes if isinstance(o, Outcome) and not o.error]

    def cell(o: Outcome | str, show: Callable[[Outcome], str]) -> str:
        return o if isinstance(o, str) else f"error: {o.error}" if o.error else show(o)

    rows = []
    for name, show, value in spec:
        r = ratio(value(done[1]), value(done[0])) if value and len(done) == len(outcomes) == 2 else "—"
        rows.append((name, [cell(o, show) for o in outcomes], r))
    return rows


def variants(args: argparse.Namespace) -> list[Variant]:
    up_help, restart_help = flags_of("up"), flags_of("restart")
    surge = "--surge" in up_help
    spares = "--spares" in up_help
    restart_surge = ("--surge", "1") if "--surge" in restart_help else ()
    return [
        Variant("rolling", "drain-first"),
        Variant(
            "rolling",
            "surge 1",
            ("--surge", "1"),
            restart_surge,
            extra_slots=1,
            skipped="" if surge else "not run: cosyvoice-lb up has no --surge",
        ),
        Variant("crash", "no spare"),
        Variant(
            "crash",
            "1 spare",
            ("--spares", "1"),
            extra_slots=1,
            spares=1,
            skipped="" if spares else "not run: cosyvoice-lb up has no --spares",
        ),
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--load-seconds",
        type=float,
        default=20.0,
        help="--simulated-load-seconds of every instance (default 20; 3 for a quick run)",
    )
    parser.add_argument("--instances", type=int, default=4, help="instances serving (default 4)")
    parser.add_argument("--clients", type=int, default=3, help="closed-loop API workers (default 3)")
    parser.add_argument(
        "--max-requests", type=int, default=MAX_REQUESTS, help=f"request cap per variant (default {MAX_REQUESTS})"
    )
    parser.add_argument("--scenario", default="rolling,crash", help="rolling, crash or both (default)")
    parser.add_argument("--baseline-only", action="store_true", help="only drain-first and no spare")
    parser.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parent / "results"),
        help="where rollout-<timestamp>.json goes (default bench/results)",
    )
    parser.add_argument("--plot", metavar="PATH", help="also write capacity over time as SVG here")
    args = parser.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenario.split(",") if s.strip()]
    if not args.scenarios or set(args.scenarios) - {"rolling", "crash"}:
        parser.error("--scenario takes rolling, crash or rolling,crash")
    if args.instances < 2 or args.clients < 1 or args.load_seconds < 0 or args.max_requests < 1:
        parser.error("--instances at least 2, --clients and --max-requests at least 1, --load-seconds not negative")
    return args


def shown(path: Path) -> str:
    """``path`` relative to the working dir when it lies inside it."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    stop_on_sigterm()  # so the cluster still goes down
    console = Console(width=160)
    python = shown(Path(sys.executable))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    report: dict = {
        "command": shlex.join([python, "bench/rollout.py", *argv]),
        "started": stamp,
        "settings": {
            "load_seconds": args.load_seconds,
            "instances": args.instances,
            "clients": args.clients,
            "text_chars": len(TEXT),
            "ms_per_char": MS_PER_CHAR,
            "sample_s": SAMPLE_S,
            "max_requests": args.max_requests,
        },
        "scenarios": {},
    }
    panels = []
    failed = False
    for scenario in args.scenarios:
        chosen = [v for v in variants(args) if v.scenario == scenario]
        if args.baseline_only:
            chosen = [
                v if not v.extra_slots else Variant(v.scenario, v.label, skipped="not run: --baseline-only")
                for v in chosen
            ]
        outcomes: list[Outcome | str] = [v.skipped or run_variant(args, v) for v in chosen]
        failed |= any(isinstance(o, Outcome) and o.error for o in outcomes)
        rerun = [
            python,
            "bench/rollout.py",
            "--scenario",
            scenario,
            "--load-seconds",
            f"{args.load_seconds:g}",
            "--instances",
            str(args.instances),
            "--clients",
            str(args.clients),
            *(["--max-requests", str(args.max_requests)] if args.max_requests != MAX_REQUESTS else []),
            *(["--baseline-only"] if args.baseline_only else []),
        ]
        labels = [v.label for v in chosen]
        console.print(f"\n$ {shlex.join(rerun)}", markup=False, highlight=False)
        if scenario == "rolling":
            title = (
                f"rolling restart of {args.instances} instances, {args.clients} clients, model load "
                f"{args.load_seconds:g} s (requests: the whole run; latency: 200s sent during the roll-out)"
            )
            grid = table(title, cells(outcomes, ROLLING_ROWS), labels, f"{labels[1]} / {labels[0]}")
        else:
            title = (
                f"SIGKILL of one in-rotation instance of {args.instances}, {args.clients} clients, model load "
                f"{args.load_seconds:g} s (requests: the whole run; latency: 200s sent after the kill, "
                f"until {TAIL_S:g} s past back)"
            )
            grid = table(title, cells(outcomes, CRASH_ROWS), labels, f"{labels[1]} / {labels[0]}")
        console.print(grid)
        for outcome in outcomes:
            if isinstance(outcome, Outcome):
                for command in outcome.commands:
                    console.print(f"  {outcome.variant}: {command}", markup=False, highlight=False)
        done = {o.variant: o for o in outcomes if isinstance(o, Outcome) and o.trace}
        report["scenarios"][scenario] = [
            {"variant": v.label, "skipped": o}
            if isinstance(o, str)
            else {**{k: val for k, val in asdict(o).items() if k not in ("trace", "detail")}, "trace": o.detail}
            for v, o in zip(chosen, outcomes)
        ]
        what = "restart" if scenario == "rolling" else "the kill"
        panels.append(
            (
                f"{scenario}: capacity in nginx's rotation",
                f"seconds since {what}",
                {label: o.trace for label, o in done.items()},
            )
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rollout-{stamp}.json"
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"\ntraces: {shown(path)}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        Path(args.plot).write_text(svg(panels))
        print(f"plot: {args.plot}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
