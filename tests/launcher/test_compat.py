"""The shims for clusters an older version started: each one works until its release is past,
and the package's top level holds nothing else."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

import cosyvoice_lb
from cosyvoice_lb.launcher.compat import MODULES, SHIMS, moved

TOP = Path(cosyvoice_lb.__file__).parent


def release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2])


@pytest.mark.filterwarnings("ignore:.*found in sys.modules")  # (this process imported the new ones already)
@pytest.mark.parametrize("shim", MODULES, ids=lambda s: s.old)
def test_an_old_module_path_runs_the_new_module(shim, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [shim.old, "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module(shim.old, run_name="__main__", alter_sys=True)
    assert done.value.code == 0
    help_text = capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", [shim.new, "--help"])
    with pytest.raises(SystemExit):
        runpy.run_module(shim.new, run_name="__main__", alter_sys=True)
    assert capsys.readouterr().out.replace(shim.new, shim.old) == help_text.replace(shim.new, shim.old)


def test_the_old_console_script_entry_still_imports():
    from cosyvoice_lb.cli import main
    from cosyvoice_lb.launcher.cli import main as new_main

    assert main is new_main


def test_the_top_level_holds_only_the_package_and_its_shims():
    top = {p.stem for p in TOP.glob("*.py")} - {"__init__"}
    assert top == {shim.old.removeprefix("cosyvoice_lb.") for shim in MODULES}


def test_no_shim_outlives_its_release():
    assert all(release(shim.until) >= release(cosyvoice_lb.__version__) for shim in SHIMS), (
        "remove the shims whose release is past (launcher/compat.py) and their files"
    )


def test_moved_names_the_shim():
    assert moved("cosyvoice_lb.admin").new == "cosyvoice_lb.launcher.panel.server"
