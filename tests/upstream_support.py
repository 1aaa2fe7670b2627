"""Upstream CosyVoice's own code in the tests: the checkout, a Python that runs it, a small
CosyVoice3 model dir made for it (tests/upstream/).

``CVLB_UPSTREAM`` names the checkout (cosyvoice/ and third_party/Matcha-TTS, as upstream lays
them out); without it the tests marked ``upstream`` skip and say so. The Python is
``CVLB_UPSTREAM_PYTHON`` when given (a CosyVoice environment of your own), otherwise a venv
built from tests/upstream/requirements.txt: once, under the cache dir (``CVLB_UPSTREAM_CACHE``,
by default $XDG_CACHE_HOME or ~/.cache, then cosyvoice-lb/upstream), keyed by that file, and
reused by every later run (an older one is removed); never the launcher's venv. The model dir is built by tests/upstream/build_model.py with that
Python and kept under the same cache, keyed by the builder, its config, the Python and the
checkout's code.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "upstream"
REQUIREMENTS = HERE / "requirements.txt"
CHECKOUT_VAR, PYTHON_VAR, CACHE_VAR = "CVLB_UPSTREAM", "CVLB_UPSTREAM_PYTHON", "CVLB_UPSTREAM_CACHE"
SKIP_REASON = (
    f"upstream CosyVoice's code is not given: set {CHECKOUT_VAR} to a checkout of FunAudioLLM/CosyVoice "
    f"(with third_party/Matcha-TTS), e.g. {CHECKOUT_VAR}=~/CosyVoice ./run.sh test -m upstream"
)
INSTALL_SECONDS = 1800


@dataclass(frozen=True)
class Upstream:
    root: Path  # the checkout
    python: Path  # runs upstream's code (and the instances)
    model_dir: Path  # a small CosyVoice3 model dir for it


def checkout() -> Path | None:
    """The checkout named by CVLB_UPSTREAM; None when unset. A wrong path is an error, not a skip."""
    named = os.environ.get(CHECKOUT_VAR, "").strip()
    if not named:
        return None
    root = Path(named).expanduser().resolve()
    lacking = [p for p in ("cosyvoice/cli/cosyvoice.py", "third_party/Matcha-TTS/matcha") if not (root / p).exists()]
    if lacking:
        raise pytest.UsageError(
            f"{CHECKOUT_VAR}={named} lacks {', '.join(lacking)}: name an upstream CosyVoice "
            "checkout with its submodules (git submodule update --init --recursive)"
        )
    return root


def cache_dir() -> Path:
    named = os.environ.get(CACHE_VAR, "").strip()
    base = Path(named) if named else Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "cosyvoice-lb" / "upstream"
    path = base.expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def digest(*parts: bytes | Path) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.read_bytes() if isinstance(part, Path) else part)
        h.update(b"\0")
    return h.hexdigest()[:12]


def code_of(root: Path) -> list[Path]:
    """The checkout's Python sources: what the weights' shapes follow from."""
    return sorted(
        [*(root / "cosyvoice").rglob("*.py"), *(root / "third_party" / "Matcha-TTS" / "matcha").rglob("*.py")]
    )


@contextmanager
def locked(path: Path, wait: bool = True) -> Iterator[bool]:
    """One builder at a time (two test runs at once wait for each other). ``wait=False``:
    yields False at once when another holds it."""
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_logged(args: list[str], log: Path, timeout: float, what: str) -> None:
    with open(log, "a") as out:
        done = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    if done.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{what} failed (exit {done.returncode}); the end of {log}:\n{tail}")


def environment(cache: Path) -> Path:
    """A venv with upstream's runtime dependencies (tests/upstream/requirements.txt): built
    once, marked complete only at the end, so an interrupted build is redone, never used."""
    key = digest(REQUIREMENTS, sys.version.encode())
    env = cache / f"env-{key}"
    python = env / "bin" / "python"
    with locked(cache / f"env-{key}.lock"):
        if (env / ".complete").is_file():
            return python
        shutil.rmtree(env, ignore_errors=True)
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300)
        log = env / "install.log"
        run_logged(
            [str(python), "-m", "pip", "install", "--no-input", "-r", str(REQUIREMENTS)],
            log,
            INSTALL_SECONDS,
            f"installing upstream CosyVoice's dependencies into {env}",
        )
        (env / ".complete").write_text(f"built in {time.monotonic() - started:.0f} s\n")
        print(f"\nbuilt the upstream environment {env} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    retire(cache, "env-", env)
    return python


def retire(cache: Path, prefix: str, current: Path) -> None:
    """Remove what earlier requirements or code left (several GB each): one of each kind is
    kept. A dir another run is building (its lock held) is left alone."""
    for old in cache.glob(f"{prefix}*"):
        if old == current or not old.is_dir():
            continue
        with locked(cache / f"{old.name}.lock", wait=False) as held:
            if held:
                shutil.rmtree(old, ignore_errors=True)
                for leftover in cache.glob(f"{old.name}.*"):
                    leftover.unlink(missing_ok=True)


def small_model(root: Path, python: Path, cache: Path) -> Path:
    """The small CosyVoice3 model dir for this checkout and Python (built in seconds, then kept)."""
    builder, config = HERE / "build_model.py", HERE / "cosyvoice3.yaml"
    key = digest(builder, config, str(python).encode(), *code_of(root))
    model = cache / f"model-{key}"
    with locked(cache / f"model-{key}.lock"):
        if not (model / "llm.pt").is_file():
            for partial in cache.glob(f".model-{key}.*"):  # what a killed build left
                shutil.rmtree(partial, ignore_errors=True)
            log = cache / f"model-{key}.log"
            log.unlink(missing_ok=True)
            run_logged(
                [str(python), str(builder), "--cosyvoice-root", str(root), "--out", str(model)],
                log,
                600,
                "building the small CosyVoice3 model",
            )
    retire(cache, "model-", model)
    return model


@pytest.fixture(scope="session")
def upstream() -> Upstream:
    """Upstream's checkout, a Python for it and a small model dir; skips when no checkout is named."""
    root = checkout()
    if root is None:
        pytest.skip(SKIP_REASON)
    cache = cache_dir()
    named = os.environ.get(PYTHON_VAR, "").strip()
    python = Path(named).expanduser() if named else environment(cache)
    return Upstream(root=root, python=python, model_dir=small_model(root, python, cache))
