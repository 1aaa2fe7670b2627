#!/usr/bin/env python3
"""The benchmarks in one run: balancer overhead, scale-out, routing tail latency, startup.

    python bench/run.py [--quick] [--out bench/results]

Everything runs on 127.0.0.1 with clusters this script starts (``cosyvoice-lb up``) and
always takes down. The instances run ``--engine simulated``: a load model of a GPU-bound
CosyVoice3 instance (a wait proportional to the text, one synthesis at a time, almost no
CPU), so the balancer is what is measured even on a box without a GPU. Startup uses the
embedded espeak engine.

a. overhead   one instance, the same closed-loop load direct and through nginx: added
              p50/p99 (one client, short requests: no queueing) and the throughput ratio
              (3 clients: the engine saturated).
b. scale-out  1, 2, 4, 8 instances, 2 clients per instance: throughput and efficiency
              against 1 instance times N.
c. routing    4 instances, open-loop Poisson arrivals at 50/70/90 % of capacity, two mixes:
              80 % short / 20 % ten times longer requests, and uniform (every request the
              same length, the same mean): cosyvoice-lb routing by work (its default), the
              same cluster with --routing least-conn (switched live), and nginx round-robin
              configured as the seeds do, on the same arrivals. --repeats runs each point
              again with other arrivals: the table pools them and shows each run's p99.
d. startup    ``cosyvoice-lb up`` until all ready, 1/2/4 embedded instances.

It prints markdown tables, writes CSV and PNG files under --out, and ends with three lines:
overhead, scale-out and routing figures. --quick runs shorter loads (about 20 minutes on
2 cores); the full run takes about an hour. Stopped (Ctrl-C, SIGTERM), it takes down what
it started.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load  # noqa: E402  (bench/load.py)
from cosyvoice_lb.instance.routing.board import Opener  # noqa: E402  (the routing board: is a switch done?)
from cosyvoice_lb.launcher.state.layout import Layout  # noqa: E402

MS_PER_CHAR = 4.0
SHORT = "a" * 10  # 40 ms of service
LONG = "a" * 100  # 400 ms: ten times longer
FIXED = "a" * 50  # 200 ms: throughput and scale-out
LONG_SHARE = 0.2
MEAN_SERVICE = (1 - LONG_SHARE) * len(SHORT) * MS_PER_CHAR / 1000 + LONG_SHARE * len(LONG) * MS_PER_CHAR / 1000
SAME = "a" * round(MEAN_SERVICE * 1000 / MS_PER_CHAR)  # the uniform mix: every request the mean length
ROUTING_INSTANCES = 4
MIXES = ("80/20", "uniform")
SETUPS = ("work", "least_conn", "round-robin")  # cosyvoice-lb's default first
LOADS = (0.5, 0.7, 0.9)
SCALE = (1, 2, 4, 8)
STARTUP = (1, 2, 4)
# No request is refused in any configuration: what differs is routing alone (cosyvoice-lb's
# own default, --max-queue 2, would answer 503 at once where round-robin queues).
QUEUE = 64


@dataclass(frozen=True)
class Durations:
    latency_requests: int
    throughput_s: float
    scale_s: float
    routing_s: float  # one run of one routing point, 80/20 mix
    uniform_s: float  # the same, uniform mix (its tail varies far less)
    repeats: int  # runs of each routing point, each with its own arrivals


QUICK = Durations(latency_requests=300, throughput_s=15, scale_s=15, routing_s=45, uniform_s=30, repeats=1)
FULL = Durations(latency_requests=1000, throughput_s=30, scale_s=30, routing_s=120, uniform_s=60, repeats=2)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run([*load.cli_command(), *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"cosyvoice-lb {shlex.join(args)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return done


class Cluster:
    """A cosyvoice-lb cluster on 127.0.0.1 in a fresh state dir; ``down`` at the end."""

    def __init__(self, engine: str = "simulated", max_instances: int = 8):
        self.engine = engine
        base = load.free_port_block(max_instances + 1)
        self.port, self.base = base, base + 1
        self.state_dir = Path(tempfile.mkdtemp(prefix="cb", dir="/tmp"))  # short: a unix socket lives here
        self.instances = 0
        self.routing = "work"
        log(f"cluster state dir {self.state_dir}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def instance_url(self, index: int = 0) -> str:
        return f"http://127.0.0.1:{self.base + index}"

    def up(self, instances: int, routing: str = "work") -> float:
        """Start (or rescale, or switch the routing) with ``instances``; the seconds `up` took."""
        args = [
            "up",
            "--engine",
            self.engine,
            "--instances",
            str(instances),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--base-port",
            str(self.base),
            "--state-dir",
            str(self.state_dir),
            "--routing",
            routing,
        ]
        if self.engine == "simulated":
            args += ["--simulated-ms-per-char", str(MS_PER_CHAR), "--max-queue", str(QUEUE)]
        started = time.monotonic()
        cli(*args)
        self.instances, self.routing = instances, routing
        return time.monotonic() - started

    def routed(self) -> tuple[int, int]:
        """(declined, taken as the last resort): the instances' counters, summed (an
        instance that does not answer counts nothing: the figures are a lower bound then)."""
        declined = last = 0
        for index in range(self.instances):
            try:
                with urllib.request.urlopen(self.instance_url(index) + "/ping", timeout=5) as answer:
                    counters = json.load(answer).get("routing", {})
            except (OSError, ValueError) as exc:  # (HTTPError and URLError are OSErrors)
                log(f"instance {index}: no routing counters ({exc})")
                continue
            declined, last = declined + counters.get("declined", 0), last + counters.get("last_resort", 0)
        return declined, last

    def switch(self, routing: str) -> None:
        """Routing by work or least connections, live; back once the board says so."""
        self.up(self.instances, routing=routing)
        board = Opener(str(Layout(self.state_dir).routing_board), retry=0.2)  # (follows a board made anew)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # (the health loop turns work on once nginx has the last resort)
            current = board()
            if current is not None and current.work()[0] == (routing == "work"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the routing board never showed --routing {routing}")

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        with load.shielded():
            try:
                cli("down", "--state-dir", str(self.state_dir))
            finally:
                shutil.rmtree(self.state_dir, ignore_errors=True)


SEEDS_NGINX = """\
# nginx round-robin as the seeds configure it (seeds/003): default balancing, passive
# checks max_fails=3 fail_timeout=30s, keepalive 10, buffering on, 60 s timeouts.
daemon off;
worker_processes auto;
pid {dir}/nginx.pid;
error_log {dir}/error.log;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    upstream cosyvoice_backend {{
{servers}
        keepalive 10;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://cosyvoice_backend;
            proxy_set_header Host $host;
            proxy_set_header X-Real-IP $remote_addr;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
            proxy_connect_timeout 60s;
            proxy_send_timeout 60s;
            proxy_read_timeout 60s;
            proxy_buffering on;
        }}
    }}
}}
"""


class RoundRobin:
    """A second nginx in front of the same instances, configured like the seeds'."""

    def __init__(self, ports: list[int]):
        self.dir = Path(tempfile.mkdtemp(prefix="rr", dir="/tmp"))
        self.port = load.free_port_block(1)
        servers = "\n".join(f"        server 127.0.0.1:{p} max_fails=3 fail_timeout=30s;" for p in ports)
        (self.dir / "nginx.conf").write_text(SEEDS_NGINX.format(dir=self.dir, servers=servers, port=self.port))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RoundRobin:
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        self.process = subprocess.Popen(
            [nginx, "-p", str(self.dir), "-c", str(self.dir / "nginx.conf")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.1)
        raise RuntimeError(f"the round-robin nginx did not listen; see {self.dir}/error.log")

    def __exit__(self, *exc: object) -> None:
        with load.shielded():
            if self.process and self.process.poll() is None:
                self.process.send_signal(signal.SIGQUIT)
                try:
                    self.process.wait(15)
                except subprocess.TimeoutExpired:
                    self.process.kill()
            shutil.rmtree(self.dir, ignore_errors=True)


# --- the measurements ------------------------------------------------------------------------


def tts(url: str) -> str:
    return url + "/v1/tts"


def latency(url: str, requests: int) -> load.Summary:
    results, seconds = load.run(load.closed_loop(tts(url), 1, 3600, {"text": SHORT}, max_requests=requests))
    return load.Summary.of(results, seconds)


def throughput(url: str, clients: int, seconds: float) -> load.Summary:
    results, took = load.run(load.closed_loop(tts(url), clients, seconds, {"text": FIXED}))
    return load.Summary.of(results, took)


def mixed(rng: random.Random) -> tuple[str, dict]:
    return ("long", {"text": LONG}) if rng.random() < LONG_SHARE else ("short", {"text": SHORT})


def uniform(_rng: random.Random) -> tuple[str, dict]:
    return "same", {"text": SAME}


MAKERS = {"80/20": mixed, "uniform": uniform}


@dataclass
class Point:
    """One routing point: every run's latencies (ms, answered requests) and counts."""

    mix: str
    load_pct: int
    setup: str
    rate_rps: float
    runs: list[np.ndarray]
    requests: int = 0
    failed: int = 0
    declined: int = 0
    last_resort: int = 0

    def add(self, results: list[load.Result], declined: int = 0, last_resort: int = 0) -> None:
        self.runs.append(np.array([r.latency * 1000 for r in results if r.status == 200]))
        self.requests += len(results)
        self.failed += sum(1 for r in results if r.status != 200)
        self.declined += max(0, declined)  # (an instance restarted in between would count back)
        self.last_resort += max(0, last_resort)

    @property
    def pooled(self) -> np.ndarray:
        return np.concatenate(self.runs) if self.runs else np.zeros(0)

    def p99s(self) -> list[float]:
        """Each run's p99 (nan for a run without one answer: the runs stay aligned)."""
        return [float(np.percentile(run, 99)) if run.size else float("nan") for run in self.runs]


def routing_rows(points: list[Point]) -> list[dict]:
    """The table: each point pooled over its runs, its p99 against round-robin's on the same
    arrivals (pooled, and each run's: their spread is how far one run can be trusted)."""
    rr = {(p.mix, p.load_pct): p for p in points if p.setup == "round-robin"}
    rows = []
    for p in points:
        latencies = p.pooled
        p50, p95, p99 = np.percentile(latencies, [50, 95, 99]) if latencies.size else (float("nan"),) * 3
        base = rr.get((p.mix, p.load_pct))
        ratios = [a / b for a, b in zip(p.p99s(), base.p99s())] if base else []
        pooled_ratio = p99 / np.percentile(base.pooled, 99) if base and base.pooled.size else float("nan")
        rows.append(
            {
                "mix": p.mix,
                "load_pct": p.load_pct,
                "setup": p.setup,
                "rate_rps": p.rate_rps,
                "requests": p.requests,
                "failed": p.failed,
                "p50_ms": float(p50),
                "p95_ms": float(p95),
                "p99_ms": float(p99),
                "beyond_p99": int((latencies >= p99).sum()) if latencies.size else 0,
                "p99_runs_ms": " / ".join(f"{v:.0f}" for v in p.p99s()),
                "ratio_rr": float(pooled_ratio),
                "ratio_runs": " / ".join(f"{r:.2f}" for r in ratios),
                "ratio_min": min(ratios, default=float("nan")),
                "ratio_max": max(ratios, default=float("nan")),
                "hops_per_request": p.declined / p.requests if p.requests else 0.0,
                "last_resort": p.last_resort,
            }
        )
    return rows


def routing_section(cluster: Cluster, d: Durations) -> list[dict]:
    """Every point's setups one after another on the same arrivals, so a slow patch of the
    box touches all three alike: the routing the cluster has first, round-robin, then the
    other (one live switch per point; the next point starts with that one)."""
    cluster.up(ROUTING_INSTANCES)
    capacity = ROUTING_INSTANCES / MEAN_SERVICE
    points: dict[tuple[str, float, str], Point] = {}
    with RoundRobin([cluster.base + i for i in range(ROUTING_INSTANCES)]) as rr:
        for run in range(d.repeats):
            for mix in MIXES:
                seconds = d.routing_s if mix == "80/20" else d.uniform_s
                for share in LOADS:
                    rate = share * capacity
                    seed = 1000 * run + int(share * 100) + (0 if mix == "80/20" else 500)  # the same for each setup
                    now = "work" if cluster.routing == "work" else "least_conn"
                    for setup in (now, "round-robin", "least_conn" if now == "work" else "work"):
                        if setup != "round-robin" and cluster.routing != setup.replace("_", "-"):
                            cluster.switch(setup.replace("_", "-"))  # live: nginx and the board
                        url = rr.url if setup == "round-robin" else cluster.url
                        log(f"routing run {run + 1}/{d.repeats}: {setup}, {mix}, {share:.0%} ({rate:.1f} requests/s)")
                        point = points.setdefault((mix, share, setup), Point(mix, round(share * 100), setup, rate, []))
                        before = cluster.routed()
                        results = load.run(load.open_loop(tts(url), rate, seconds, MAKERS[mix], seed=seed))
                        after = cluster.routed()
                        point.add(results, after[0] - before[0], after[1] - before[1])
    order = {name: i for i, name in enumerate(SETUPS)}
    ordered = sorted(points.values(), key=lambda p: (MIXES.index(p.mix), p.load_pct, order[p.setup]))
    return routing_rows(ordered)


@dataclass
class Report:
    overhead: list[dict]
    scale: list[dict]
    routing: list[dict]
    startup: list[dict]


def overhead_section(cluster: Cluster, d: Durations) -> list[dict]:
    rows = []
    for target, url in (("direct", cluster.instance_url(0)), ("nginx", cluster.url)):
        log(f"overhead: {target}")
        lat = latency(url, d.latency_requests)
        thr = throughput(url, 3, d.throughput_s)
        rows.append(
            {
                "path": target,
                "requests": lat.requests + thr.requests,
                "failed": lat.failed + thr.failed,
                "p50_ms": lat.p50_ms,
                "p99_ms": lat.p99_ms,
                "throughput_rps": thr.throughput,
            }
        )
    return rows


def scale_section(cluster: Cluster, d: Durations) -> list[dict]:
    rows = []
    for n in SCALE:
        cluster.up(n)
        log(f"scale-out: {n} instance(s)")
        s = throughput(cluster.url, 2 * n, d.scale_s)
        rows.append(
            {
                "instances": n,
                "requests": s.requests,
                "failed": s.failed,
                "throughput_rps": s.throughput,
                "p50_ms": s.p50_ms,
                "p99_ms": s.p99_ms,
            }
        )
    single = rows[0]["throughput_rps"]
    for row in rows:
        row["linear_rps"] = single * row["instances"]
        row["efficiency_pct"] = 100 * row["throughput_rps"] / row["linear_rps"] if single else 0.0
    return rows


def startup_section() -> list[dict]:
    rows = []
    for n in STARTUP:
        with Cluster(engine="espeak", max_instances=n) as cluster:
            log(f"startup: {n} embedded instance(s)")
            rows.append({"instances": n, "seconds": cluster.up(n)})
    return rows


# --- output ----------------------------------------------------------------------------------


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Markdown; columns are (key, header, format)."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(format(row[k], f) if f else str(row[k]) for k, _, f in columns) + " |")
    return "\n".join(lines)


def saved(out: Path, name: str, rows: list[dict]) -> list[dict]:
    """A section's rows, written to its CSV as soon as it is done (a later failure keeps them)."""
    write_csv(out / f"{name}.csv", rows)
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plots(report: Report, out: Path) -> list[Path]:
    """The PNG plots (the bench extra's matplotlib; without it the tables and CSVs still come)."""
    try:
        import matplotlib
    except ImportError:
        print("\nplots left out: matplotlib is not installed (pip install -e '.[bench]')")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.2))
    for axis, mix, title in ((left, "80/20", "80 % short / 20 % 10x long"), (middle, "uniform", "uniform lengths")):
        for setup, style in zip(SETUPS, ("o-", "^:", "s--")):
            points = [r for r in report.routing if r["setup"] == setup and r["mix"] == mix]
            axis.plot([r["load_pct"] for r in points], [r["p99_ms"] for r in points], style, label=setup)
        axis.set(title=f"routing p99: {title}", xlabel="load (% of capacity)", ylabel="p99 ms", yscale="log")
        axis.legend()
    n = [r["instances"] for r in report.scale]
    right.plot(n, [r["throughput_rps"] for r in report.scale], "o-", label="measured")
    right.plot(n, [r["linear_rps"] for r in report.scale], "k:", label="linear (1 instance x N)")
    right.set(title="scale-out: throughput", xlabel="instances", ylabel="requests/s", xticks=n)
    right.legend()
    fig.tight_layout()
    path = out / "bench.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


ROUTING_COLUMNS = [
    ("load_pct", "load %", ""),
    ("setup", "setup", ""),
    ("rate_rps", "requests/s", ".1f"),
    ("requests", "requests", ""),
    ("failed", "failed", ""),
    ("p50_ms", "p50 ms", ".0f"),
    ("p95_ms", "p95 ms", ".0f"),
    ("p99_ms", "p99 ms", ".0f"),
    ("beyond_p99", "at/above p99", ""),
    ("p99_runs_ms", "p99 per run", ""),
    ("ratio_rr", "p99 / round-robin", ".2f"),
    ("ratio_runs", "per run", ""),
    ("hops_per_request", "declines per request", ".2f"),
    ("last_resort", "last resort", ""),
]


def summary_lines(report: Report) -> list[str]:
    direct, via = report.overhead
    four = next(r for r in report.scale if r["instances"] == 4)
    at70 = {r["setup"]: r for r in report.routing if r["load_pct"] == 70 and r["mix"] == "80/20"}
    default = at70[SETUPS[0]]
    spread = f" (runs {default['ratio_min']:.2f}-{default['ratio_max']:.2f})" if "/" in default["ratio_runs"] else ""
    return [
        f"overhead: p50 {via['p50_ms'] - direct['p50_ms']:+.2f} ms, p99 {via['p99_ms'] - direct['p99_ms']:+.2f} ms, "
        f"throughput ratio {via['throughput_rps'] / direct['throughput_rps']:.3f}",
        f"scale-out: 4 instances, efficiency {four['efficiency_pct']:.1f} %",
        f"routing: p99 ratio vs round-robin {default['ratio_rr']:.2f} at 70% load{spread}; "
        f"least_conn {at70['least_conn']['ratio_rr']:.2f}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter loads (under ~15 minutes on 2 cores)")
    parser.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parent / "results"),
        help="where the CSV and PNG files go (default: bench/results)",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="runs of each routing point (default: 1 with --quick, 2 otherwise)"
    )
    args = parser.parse_args(argv)
    d = QUICK if args.quick else FULL
    if args.repeats is not None:
        if args.repeats < 1:
            parser.error("--repeats must be at least 1")
        d = Durations(**{**asdict(d), "repeats": args.repeats})
    load.stop_on_sigterm()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("command: " + shlex.join([Path(sys.executable).name, "bench/run.py", *(argv or sys.argv[1:])]))
    print(
        f"load model: --engine simulated, {MS_PER_CHAR:g} ms per character: short {len(SHORT)} chars "
        f"({len(SHORT) * MS_PER_CHAR:g} ms), long {len(LONG)} chars ({len(LONG) * MS_PER_CHAR:g} ms), "
        f"fixed {len(FIXED)} chars ({len(FIXED) * MS_PER_CHAR:g} ms), uniform mix {len(SAME)} chars "
        f"({len(SAME) * MS_PER_CHAR:g} ms); --max-queue {QUEUE}"
    )
    print(f"durations: {asdict(d)}")
    started = time.monotonic()
    try:
        with Cluster() as cluster:
            cluster.up(1)
            overhead = saved(out, "overhead", overhead_section(cluster, d))
            scale = saved(out, "scale", scale_section(cluster, d))
            routing = saved(out, "routing", routing_section(cluster, d))
        report = Report(overhead, scale, routing, saved(out, "startup", startup_section()))
    except (KeyboardInterrupt, load.Interrupted):
        log(f"interrupted: what it started is down; the sections done are in {out}")
        return 130

    print("\n### a. overhead: one instance, direct vs through nginx\n")
    print(
        table(
            report.overhead,
            [
                ("path", "path", ""),
                ("requests", "requests", ""),
                ("failed", "failed", ""),
                ("p50_ms", "p50 ms (1 client, short)", ".2f"),
                ("p99_ms", "p99 ms (1 client, short)", ".2f"),
                ("throughput_rps", "requests/s (3 clients)", ".2f"),
            ],
        )
    )
    print("\n### b. scale-out: 2 clients per instance\n")
    print(
        table(
            report.scale,
            [
                ("instances", "instances", ""),
                ("requests", "requests", ""),
                ("failed", "failed", ""),
                ("throughput_rps", "requests/s", ".2f"),
                ("linear_rps", "linear", ".2f"),
                ("efficiency_pct", "efficiency %", ".1f"),
                ("p99_ms", "p99 ms", ".0f"),
            ],
        )
    )
    for mix in MIXES:
        what = (
            f"{100 - LONG_SHARE * 100:.0f} % short / {LONG_SHARE * 100:.0f} % long"
            if mix == "80/20"
            else f"uniform ({len(SAME)} characters each)"
        )
        print(
            f"\n### c. routing: {ROUTING_INSTANCES} instances, {what}, open loop (capacity "
            f"{ROUTING_INSTANCES / MEAN_SERVICE:.1f} requests/s), {d.repeats} run(s) per point\n"
        )
        print(table([r for r in report.routing if r["mix"] == mix], ROUTING_COLUMNS))
    print("\n### d. startup: `cosyvoice-lb up` until all ready (espeak)\n")
    print(table(report.startup, [("instances", "instances", ""), ("seconds", "seconds", ".1f")]))
    written = plots(report, out)
    files = [out / f"{n}.csv" for n in ("overhead", "scale", "routing", "startup")] + written
    print(
        f"\nfiles: {', '.join(os.path.relpath(f) for f in files)}; took {(time.monotonic() - started) / 60:.1f} min\n"
    )
    for line in summary_lines(report):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
