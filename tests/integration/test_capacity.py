"""Capacity that never dips, on a real cluster (supervisord, nginx, instances of the
simulated engine with a load time): a surge roll-out keeps the rotation at its size while
every instance is replaced, a warm spare takes a killed instance's place before that one
has loaded again, elastic instances follow the load, and a surge without memory says so.

The rotation is sampled from upstreams.conf, the file nginx reads, every 20 ms.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

from conftest import Load, cli, free_port_block, status, wait_for

LOAD_SECONDS = "6"  # each instance's simulated model load


def in_rotation(state_dir: Path) -> list[str]:
    api = (state_dir / "nginx" / "upstreams.conf").read_text().split("upstream cvlb_ui")[0]
    return [name for mark, name in re.findall(r"max_fails=0( down)?;\s+# (\S+)", api) if not mark]


class Sampler:
    """The rotation's size every 20 ms while it runs (bounded: at most 10 minutes)."""

    def __init__(self, state_dir: Path):
        self.state_dir, self.sizes, self.stop = state_dir, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        deadline = time.monotonic() + 600
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                self.sizes.append(len(in_rotation(self.state_dir)))
            except (OSError, IndexError):  # (rewritten atomically: never half a file, but be safe)
                pass
            time.sleep(0.02)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)


def up(state_dir: Path, port: int, base: int, *extra: str) -> None:
    cli(
        "up",
        "--engine",
        "simulated",
        "--simulated-ms-per-char",
        "2",
        "--simulated-load-seconds",
        LOAD_SECONDS,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        "--probe-interval",
        "0.5",
        *extra,
        timeout=300,
        check=True,
    )


def pool(state_dir: Path) -> tuple[dict, dict]:
    code, current = status(state_dir)
    return current["pool"], {i["name"]: i for i in current["instances"]}


def test_surge_roll_outs_keep_the_rotation_full_and_a_spare_covers_a_crash(state_dir):
    port, base = free_port_block(1), free_port_block(4)
    url = f"http://127.0.0.1:{port}"
    up(state_dir, port, base, "--instances", "2", "--spares", "1", "--surge", "1")
    try:
        code, current = status(state_dir)
        assert code == 0, current["problems"]  # a spare and a parked slot are no problems
        summary, instances = pool(state_dir)
        assert (summary["in_rotation"], summary["spares"], summary["parked"]) == (2, 1, 1)
        assert [n for n, i in instances.items() if i["parked"]] == ["instance-3"]
        before = {n: i["pid"] for n, i in instances.items() if i["pid"]}

        # 1. restart --all with a surge: the rotation never holds fewer than 2, no request fails
        with Sampler(state_dir) as sampler, Load(url, threads=2, seconds=240) as load:
            time.sleep(1)
            done = cli("restart", "--all", "--state-dir", str(state_dir), timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.count("replaced instance-") == 3, done.stdout
        assert min(sampler.sizes) >= 2, sampler.sizes
        assert max(sampler.sizes) == 3  # the replacement served beside the old ones
        assert load.failures == [] and load.ok > 0
        summary, instances = pool(state_dir)
        assert (summary["in_rotation"], summary["spares"], summary["parked"], summary["surge"]) == (2, 1, 1, 0)
        running = {n: i["pid"] for n, i in instances.items() if i["pid"]}
        assert set(running.values()).isdisjoint(before.values())  # every process is new
        assert not (state_dir / "run" / "rollout.json").exists()

        # 2. a crash: the spare takes the killed instance's place while that one loads again
        victim = sorted(n for n, i in instances.items() if i["in_rotation"])[0]
        spare = next(n for n, i in instances.items() if i["spare"])
        with Sampler(state_dir) as sampler:
            os.kill(instances[victim]["pid"], signal.SIGKILL)
            covered = wait_for(
                lambda: spare in in_rotation(state_dir) and victim not in in_rotation(state_dir), 10, interval=0.05
            )
            assert covered
            _, now = pool(state_dir)
            assert not now[victim]["ready"]  # still loading: the spare did not wait for it
        assert len(in_rotation(state_dir)) == 2
        back = wait_for(lambda: pool(state_dir)[1][victim]["spare"], 60, interval=0.5)
        assert back  # loaded again: it is the spare now

        # 3. new settings through `up`: the same surge roll-out
        with Sampler(state_dir) as sampler:
            up(state_dir, port, base, "--instances", "2", "--spares", "1", "--surge", "1", "--max-chars", "400")
        assert min(sampler.sizes) >= 2, sampler.sizes
        summary, instances = pool(state_dir)
        assert (summary["in_rotation"], summary["spares"], summary["parked"]) == (2, 1, 1)
        health = (state_dir / "logs" / "health.log").read_text()
        assert "restart requested: out of rotation, replaced by the launcher once idle" in health
    finally:
        cli("down", "--state-dir", str(state_dir), timeout=120)


def test_elastic_instances_follow_the_load_and_free_their_slot(state_dir):
    port, base = free_port_block(1), free_port_block(2)
    url = f"http://127.0.0.1:{port}"
    cli(
        "up",
        "--engine",
        "simulated",
        "--simulated-ms-per-char",
        "30",
        "--simulated-load-seconds",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        "--probe-interval",
        "0.5",
        "--instances",
        "2",
        "--min-instances",
        "1",
        "--scale-up-after",
        "2",
        "--idle-release",
        "4",
        timeout=300,
        check=True,
    )
    try:
        summary, instances = pool(state_dir)
        assert summary["elastic"] == {"min": 1, "max": 2} and summary["wanted"] == 1
        assert instances["instance-1"]["parked"]
        # three clients on one instance: one synthesis, a queue behind it
        with Load(url, threads=3, seconds=60, limit=60, text="x" * 100) as load:
            grown = wait_for(lambda: len(in_rotation(state_dir)) == 2, 40, interval=0.25)
        assert grown, (state_dir / "logs" / "health.log").read_text()[-2000:]
        assert load.failures == []
        shrunk = wait_for(lambda: pool(state_dir)[1]["instance-1"]["parked"], 40, interval=0.5)
        assert shrunk
        summary, _ = pool(state_dir)
        reasons = [d["reason"] for d in summary["decisions"]]
        assert reasons[0].startswith("scale out: all 1 instance(s) in rotation had a queue"), reasons
        assert reasons[-1].startswith("scale in: no request for"), reasons
        text = cli("status", "--state-dir", str(state_dir)).stdout
        assert "pool: 1 in rotation of 1 wanted (elastic 1..2)" in text and "scale in: no request" in text
    finally:
        cli("down", "--state-dir", str(state_dir), timeout=120)


def test_a_surge_without_memory_says_so_and_drains_first(state_dir):
    port, base = free_port_block(1), free_port_block(3)
    # one 12 GiB card, 5 GiB per instance: room for 2 and no parked slot
    cli(
        "up",
        "--engine",
        "espeak",
        "--gpus",
        "12GiB",
        "--instances",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        timeout=300,
        check=True,
    )
    try:
        done = cli("restart", "--all", "--surge", "1", "--state-dir", str(state_dir), timeout=300)
        assert done.returncode == 0, done.stderr
        assert "--surge 1: no parked slot has memory for a replacement now; restarted draining first" in done.stdout
        assert "restarted instance-0" in done.stdout and "restarted instance-1" in done.stdout
    finally:
        cli("down", "--state-dir", str(state_dir), timeout=120)
