"""Shared helpers: the real CLI as a subprocess, free loopback ports, short state dirs."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any COSYVOICE_LB_* the caller may have set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE_LB_")}
    env.update(extra)
    return env


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 180,
        check: bool = False) -> subprocess.CompletedProcess:
    """Run ``cosyvoice-lb ARGS`` for real and capture what it prints."""
    done = subprocess.run([sys.executable, "-m", "cosyvoice_lb.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env if env is not None else clean_env(), cwd=str(ROOT))
    if check and done.returncode != 0:
        raise AssertionError(f"cosyvoice-lb {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port_block(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - count)
        if all(port_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no block of free ports found")


@pytest.fixture
def state_dir():
    # Short on purpose: the supervisord socket path must stay under 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)

