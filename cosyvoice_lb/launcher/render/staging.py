"""The instance code staged into the state dir: a whole tree per digest, swapped in atomically.

Instances run in the user's CosyVoice environment, which has no cosyvoice-lb installed:
each imports the copy staged under ``run/lib`` (the instance and common packages, read from
this installed package, and ``app.py`` to run them)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import cosyvoice_lb

_PACKAGE = Path(cosyvoice_lb.__file__).resolve().parent


# What an instance runs: staged into the state dir, so the instance imports its own copy
# from any Python (the user's CosyVoice env has no cosyvoice-lb installed). The instance and
# common packages go whole: they import nothing else (tests/test_layering.py).
INSTANCE_PACKAGES = ("instance", "common")


# The instance's data files beside its code (the speech check's prompt, the Voice agent tab's page).
ASSETS = ("*.wav", "*.html")


def instance_files() -> dict[str, str | bytes]:
    """{path relative to the staging dir: text or bytes} for app.py and the instance's packages."""
    files: dict[str, str | bytes] = {"app.py": (_PACKAGE / "instance" / "__main__.py").read_text(encoding="utf-8")}
    files["cosyvoice_lb/__init__.py"] = (_PACKAGE / "__init__.py").read_text(encoding="utf-8")
    for package in INSTANCE_PACKAGES:
        for path in sorted((_PACKAGE / package).rglob("*.py")):
            files[path.relative_to(_PACKAGE.parent).as_posix()] = path.read_text(encoding="utf-8")
        for pattern in ASSETS:
            for path in sorted((_PACKAGE / package).rglob(pattern)):
                files[path.relative_to(_PACKAGE.parent).as_posix()] = path.read_bytes()
    return files


def _bytes(data: str | bytes) -> bytes:
    return data.encode("utf-8") if isinstance(data, str) else data


# In each staged tree: the digest of its files, which the instance reports in /ping.
CODE_FILE = "CODE"


def code_digest(files: Mapping[str, str | bytes]) -> str:
    """A short digest of the instance code: the same files give the same digest anywhere."""
    h = hashlib.sha256()
    for name in sorted(files):
        data = _bytes(files[name])
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


def staged_digest(lib: Path) -> str:
    """The digest of the tree ``lib`` points at now ("" when nothing is staged there)."""
    try:
        return (lib / CODE_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def stage(lib: Path, files: Mapping[str, str | bytes] | None = None) -> tuple[str, bool]:
    """Stage the instance code at ``lib``: a symlink to ``lib-DIGEST``, a complete tree.

    The tree is written into a scratch dir and renamed into place, then the symlink is
    swapped (``os.replace``): an instance that starts meanwhile sees the old tree or the
    new one, never half of either, and running instances keep theirs (old trees stay until
    :func:`prune`). Returns the digest and whether ``lib`` moved."""
    files = instance_files() if files is None else files
    digest = code_digest(files)
    if staged_digest(lib) == digest and lib.is_symlink():
        return digest, False
    lib.parent.mkdir(parents=True, exist_ok=True)
    target = lib.with_name(f"{lib.name}-{digest}")
    if staged_digest(target) != digest:
        scratch = Path(tempfile.mkdtemp(dir=lib.parent, prefix=f".{lib.name}-"))
        try:
            for name, data in {**files, CODE_FILE: digest + "\n"}.items():
                (scratch / name).parent.mkdir(parents=True, exist_ok=True)
                (scratch / name).write_bytes(_bytes(data))
            os.chmod(scratch, 0o755)
            shutil.rmtree(target, ignore_errors=True)  # (a tree left half-made by a crash: never renamed to)
            os.rename(scratch, target)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    if lib.is_dir() and not lib.is_symlink():  # staged by an older version as a plain dir
        os.rename(lib, lib.with_name(f"{lib.name}-unversioned"))
    link = lib.with_name(f".{lib.name}.{os.getpid()}.link")
    link.unlink(missing_ok=True)
    os.symlink(target.name, link)
    os.replace(link, lib)
    return digest, True


def prune(lib: Path, keep: set[str]) -> list[str]:
    """Remove the staged trees beside ``lib`` whose digest is not in ``keep`` (nor the one
    ``lib`` points at): once no instance runs them. Returns the digests removed."""
    keep = keep | {staged_digest(lib)}
    removed = []
    for tree in lib.parent.glob(f"{lib.name}-*"):
        digest = tree.name[len(lib.name) + 1 :]
        if tree.is_dir() and not tree.is_symlink() and digest not in keep:
            shutil.rmtree(tree, ignore_errors=True)
            removed.append(digest)
    return sorted(removed)
