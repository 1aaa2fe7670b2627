"""Where the templates and app.py are: beside the package in a checkout (or an editable
install), under ``<prefix>/share/cosyvoice-lb`` after a plain ``pip install .``
(setup.cfg installs them there as data files)."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent


def _candidates() -> list[Path]:
    # <prefix>/lib/pythonX.Y/site-packages/cosyvoice_lb -> <prefix>/share/cosyvoice-lb, whatever
    # the prefix (a venv, --user, --prefix); then the interpreter's own data paths.
    parents = Path(__file__).resolve().parents
    prefixes = [parents[i] for i in (3, 4) if i < len(parents)]
    prefixes += [Path(sysconfig.get_path("data")), Path(sys.prefix)]
    return [_CHECKOUT] + [p / "share" / "cosyvoice-lb" for p in prefixes]


def _find(relative: str) -> Path:
    for base in _candidates():
        if (base / relative).exists():
            return base / relative
    searched = ", ".join(str(b) for b in _candidates())
    raise FileNotFoundError(f"cosyvoice-lb cannot find {relative} (looked in {searched}): reinstall it")


def templates_dir() -> Path:
    return _find("templates")


def app_path() -> Path:
    return _find("app.py")


# What an instance runs: staged into the state dir, so the instance imports its own copy
# from any Python (the user's CosyVoice env has no cosyvoice-lb installed).
INSTANCE_MODULES = (
    "__init__.py",
    "server.py",
    "ui.py",
    "pipeline.py",
    "admission.py",
    "routing.py",
    "router.py",
    "board.py",
    "validation.py",
    "auth.py",
    "gate.py",
    "ledger.py",
    "audio.py",
    "problems.py",
    "forms.py",
    "voices.py",
    "fanout.py",
    "streams.py",
    "segments.py",
    "formats.py",
    "openai_api.py",
    "metrics.py",
    "settings.py",
    "planner.py",
    "timeouts.py",
    "engines/__init__.py",
    "engines/espeak.py",
    "engines/cosyvoice.py",
    "engines/simulated.py",
)


def instance_files() -> dict[str, str]:
    """{path relative to the staging dir: text} for app.py and the instance modules."""
    package = Path(__file__).resolve().parent
    files = {"app.py": app_path().read_text(encoding="utf-8")}
    for name in INSTANCE_MODULES:
        files[f"cosyvoice_lb/{name}"] = (package / name).read_text(encoding="utf-8")
    return files
