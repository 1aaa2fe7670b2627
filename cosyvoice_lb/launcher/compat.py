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
    old: str  # what an older cluster names or wrote
    new: str  # what it means now
    until: str  # the last release that keeps the shim
    where: str  # where the old form comes from, or the code that reads it


# Module paths of 0.1, which its supervisord.conf and console script name: each old module is
# a file at its old path that runs (or re-exports) the new one.
MODULES = (
    Shim("cosyvoice_lb.health_loop", "cosyvoice_lb.launcher.health.loop", "0.2", "supervisord.conf's [program:health]"),
    Shim("cosyvoice_lb.health", "cosyvoice_lb.launcher.health.loop", "0.2", "the health loop's module before 0.1"),
    Shim("cosyvoice_lb.admin", "cosyvoice_lb.launcher.panel.server", "0.2", "supervisord.conf's [program:admin]"),
    Shim("cosyvoice_lb.mps", "cosyvoice_lb.launcher.cluster.mps", "0.2", "supervisord.conf's CUDA MPS programs"),
    Shim("cosyvoice_lb.cli", "cosyvoice_lb.launcher.cli", "0.2", "an installed console script, `-m cosyvoice_lb.cli`"),
)

# Files in the state dir as older versions wrote them, still read (each format's current
# version is its module's VERSION; the routing board's is in its magic, CVLBRT01, and a board
# of another format is made again by the health loop).
STATE = (
    Shim("health.json without a version", "version 0: 0.1's fields", "0.2", "state/health_report.parse_report"),
    Shim("cluster.json without a version", "version 0: 0.1's fields", "0.2", "state/record.parse"),
    Shim("cluster.json without roles (pool)", "every slot serves", "0.2", "state/record.parse"),
    Shim("a drain request as a bare action", "that action", "0.2", "state/markers.read_drain"),
    Shim("an instance argv without --argv-version", "format 0: 0.1's flags", "0.2", "common/instance_argv"),
    Shim("--max-upload-mib, --outputs-max-mib", "--max-upload, --outputs-max-size in MiB", "0.2", "instance_argv"),
    Shim("run/lib as a plain directory", "renamed lib-unversioned, a tree staged", "0.2", "render/staging.stage"),
    Shim("a poison mark PRINT.PID.RANDOM", "a first run of its own", "0.2", "instance/speech/poison._parse"),
)

# Every shim, for the docs and for the tests that keep each one working until it goes.
SHIMS = MODULES + STATE


def moved(old: str) -> Shim:
    return next(shim for shim in MODULES if shim.old == old)


def run_moved(old: str) -> None:
    """Run the module ``old`` stands for now, as ``python -m`` would (``sys.argv`` kept)."""
    sys.argv[0] = old
    runpy.run_module(moved(old).new, run_name="__main__", alter_sys=True)
