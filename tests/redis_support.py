"""A redis-server of the tests' own, for the jobs' Redis store (unit and cluster tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import free_port_block


class RedisServer:
    """A redis-server of its own on a free loopback port: in memory, no files kept."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            reason = "redis-server is not installed (apt-get install redis-server; CI installs it)"
            if os.environ.get("CVLB_REQUIRE_BROWSER"):
                pytest.fail(f"{reason} (CVLB_REQUIRE_BROWSER is set: CI needs it)")
            pytest.skip(reason)
        self.port = free_port_block(1)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(workdir), "--daemonize", "no", "--protected-mode", "yes"]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        import redis

        while True:
            try:
                redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1).ping()
                return
            except redis.exceptions.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    out = self.process.stdout.read().decode(errors="replace") if self.process.stdout else ""
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on {self.port}:\n{out[-2000:]}") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self.process.stdout:
            self.process.stdout.close()
