"""`cosyvoice-lb calibrate`: measure one instance of this box's engine and keep what the
planner plans with (``footprint.json``, keyed by engine and flags):

- **the knee**: a one-instance cluster of its own (a scratch state dir) runs 1, 2, 4, ...
  syntheses at once, a few rounds each, and the fewest at once that reach nine tenths of the
  best throughput become what ``--instance-concurrency auto`` stands for (``knee``);
- **memory per synthesis more**: the instance's peak at each level (GPU memory per process
  through NVML on a GPU box, the RSS of the instance and its children, vLLM's engine
  included, on a CPU box), its growth per synthesis;
- on a GPU box, as before, **the footprint**: the peak through load, warm-up, and as many
  full-length requests at once as it runs (streamed and not), at the concurrency and vLLM
  share the planner gives it, so the planner adds its per-synthesis figure for more and
  counts vLLM's reservation apart.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import psutil
import requests

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.cluster.disk import make_dirs
from cosyvoice_lb.launcher.cluster.lifecycle import Progress, Report, down, up
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.health.probe import loopback_session
from cosyvoice_lb.launcher.plan.footprint import flags_key, make_plan
from cosyvoice_lb.launcher.plan.knee import Point, levels, per_synthesis, sweep_entry
from cosyvoice_lb.launcher.state import processes
from cosyvoice_lb.launcher.state.layout import Layout, layout_for

# What every synthesis of the sweep says: a sentence of the length of a chat answer.
SWEEP_TEXT = "The calibration sentence is spoken by every synthesis at once, so that the box's throughput is measured."
MOST = 8  # the most syntheses at once the sweep measures, unless told
ROUNDS = 3


class Peaks:
    """The instance's peak memory, sampled every 0.2 s from a thread, from one ``reset`` to
    the next read; ``read()`` is the memory of the instance's processes now (bytes)."""

    def __init__(self, read: Callable[[], int], on_error: Callable[[str], None]):
        self.read, self.on_error = read, on_error
        self.peak = self.whole = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self) -> None:
        while not self.stop.is_set():
            self.once()
            self.stop.wait(0.2)

    def once(self) -> None:
        """One reading now (also at the end of a pass quicker than the thread's period)."""
        try:
            now = self.read()
            self.peak, self.whole = max(self.peak, now), max(self.whole, now)
        except Exception as exc:  # keep sampling: one bad read must not end the measurement
            self.on_error(f"sampling memory failed once: {exc}")

    def reset(self) -> None:
        self.peak = 0


def calibrate(settings: Settings, on_progress: Report = lambda p: None, most: int = MOST, rounds: int = ROUNDS) -> dict:
    """Run the sweep (and on a GPU box the footprint's measurement) and store what it found
    as the calibration `plan` and `up` use for this engine and these flags."""
    from cosyvoice_lb.launcher.plan.gpu import device_used, nvml_gpus, process_gpu_memory

    gpus, _source = nvml_gpus()
    layout = layout_for(settings)
    trial = dataclasses.replace(
        settings,
        state_dir=str(layout.root / "calibrate"),
        instances="1",
        force=True,
        gpus="",
        port=settings.port + 1000,
        base_port=settings.base_port + 1000,
        instance_concurrency=str(max(1, most)),
    )
    slot = make_plan(trial)[0].slots[0]  # (what `up` plans for it: its concurrency and vLLM share)
    trial_layout = layout_for(trial)
    card = gpus[0].index if gpus else 0  # a one-instance plan pins it to the first card
    baseline = device_used(card) if gpus else 0
    by_process = {"seen": False}

    def memory() -> int:
        pids = instance_pids(trial_layout)
        if not gpus:
            return sum(_rss(pid) for pid in pids)
        used = sum(process_gpu_memory(pids).values())
        by_process["seen"] = by_process["seen"] or used > 0
        return used or device_used(card) - baseline

    peaks = Peaks(memory, lambda line: on_progress(Progress(0, 1, line)))
    peaks.thread.start()
    try:
        current = up(trial, on_progress)
        points = sweep(current.url + "/v1/tts", levels(slot.concurrency), rounds, settings, peaks, on_progress)
        held = footprint_pass(current.url + "/v1/tts", slot.concurrency, settings, peaks, on_progress)
    except requests.RequestException as exc:
        raise ClusterError(f"calibration request failed: {exc}") from None
    finally:
        peaks.stop.set()
        peaks.thread.join(timeout=5)
        down(trial_layout)
    when = time.strftime("%Y-%m-%d %H:%M")
    entry = {**sweep_entry(points, "gpu" if gpus else "cpu", when), "per_synthesis_bytes": per_synthesis(held)}
    if gpus:
        if peaks.whole <= 0:
            raise ClusterError("the instance ran but NVML saw no GPU memory for it: is it pinned to a GPU?")
        entry.update(
            gpu_bytes=int(peaks.whole * 1.1),
            peak_bytes=peaks.whole,
            gpu=gpus[0].name,
            how="per process" if by_process["seen"] else "card used memory above the baseline",
            concurrency=slot.concurrency,
            gpu_total=gpus[0].total,
            **({"vllm_memory": slot.vllm_memory} if slot.vllm_memory else {}),
        )
    else:  # (the longest text alone: what one instance holds in host RAM)
        entry.update(host_bytes=int(held[0].peak_bytes * 1.1), host_peak_bytes=held[0].peak_bytes)
    try:
        stored = json.loads(layout.footprint_json.read_text())
    except (OSError, ValueError):
        stored = {}
    stored[flags_key(settings)] = entry
    make_dirs(layout)
    write_atomic(layout.footprint_json, json.dumps(stored, indent=2) + "\n")
    return entry


def sweep(
    url: str, at_once: list[int], rounds: int, settings: Settings, peaks: Peaks, on_progress: Report
) -> list[Point]:
    """``rounds`` rounds of each number of syntheses at once; the audio each level made, the
    time it took, and the memory it peaked at."""
    points = []
    for index, level in enumerate(at_once):
        on_progress(Progress(index, len(at_once), f"{level} synthes{'is' if level == 1 else 'es'} at once x {rounds}"))
        peaks.reset()
        audio, started = 0.0, time.monotonic()
        with ThreadPoolExecutor(max_workers=level) as pool:
            for _ in range(rounds):
                audio += sum(pool.map(lambda _i: spoken(url, settings), range(level)))
        wall = time.monotonic() - started
        peaks.once()
        points.append(Point(level, audio, wall, peaks.peak))
    return points


def spoken(url: str, settings: Settings, text: str = SWEEP_TEXT, stream: bool = False) -> float:
    """One synthesis through the trial cluster: the seconds of audio it made."""
    with loopback_session() as session:
        r = session.post(url, json={"text": text, "stream": stream}, timeout=settings.hang_timeout)
        r.raise_for_status()
        return float(r.headers.get("X-Audio-Seconds", 0.0))


def footprint_pass(url: str, at_once: int, settings: Settings, peaks: Peaks, on_progress: Report) -> list[Point]:
    """The longest text an instance accepts alone, then as many at once as it runs, streamed
    and not, then a short one: the peak they reach is its footprint; the peaks alone and at
    ``at_once`` (as two points) what each synthesis more holds."""
    longest = ("This sentence is repeated to reach the longest text an instance accepts. " * 20)[: settings.max_chars]
    held = []
    for count in sorted({1, at_once}):
        peaks.reset()
        for streamed in (False, True):
            said = f"synthesizing {count} x {len(longest)} chars at once{', streamed' if streamed else ''}"
            on_progress(Progress(0, 1, said))
            with ThreadPoolExecutor(max_workers=count) as pool:
                list(pool.map(lambda _i: spoken(url, settings, longest, streamed), range(count)))
        peaks.once()
        held.append(Point(count, 0.0, 0.0, peaks.peak))
    spoken(url, settings, "A short one.")
    return held


def instance_pids(layout: Layout) -> set[int]:
    """The trial instance's processes and their children (vLLM's engine runs in one)."""
    pids: set[int] = set()
    for proc in psutil.process_iter():
        try:
            if "--starts-file" in proc.cmdline() and processes.is_cluster_program(proc.cmdline(), layout):
                pids |= {proc.pid, *(c.pid for c in proc.children(recursive=True))}
        except psutil.Error:
            pass
    return pids


def _rss(pid: int) -> int:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0
