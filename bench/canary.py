#!/usr/bin/env python3
"""Two model roll-outs on a real cluster, each compared before it is promoted: what
``cosyvoice-lb canary status`` prints for a broken new model and for a good one.

    python bench/canary.py [--seconds 60] [--clients 3]

A cluster of the ``flite`` engine (2 instances, ``--surge 1``, pocketsphinx listening) on
127.0.0.1, ``--clients`` threads sending one common text to ``/v1/audio/speech`` (bounded by
``--seconds`` per phase and 2,000 requests), then:

1. a broken model (the simulated engine: a quiet tone of the right length, which passes the
   audio checks) with ``--mirror 50``: after ``--seconds`` of load the comparison is printed,
   ``promote`` is tried (and refused), then ``abort``;
2. a good model (flite's ``awb`` voice, ``--set openai_voices=alloy=awb``) with ``--share 30``:
   the comparison, then ``promote`` while the load goes on.

Prints each command and its output, and per phase the clients' requests, failures and
answers that were not the expected audio.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

TEXT = "The weather is nice today. Please call me back tomorrow morning."
LIMIT = 2000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    line = [sys.executable, "-m", "cosyvoice_lb.launcher.cli", *args]
    print("$ cosyvoice-lb " + " ".join(args), flush=True)
    done = subprocess.run(line, capture_output=True, text=True, timeout=timeout)
    print((done.stdout + done.stderr).rstrip(), flush=True)
    print(f"(exit {done.returncode})\n", flush=True)
    return done


class Clients:
    """``n`` threads sending the common text until stopped (at most ``LIMIT`` requests)."""

    def __init__(self, url: str, n: int):
        self.url, self.sent, self.failed = url, 0, []
        self.stop, self.lock = threading.Event(), threading.Lock()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(n)]

    def run(self) -> None:
        body = {"model": "tts-1", "input": TEXT, "voice": "alloy", "response_format": "wav"}
        while not self.stop.is_set():
            with self.lock:
                if self.sent >= LIMIT:
                    return
                self.sent += 1
            try:
                r = requests.post(self.url + "/v1/audio/speech", json=body, timeout=60)
                ok = r.status_code == 200 and r.content[:4] == b"RIFF"
                detail = f"{r.status_code} {r.text[:80]}"
            except requests.RequestException as exc:
                ok, detail = False, repr(exc)
            if not ok:
                with self.lock:
                    self.failed.append(detail)

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)
        print(f"clients: {self.sent} requests, {len(self.failed)} failed {self.failed[:3]}\n", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="load per phase before the comparison")
    parser.add_argument("--clients", type=int, default=3)
    args = parser.parse_args()
    if not shutil.which("flite"):
        print("flite is not installed (apt-get install flite)", file=sys.stderr)
        return 2
    state = Path(tempfile.mkdtemp(prefix="cvlb-canary-", dir="/tmp"))
    port, base = free_port(), 19400
    common = ["--state-dir", str(state)]
    try:
        up = cli(
            "up", "--engine", "flite", "--instances", "2", "--surge", "1", "--no-ui", "--host", "127.0.0.1",
            "--port", str(port), "--base-port", str(base), *common,
        )  # fmt: skip
        if up.returncode:
            return 1
        url = f"http://127.0.0.1:{port}"
        cli("canary", "start", "--engine", "simulated", "--mirror", "50", *common)
        with Clients(url, args.clients):
            time.sleep(args.seconds)
        cli("canary", "status", *common)
        cli("canary", "promote", *common)
        cli("canary", "abort", *common)
        cli("canary", "start", "--set", "openai_voices=alloy=awb", "--share", "30", *common)
        with Clients(url, args.clients):
            time.sleep(args.seconds)
            cli("canary", "status", *common)
            cli("canary", "promote", *common)
            time.sleep(2)
        return 0
    finally:
        cli("down", *common)
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
