"""CUDA MPS, as the plan and the rendered configs need it: whether this box can run it, and
the environment of a GPU's control daemon and of its clients. Pure, and without side effects
on import; the daemon itself runs as ``cluster/mps.py``."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
DRIVER_VERSION = Path("/proc/driver/nvidia/version")


def client_env(pipe_dir: str, log_dir: str, thread_percentage: int = 0) -> dict[str, str]:
    """What every instance on the GPU gets: the daemon's pipe and log dirs, and (above 0)
    the share of the GPU's SMs it may use."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe_dir, "CUDA_MPS_LOG_DIRECTORY": log_dir}
    if thread_percentage > 0:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(thread_percentage)
    return env


def daemon_env(gpu: int, pipe_dir: str, log_dir: str) -> dict[str, str]:
    """What the daemon of ``gpu`` runs with, on top of the inherited environment."""
    return {
        "CUDA_VISIBLE_DEVICES": str(gpu),
        # the GPU index means what nvidia-smi and NVML say (CUDA's default order is fastest first)
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_MPS_PIPE_DIRECTORY": pipe_dir,
        "CUDA_MPS_LOG_DIRECTORY": log_dir,
    }


def nvidia_driver() -> str:
    """The NVIDIA kernel driver's version line, or "" when there is no driver."""
    try:
        with DRIVER_VERSION.open() as file:
            return file.readline().strip()
    except OSError:
        return ""


def mps_problem(
    control: str = CONTROL,
    *,
    which: Callable[[str], str | None] = shutil.which,
    driver: Callable[[], str] = nvidia_driver,
) -> str:
    """An empty string when MPS can work on this box, else what is missing and what to do."""
    line = driver()
    if not line:
        return (
            f"--mps needs the NVIDIA driver: {DRIVER_VERSION} is missing "
            "(no NVIDIA GPU or driver on this box); drop --mps"
        )
    if which(control) is None:
        # the package is named after the driver's major version (nvidia-compute-utils-535)
        found = re.search(r"\s(\d+)\.\d+(?:\.\d+)?\s", f" {line} ")
        version = found.group(1) if found else "<version>"
        return (
            f"--mps needs {control} (part of the NVIDIA driver utilities, e.g. Debian/Ubuntu package "
            f"nvidia-compute-utils-{version}) on PATH; install it or drop --mps"
        )
    return ""
