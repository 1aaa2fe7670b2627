"""A small asyncio load generator for /v1/tts on 127.0.0.1, exact about what it measures.

Why not locust: locust's users are closed loops (each waits for its answer, then thinks),
so a slow server lowers the offered load and hides queueing -- the thing a routing
benchmark must show. Its statistics are bucketed. Here arrivals are *open loop* (a Poisson
process at a given rate, independent of the answers), every request's latency is kept,
and percentiles are computed from all of them. One asyncio loop and one httpx client are
light enough for the rates a box of TTS instances serves.

Every run is bounded in requests and in time, and refuses any host but 127.0.0.1. Also
the helpers the bench scripts share: the CLI command, a free block of ports, SIGTERM
turned into an interruption, and a shield that lets what a run started go down even when
it is interrupted again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np

from cosyvoice_lb.launcher.cluster.ports import free_port_block  # noqa: F401 - the benches' port picker


@dataclass(frozen=True)
class Result:
    start: float  # seconds since the run began (when the request was due)
    latency: float  # seconds, from when it was due until the whole answer was read
    status: int  # HTTP status; 0 when the request failed without one
    kind: str  # the request's class (e.g. "short", "long")


@dataclass(frozen=True)
class Summary:
    requests: int
    ok: int
    failed: int
    seconds: float
    throughput: float  # successful requests per second
    p50_ms: float
    p95_ms: float
    p99_ms: float

    @classmethod
    def of(cls, results: list[Result], seconds: float) -> Summary:
        good = np.array([r.latency for r in results if r.status == 200]) * 1000
        p50, p95, p99 = np.percentile(good, [50, 95, 99]) if good.size else (float("nan"),) * 3
        return cls(
            len(results),
            int(good.size),
            len(results) - int(good.size),
            seconds,
            good.size / seconds if seconds else 0.0,
            float(p50),
            float(p95),
            float(p99),
        )


def cli_command() -> list[str]:
    """cosyvoice-lb as the bench scripts run it: the one next to this Python (the venv's),
    else the module."""
    script = Path(sys.executable).with_name("cosyvoice-lb")
    return [str(script)] if script.exists() else [sys.executable, "-m", "cosyvoice_lb.launcher.cli"]


class Interrupted(BaseException):
    """SIGTERM (``timeout``, a service manager): stop the run as Ctrl-C does; what it
    started still goes down."""


def stop_on_sigterm() -> None:
    def interrupted(*_: object) -> None:
        raise Interrupted()

    signal.signal(signal.SIGTERM, interrupted)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Taking down what a run started: a second Ctrl-C or SIGTERM waits until it is done."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cluster_up(command: list[str], state: Path, cwd: Path, timeout: float = 300) -> None:
    """Run a bench's `cosyvoice-lb up` (no COSYVOICE_LB_ settings from this environment);
    when it fails (or is interrupted), take down what it started and stop the run with its
    output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE_LB_")}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    except BaseException:
        cluster_down(state, cwd)
        raise
    if done.returncode != 0:
        cluster_down(state, cwd)
        raise SystemExit(f"cosyvoice-lb up failed:\n{done.stdout}\n{done.stderr}")


def cluster_down(state: Path, cwd: Path, timeout: float = 120) -> None:
    """`cosyvoice-lb down` of a bench's cluster and its state dir removed, shielded from a
    second Ctrl-C or SIGTERM."""
    with shielded():
        subprocess.run(
            [*cli_command(), "down", "--state-dir", str(state)], capture_output=True, timeout=timeout, cwd=cwd
        )
        shutil.rmtree(state, ignore_errors=True)


def loopback_only(url: str) -> str:
    host = urlsplit(url).hostname
    if host != "127.0.0.1":
        raise ValueError(f"load goes to 127.0.0.1 only, not {host!r}")
    return url


async def _one(
    client: httpx.AsyncClient, url: str, body: dict, kind: str, due: float, began: float, results: list[Result]
) -> None:
    try:
        response = await client.post(url, json=body)
        status = response.status_code
    except httpx.HTTPError:
        status = 0
    results.append(Result(due - began, time.monotonic() - due, status, kind))


def client(timeout: float) -> httpx.AsyncClient:
    # No proxies from the environment; enough connections that the client never queues.
    return httpx.AsyncClient(
        timeout=timeout, trust_env=False, limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    )


async def open_loop(
    url: str,
    rate: float,
    seconds: float,
    make: Callable[[random.Random], tuple[str, dict]],
    seed: int = 1,
    timeout: float = 120.0,
    max_requests: int = 100_000,
) -> list[Result]:
    """Poisson arrivals at ``rate`` per second for ``seconds`` (at most ``max_requests``);
    ``make(rng)`` gives each request's (kind, JSON body). Waits for the answers (each at
    most ``timeout``), and returns one :class:`Result` per request."""
    loopback_only(url)
    rng = random.Random(seed)
    results: list[Result] = []
    tasks = []
    async with client(timeout) as http:
        began = time.monotonic()
        due = began
        for _ in range(max_requests):
            due += rng.expovariate(rate)
            if due - began > seconds:
                break
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            kind, body = make(rng)
            tasks.append(asyncio.create_task(_one(http, url, body, kind, due, began, results)))
        await asyncio.gather(*tasks)
    return results


async def closed_loop(
    url: str, concurrency: int, seconds: float, body: dict, timeout: float = 120.0, max_requests: int = 100_000
) -> tuple[list[Result], float]:
    """``concurrency`` clients, each sending its next request when the last is answered,
    for ``seconds``: the most the target serves. Returns the results and the time taken."""
    loopback_only(url)
    results: list[Result] = []
    sent = 0

    async def worker(http: httpx.AsyncClient, began: float) -> None:
        nonlocal sent
        while time.monotonic() - began < seconds and sent < max_requests:
            sent += 1
            await _one(http, url, body, "fixed", time.monotonic(), began, results)

    async with client(timeout) as http:
        began = time.monotonic()
        await asyncio.gather(*(worker(http, began) for _ in range(concurrency)))
        return results, time.monotonic() - began


def run(coroutine):
    return asyncio.run(coroutine)
