#!/usr/bin/env python3
"""Whole answers: what writing a response's head and body in one write costs, and what it
saves when an instance freezes.

    python bench/whole_responses.py [--requests 400] [--repeats 3] [--fault-seconds 60]

Two uvicorn servers (the instances' HTTP stack: a non-streamed 66,854-byte WAV answer, the
size once cut in CI) behind a real nginx on 127.0.0.1, proxied as the cluster's API is
(unbuffered, one upstream connection per request, retried on error or timeout), once with
uvicorn's own protocol ("plain") and once with the instances' (``whole``: see
cosyvoice_lb/instance/whole_responses.py).

Latency: ``--requests`` sequential POSTs through nginx per mode and repeat, the two modes
taking turns request by request; the table gives p50/p99/mean per repeat and over all.

Fault (``--fault-seconds``, 0 to skip): 4 clients for that long while one server after the
other is SIGSTOPped for 0.25 s every 0.3 s (nginx gives up on it after 0.2 s and tries the
other); counted: whole answers, cut bodies (the client library's IncompleteRead), other
failures (a 504: both servers frozen in turn within one request's tries). A cut body is
what a freeze between head and body leaves.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
BODY_BYTES = 66854

APP = f"""
import sys, uvicorn
from starlette.responses import Response
BODY = bytes(range(256)) * ({BODY_BYTES} // 256) + bytes({BODY_BYTES} % 256)
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await Response(BODY, media_type="audio/wav")(scope, receive, send)
http = "h11"
if sys.argv[2] == "whole":
    from cosyvoice_lb.instance.whole_responses import http_protocol
    http = http_protocol()
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), http=http, log_level="critical", access_log=False)
"""

NGINX = """
daemon off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    upstream pool {{ least_conn; server 127.0.0.1:{a} max_fails=0; server 127.0.0.1:{b} max_fails=0; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://pool;
            proxy_http_version 1.1;
            proxy_set_header Connection close;
            proxy_buffering off;
            proxy_connect_timeout 1s;
            proxy_read_timeout 200ms;
            proxy_next_upstream error timeout non_idempotent;
            proxy_next_upstream_tries 0;
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_up(url: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            requests.post(url, data=b"{}", timeout=1)
            return
        except requests.RequestException:
            time.sleep(0.1)
    raise SystemExit(f"{url} did not answer within 20 s")


class Stack:
    """Two uvicorn servers of one mode behind one nginx; stopped in ``close``."""

    def __init__(self, mode: str, workdir: Path) -> None:
        self.ports = [free_port(), free_port()]
        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.servers = [
            subprocess.Popen([sys.executable, "-c", APP, str(p), mode], env=env, cwd=workdir) for p in self.ports
        ]
        conf = workdir / f"nginx-{mode}.conf"
        conf.write_text(NGINX.format(dir=workdir, a=self.ports[0], b=self.ports[1], port=self.port))
        self.nginx = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(workdir), "-e", str(workdir / "error.log")])
        self.url = f"http://127.0.0.1:{self.port}/v1/tts"
        for p in self.ports:
            wait_up(f"http://127.0.0.1:{p}/")
        wait_up(self.url)

    def close(self) -> None:
        for proc in [self.nginx, *self.servers]:
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            proc.terminate()
        for proc in [self.nginx, *self.servers]:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def latencies(urls: dict[str, str], count: int) -> dict[str, list[float]]:
    """``count`` requests to each URL, taking turns (a busy box's drift hits both alike)."""
    out: dict[str, list[float]] = {mode: [] for mode in urls}
    with requests.Session() as session:
        for _ in range(count):
            for mode, url in urls.items():
                start = time.perf_counter()
                reply = session.post(url, data=b'{"text": "Hello"}', timeout=10)
                assert reply.status_code == 200 and len(reply.content) == BODY_BYTES
                out[mode].append((time.perf_counter() - start) * 1000)
    return out


def fault_run(stack: Stack, seconds: float) -> Counter:
    seen: Counter = Counter()
    stop = threading.Event()

    def client() -> None:
        with requests.Session() as session:
            while not stop.is_set():
                try:
                    reply = session.post(stack.url, data=b"{}", timeout=10)
                    whole = reply.status_code == 200 and len(reply.content) == BODY_BYTES
                    seen["whole" if whole else f"status {reply.status_code}"] += 1
                except requests.exceptions.ChunkedEncodingError:
                    seen["cut body"] += 1
                except requests.RequestException as exc:
                    seen[type(exc).__name__] += 1

    threads = [threading.Thread(target=client) for _ in range(4)]
    for thread in threads:
        thread.start()
    rng = random.Random(7)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        target = stack.servers[rng.randrange(2)].pid
        time.sleep(rng.uniform(0, 0.05))  # (a freeze at any point of the answer)
        os.kill(target, signal.SIGSTOP)
        time.sleep(0.25)
        os.kill(target, signal.SIGCONT)
        seen["freezes"] += 1
    stop.set()
    for thread in threads:
        thread.join()
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="sequential requests per mode and repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fault-seconds", type=float, default=60, help="length of each mode's fault run (0: none)")
    args = parser.parse_args()
    rows: list[tuple[str, str, float, float, float]] = []
    faults: dict[str, Counter] = {}
    with tempfile.TemporaryDirectory(prefix="whole-") as tmp:
        stacks = {mode: Stack(mode, Path(tmp)) for mode in ("plain", "whole")}
        try:
            every: dict[str, list[float]] = {mode: [] for mode in stacks}
            urls = {mode: stack.url for mode, stack in stacks.items()}
            latencies(urls, 50)  # (warm)
            for repeat in range(1, args.repeats + 1):
                for mode, got in latencies(urls, args.requests).items():
                    every[mode] += got
                    rows.append((mode, str(repeat), *summary(got)))
            for mode in stacks:
                rows.append((mode, "all", *summary(every[mode])))
            if args.fault_seconds:
                for mode, stack in stacks.items():
                    faults[mode] = fault_run(stack, args.fault_seconds)
        finally:
            for stack in stacks.values():
                stack.close()
    print(f"\nnon-streamed {BODY_BYTES}-byte answers through nginx, {args.requests} sequential requests per row\n")
    print("| mode  | repeat | p50 ms | p99 ms | mean ms |")
    print("|-------|--------|--------|--------|---------|")
    for mode, repeat, p50, p99, mean in rows:
        print(f"| {mode:<5} | {repeat:<6} | {p50:6.3f} | {p99:6.3f} | {mean:7.3f} |")
    if faults:
        print(f"\nfreezes under load ({args.fault_seconds:g} s per mode, 4 clients)\n")
        print("| mode  | freezes | whole answers | cut bodies | other failures | which |")
        print("|-------|---------|---------------|------------|----------------|-------|")
        for mode, seen in faults.items():
            others = {k: n for k, n in seen.items() if k not in ("whole", "cut body", "freezes")}
            which = ", ".join(f"{k}×{n}" for k, n in sorted(others.items())) or "—"
            print(
                f"| {mode:<5} | {seen['freezes']:7} | {seen['whole']:13} | {seen['cut body']:10} "
                f"| {sum(others.values()):14} | {which} |"
            )
    return 0


def summary(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], statistics.mean(values)


if __name__ == "__main__":
    sys.exit(main())
