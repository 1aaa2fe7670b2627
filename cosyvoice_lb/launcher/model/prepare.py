"""`cosyvoice-lb prepare-model`: a model dir that --load-vllm and --load-trt can load from when
the model itself is read-only (a Kubernetes volume mounted read-only, a shared store).

Upstream writes into the model dir at its first load with those flags (the LLM's export for
vLLM in ``vllm/``, the TensorRT engine of the flow decoder beside the ONNX file it comes
from). :func:`prepare` makes ``out`` a model dir whose entries are links to the read-only
dir's, plus those files, written by upstream's own code in the model's Python
(:mod:`cosyvoice_lb.instance.engines.upstream_export`, run by path). So an instance given
``--model-dir out`` finds them and writes nothing.

- **Idempotent**: ``out`` records what it was made from (every file's size and mtime under the
  model dir, the flags); a run that finds it so, with its files whole, does nothing.
- **Atomic**: it is built beside ``out`` under a temp name and renamed into place; a run cut
  short leaves a temp dir the next run removes, never a half ``out``.
- **Refusals** say what to change: a model dir that is missing or is no model, a flag the
  model cannot take, an ``out`` that would overwrite something that is not a prepared dir,
  --load-trt where the model's Python sees no GPU (TensorRT's engine is built for the GPU
  it will run on).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.instance.engines import upstream_export
from cosyvoice_lb.instance.engines.upstream_export import ONNX, VLLM_DIR, generated
from cosyvoice_lb.launcher.errors import ClusterError

RECORD = ".cosyvoice-lb-prepared.json"  # in ``out``: what it was made from
FORMAT = 1


@dataclass(frozen=True)
class Preparation:
    """What to prepare: the read-only ``model_dir``, into ``out``, for these flags, by upstream's
    code (``cosyvoice_root``, "" when ``python`` imports it already) in ``python``."""

    model_dir: Path
    out: Path
    load_vllm: bool = False
    load_trt: bool = False
    fp16: bool = False
    python: str = ""
    cosyvoice_root: str = ""

    @property
    def made(self) -> list[str]:
        """The entries of ``out`` written here, not linked."""
        return generated(self.load_vllm, self.load_trt, self.fp16)


@dataclass(frozen=True)
class Outcome:
    out: Path
    made: tuple[str, ...]
    fresh: bool  # False: ``out`` was up to date, nothing was done
    seconds: float = 0.0


def _version(model_dir: Path) -> int:
    from cosyvoice_lb.instance.engines.cosyvoice import model_version

    try:
        return model_version(model_dir)
    except ValueError as exc:
        raise ClusterError(f"--model-dir: {exc}") from None


def _inside(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


def check(job: Preparation) -> None:
    """Refuse what cannot work, with the fix, before anything is written."""
    if not (job.load_vllm or job.load_trt):
        raise ClusterError("nothing to prepare: give --load-vllm and/or --load-trt, the flags the instances load with")
    if not job.model_dir.is_dir():
        raise ClusterError(
            f"--model-dir {job.model_dir} does not exist or is not a directory: name the model dir to prepare "
            "(on Kubernetes, where the model volume is mounted)"
        )
    version = _version(job.model_dir)
    if job.load_vllm and version == 1:
        raise ClusterError(f"--model-dir {job.model_dir} is a CosyVoice v1 model: --load-vllm is for v2 and v3 models")
    if job.load_trt and not (job.model_dir / ONNX).is_file():
        raise ClusterError(
            f"--load-trt: --model-dir {job.model_dir} has no {ONNX}, which upstream builds the TensorRT engine "
            "from: download the whole model"
        )
    model, out = job.model_dir.resolve(), job.out.absolute()
    if _inside(out, model) or _inside(model, out.resolve()):
        raise ClusterError(f"--out {job.out} is inside the model dir or holds it: give a directory of its own")
    if out.exists() and not (out / RECORD).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise ClusterError(
            f"--out {job.out} exists and is not a dir prepare-model made: give a new path (it would be replaced)"
        )
    if not job.python or not Path(job.python).exists():
        raise ClusterError(f"--python {job.python!r} does not exist: name the Python of the model's environment")


def fingerprint(job: Preparation) -> dict:
    """What ``out`` is made from: the model dir, every file under it (size, mtime) and the flags."""
    model = job.model_dir.resolve()
    files = {}
    for top, dirs, names in os.walk(model, followlinks=True):
        dirs.sort()
        for name in sorted(names):
            path = Path(top) / name
            with contextlib.suppress(OSError):  # (a dangling link: upstream would not read it either)
                found = path.stat()
                files[str(path.relative_to(model))] = [found.st_size, found.st_mtime_ns]
    return {"format": FORMAT, "source": str(model), "files": files, "made": job.made, "fp16": job.fp16}


def whole(out: Path, name: str) -> bool:
    """Whether the made entry ``name`` of ``out`` is complete (an export cut short is not)."""
    path = out / name
    if name == VLLM_DIR:
        return (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    return path.is_file() and path.stat().st_size > 0


def up_to_date(job: Preparation, wanted: dict) -> bool:
    out = job.out
    try:
        record = json.loads((out / RECORD).read_text())
    except (OSError, ValueError):
        return False
    links = [p.name for p in job.model_dir.iterdir() if p.name not in job.made and p.name != RECORD]
    return (
        record == wanted
        and all(whole(out, name) for name in job.made)
        and all(os.path.lexists(out / name) for name in links)
    )


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """One preparation of ``out`` at a time (a second waits, then finds it up to date)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def link_model(job: Preparation, into: Path) -> None:
    """An entry of ``into`` per entry of the model dir, a link to it, but those made here."""
    model = job.model_dir.resolve()
    for entry in sorted(model.iterdir()):
        if entry.name not in job.made and entry.name != RECORD:
            os.symlink(model / entry.name, into / entry.name)


def export(job: Preparation, into: Path, run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> None:
    """Run upstream's export in the model's Python, its log on our stderr; a ClusterError with
    what it said when it fails."""
    flags = [f"--{name.replace('_', '-')}" for name in ("load_vllm", "load_trt", "fp16") if getattr(job, name)]
    args = [job.python, upstream_export.__file__, "--model-dir", str(into), *flags]
    if job.cosyvoice_root:
        args += ["--cosyvoice-root", str(Path(job.cosyvoice_root).absolute())]
    try:  # (from a neutral dir: the current one could shadow a package)
        done = run(args, stdout=subprocess.PIPE, text=True, check=False, cwd=tempfile.gettempdir())
    except OSError as exc:
        raise ClusterError(f"--python {job.python} could not be run ({exc})") from None
    lines = (done.stdout or "").strip().splitlines()
    try:
        said = json.loads(lines[-1]) if lines else {}
    except ValueError:
        said = {}
    if said.get("error"):
        raise ClusterError(f"{said['error']} (nothing was changed)")
    if done.returncode != 0:
        raise ClusterError(
            f"upstream's export failed in --python {job.python} (exit {done.returncode}): its log above says why "
            "(nothing was changed)"
        )
    broken = [name for name in job.made if not whole(into, name)]
    if broken:
        raise ClusterError(f"upstream's export left {', '.join(broken)} incomplete or missing (nothing was changed)")


def swap_in(built: Path, out: Path) -> None:
    """``built`` becomes ``out``: one rename when ``out`` is new; else the old one is moved aside
    first and removed after."""
    if not out.exists():
        os.rename(built, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    os.rename(built, out)
    shutil.rmtree(old, ignore_errors=True)


def prepare(job: Preparation, run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> Outcome:
    """Make ``job.out`` (see the module's doc); an :class:`Outcome` saying whether anything was done."""
    check(job)
    out = job.out.absolute()
    job = Preparation(**{**job.__dict__, "out": out})
    with locked(out):
        wanted = fingerprint(job)
        if up_to_date(job, wanted):
            return Outcome(out, tuple(job.made), fresh=False)
        for leftover in out.parent.glob(f".{out.name}.*-*"):  # what a run cut short left
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
        started = time.monotonic()
        built = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.build-"))
        try:
            link_model(job, built)
            export(job, built, run)
            write_atomic(built / RECORD, json.dumps(wanted, indent=1) + "\n")
            built.chmod(0o755)
            swap_in(built, out)
        except BaseException:
            shutil.rmtree(built, ignore_errors=True)
            raise
    return Outcome(out, tuple(job.made), fresh=True, seconds=time.monotonic() - started)
