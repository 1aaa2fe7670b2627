"""`cosyvoice-lb calibrate`: measure one instance's peak GPU memory on this box (NVML) and
keep it as the footprint ``footprint`` plans with. Needs a GPU; starts a one-instance
cluster of its own in a scratch state dir, at the concurrency (and with --load-vllm the
share of the card) the planner gives it, and keeps both with the figure: the planner adds
its per-synthesis figure for more syntheses at once and counts vLLM's reservation apart.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import requests

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.cluster import processes
from cosyvoice_lb.launcher.cluster.layout import Layout, layout_for
from cosyvoice_lb.launcher.cluster.lifecycle import Progress, Report, down, up
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.health.probe import loopback_session
from cosyvoice_lb.launcher.plan.footprint import flags_key, make_plan
from cosyvoice_lb.launcher.render.disk import make_dirs


def calibrate(settings: Settings, on_progress: Report = lambda p: None) -> dict:
    """Measure one instance's peak GPU memory through load, warm-up, as many full-length
    requests at once as it runs syntheses, as many streamed ones, and a default request, and
    store it as the footprint `plan` and `up` use.

    Per process through NVML (the instance and its children: vLLM's engine runs in one);
    where NVML's pids match nothing (containers), the card's used memory above what it
    used before the instance started.
    """
    from cosyvoice_lb.launcher.plan.gpu import device_used, nvml_gpus, process_gpu_memory

    gpus, source = nvml_gpus()
    if not gpus:
        raise ClusterError(
            f"cannot calibrate: no GPU is visible to NVML ({source}). The footprint is measured per process "
            "on a GPU; here plan and up keep the defaults (see 'cosyvoice-lb plan'). Run calibrate on the GPU box"
        )
    layout = layout_for(settings)
    trial = dataclasses.replace(
        settings,
        state_dir=str(layout.root / "calibrate"),
        instances="1",
        force=True,
        gpus="",
        port=settings.port + 1000,
        base_port=settings.base_port + 1000,
    )
    card = gpus[0].index  # a one-instance plan pins it to the first card
    slot = make_plan(trial)[0].slots[0]  # (what `up` plans for it: its concurrency and vLLM share)
    baseline = device_used(card)
    peak = {"process": 0, "device": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                pids = set()
                for proc in psutil.process_iter():
                    if _is_instance(proc, layout_for(trial)):
                        pids |= {proc.pid, *(c.pid for c in proc.children(recursive=True))}
                peak["process"] = max(peak["process"], sum(process_gpu_memory(pids).values()))
                peak["device"] = max(peak["device"], device_used(card) - baseline)
            except Exception as exc:  # keep sampling: one bad read must not end the measurement
                log_line = f"sampling GPU memory failed once: {exc}"
                on_progress(Progress(0, 1, log_line))
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        current = up(trial, on_progress)
        url = current.url + "/v1/tts"
        longest = ("This sentence is repeated to reach the longest text an instance accepts. " * 20)[
            : settings.max_chars
        ]

        def post(body: dict) -> None:
            with loopback_session() as session:
                session.post(url, json=body, timeout=settings.hang_timeout).raise_for_status()

        at_once = slot.concurrency  # (as many as it runs at once: the peak they reach is its footprint)
        for streamed in (False, True):
            said = f"synthesizing {at_once} x {len(longest)} chars at once{', streamed' if streamed else ''}"
            on_progress(Progress(0, 1, said))
            with ThreadPoolExecutor(max_workers=at_once) as pool:
                list(pool.map(post, [{"text": longest, "stream": streamed}] * at_once))
        on_progress(Progress(0, 1, "synthesizing a short text"))
        post({"text": "A short one.", "stream": False})
    except requests.RequestException as exc:
        raise ClusterError(f"calibration request failed: {exc}") from None
    finally:
        stop.set()
        sampler.join(timeout=5)
        down(layout_for(trial))
    measured = peak["process"] or peak["device"]
    if measured <= 0:
        raise ClusterError("the instance ran but NVML saw no GPU memory for it: is it pinned to a GPU?")
    entry = {
        "gpu_bytes": int(measured * 1.1),
        "peak_bytes": measured,
        "gpu": gpus[0].name,
        "how": "per process" if peak["process"] else "card used memory above the baseline",
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "concurrency": slot.concurrency,
        "gpu_total": gpus[0].total,
        **({"vllm_memory": slot.vllm_memory} if slot.vllm_memory else {}),
    }
    try:
        stored = json.loads(layout.footprint_json.read_text())
    except (OSError, ValueError):
        stored = {}
    stored[flags_key(settings)] = entry
    make_dirs(layout)
    write_atomic(layout.footprint_json, json.dumps(stored, indent=2) + "\n")
    return entry


def _is_instance(proc: psutil.Process, layout: Layout) -> bool:
    try:
        return "--starts-file" in proc.cmdline() and processes.is_cluster_program(proc.cmdline(), layout)
    except psutil.Error:
        return False
