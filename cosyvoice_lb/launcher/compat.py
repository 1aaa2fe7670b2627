"""What is kept for clusters an older version started, and the release after which it goes.

A running cluster outlives an upgrade of the launcher (``git pull``, ``pip install -U``): its
supervisord.conf still names the module paths it was rendered with, until ``up`` or
``restart`` renders it again, and its state files keep the format they were written in. Each
shim below is listed with the last release that keeps it; the release after removes it
(and the tests that hold it).
"""

from __future__ import annotations

import runpy
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Shim:
    old: str  # what an older cluster names
    new: str  # what it means now
    until: str  # the last release that keeps the shim
    why: str


# Module paths of 0.1, which its supervisord.conf and console script name: each old module is
# a file at its old path that runs (or re-exports) the new one.
MODULES = (
    Shim("cosyvoice_lb.health_loop", "cosyvoice_lb.launcher.health.loop", "0.2", "supervisord.conf's [program:health]"),
    Shim("cosyvoice_lb.health", "cosyvoice_lb.launcher.health.loop", "0.2", "the health loop's module before 0.1"),
    Shim("cosyvoice_lb.admin", "cosyvoice_lb.launcher.panel.server", "0.2", "supervisord.conf's [program:admin]"),
    Shim("cosyvoice_lb.mps", "cosyvoice_lb.launcher.cluster.mps", "0.2", "supervisord.conf's CUDA MPS programs"),
    Shim("cosyvoice_lb.cli", "cosyvoice_lb.launcher.cli", "0.2", "an installed console script, `-m cosyvoice_lb.cli`"),
)

# Every shim, for the docs and for the tests that keep each one working until it goes.
SHIMS = MODULES


def moved(old: str) -> Shim:
    return next(shim for shim in MODULES if shim.old == old)


def run_moved(old: str) -> None:
    """Run the module ``old`` stands for now, as ``python -m`` would (``sys.argv`` kept)."""
    sys.argv[0] = old
    runpy.run_module(moved(old).new, run_name="__main__", alter_sys=True)
