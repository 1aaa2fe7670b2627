"""A real docker engine in the tests: the base image made from Debian's packages, the build
context as a tar stream, and a build of the Dockerfile on them.

No image registry is reachable from the machines the tests run on, so the base image is
made here: ``debootstrap --variant=minbase bookworm`` into a temp dir, then ``docker
import``. Its tarball is kept under the cache dir ($XDG_CACHE_HOME or ~/.cache, then
cosyvoice-lb/docker/) so a later run only imports it. Builds and containers use the host's
network (``--network host``): no bridge network. The package index is reached through a
proxy whose CA only the host trusts, so the build gets the host's CA bundle as
``CA_BUNDLE`` (a file of the build context, which the build stage alone sees).

Without a docker engine (or, for the base image, without debootstrap and root) the tests
that need one skip and say why; with ``CVLB_REQUIRE_BROWSER`` set (CI) they fail instead.
"""

from __future__ import annotations

import fcntl
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE_IMAGE = "cvlb-base:bookworm"
BASE_TARBALL = "debian-bookworm-minbase.tar"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
# Appended to the CA bundle the build gets, so a test can tell whether the bundle reached the
# image. Fixed, so the build's layer cache holds from one run to the next.
CA_MARKER = b"# cosyvoice-lb build CA marker: never in the image"
# What the image builds from (the Dockerfile copies nothing else).
CONTEXT = ("Dockerfile", "setup.cfg", "pyproject.toml", "README.md", "app.py", "cosyvoice_lb", "templates", "docker")
BUILD_SECONDS = 1500


def unavailable(reason: str) -> None:
    if os.environ.get("CVLB_REQUIRE_BROWSER"):
        pytest.fail(f"{reason} (CVLB_REQUIRE_BROWSER is set: CI needs it)")
    pytest.skip(reason)


def docker(*args: str, timeout: float = 120, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(["docker", *args], capture_output=True, timeout=timeout, check=False, **kwargs)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args[:3])} ... exited {done.returncode}:\n{tail(done)}")
    return done


def tail(done: subprocess.CompletedProcess, lines: int = 40) -> str:
    out = done.stdout if isinstance(done.stdout, str) else (done.stdout or b"").decode(errors="replace")
    err = done.stderr if isinstance(done.stderr, str) else (done.stderr or b"").decode(errors="replace")
    return "\n".join((out + err).splitlines()[-lines:])


def require_engine() -> None:
    if shutil.which("docker") is None:
        unavailable("docker is not installed (.ci/run installs docker.io and starts dockerd)")
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0:
        unavailable("no docker engine answers (start dockerd)")


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "cosyvoice-lb" / "docker"


def base_image() -> str:
    """BASE_IMAGE in the engine: there already, imported from the cached tarball, or made.
    One process at a time (a lock in the cache dir): CI makes it ahead, in the background
    (``python tests/docker_support.py``), and a test that needs it meanwhile waits."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / "base.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if docker("image", "inspect", BASE_IMAGE, check=False).returncode == 0:
            return BASE_IMAGE
        tarball = cache_dir() / BASE_TARBALL
        if not tarball.is_file():
            make_base_tarball(tarball)
        with open(tarball, "rb") as stream:
            docker("import", "-", BASE_IMAGE, stdin=stream, timeout=600)
    return BASE_IMAGE


def make_base_tarball(tarball: Path) -> None:
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        unavailable("making the base image needs root and debootstrap (apt-get install debootstrap)")
    tarball.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cvlb-rootfs-") as rootfs:
        done = subprocess.run(
            ["debootstrap", "--variant=minbase", "bookworm", rootfs, DEBIAN_MIRROR],
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(f"debootstrap exited {done.returncode}:\n{tail(done)}")
        partial = tarball.with_suffix(".partial")
        subprocess.run(["tar", "-C", rootfs, "-cf", str(partial), "."], check=True, timeout=600)
        partial.replace(tarball)  # whole or not at all


def context_tar(extra: dict[str, Path | bytes]) -> bytes:
    """The build context as a tar: CONTEXT from the checkout (no __pycache__), plus ``extra``
    ({path in the context: a file or folder to copy, or the bytes of a file})."""
    buffer = io.BytesIO()

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if "__pycache__" in info.name.split("/") else info

    # (GNU format: the engine's legacy builder misreads the PAX headers Python writes by default)
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name in CONTEXT:
            tar.add(ROOT / name, arcname=name, filter=keep)
        for name, what in extra.items():
            if isinstance(what, bytes):
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(what), 0o644
                tar.addfile(info, io.BytesIO(what))
            else:
                tar.add(what, arcname=name, filter=keep)
    return buffer.getvalue()


def build(tag: str, build_args: dict[str, str], extra: dict[str, Path | bytes]) -> subprocess.CompletedProcess:
    """``docker build --network host`` of the Dockerfile on BASE_IMAGE with the host's CA bundle."""
    ca = HOST_CA.read_bytes() + b"\n" + CA_MARKER + b"\n"
    args = {"BASE": base_image(), "CA_BUNDLE": "docker/ca-bundle.crt", **build_args}
    context = context_tar({"docker/ca-bundle.crt": ca, **extra})
    flags = [f"--build-arg={k}={v}" for k, v in args.items()]
    return docker("build", "--network", "host", *flags, "-t", tag, "-", input=context, timeout=BUILD_SECONDS)


def image_size(tag: str) -> int:
    return int(docker("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())


if __name__ == "__main__":  # .ci/run: the base image made while the linters run
    print(f"{base_image()} is ready")
