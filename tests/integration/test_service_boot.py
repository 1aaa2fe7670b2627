"""The boot unit under a real systemd: systemd as PID 1 in a container of the embedded
engine's image, `service install` run there, the container restarted as a reboot, the
cluster serving again by itself, as the unit's user; `systemctl stop` drains it and leaves
no process; `service uninstall` removes it."""

from __future__ import annotations

import io
import os
import tarfile
import time

import pytest
import requests
from conftest import free_port_block, wait_for
from docker_support import build, docker, require_engine

pytestmark = [pytest.mark.integration, pytest.mark.docker]

TAG = "cosyvoice-lb-test:embedded"  # (the image test_image.py builds: its layers are cached)
BOOT_TAG = "cosyvoice-lb-test:systemd"
# The image's run stage plus systemd as its init; Debian's nginx starts its own server at
# boot (port 80, on the host's network here): masked.
BOOT_DOCKERFILE = f"""FROM {TAG}
USER root
RUN apt-get update && apt-get install -y --no-install-recommends systemd systemd-sysv \\
    && rm -rf /var/lib/apt/lists/* && ln -sf /dev/null /etc/systemd/system/nginx.service
STOPSIGNAL SIGRTMIN+3
CMD ["/lib/systemd/systemd"]
"""
STATE = "/srv/my tts"
LAUNCHER = "/opt/cosyvoice-lb/bin/cosyvoice-lb"


@pytest.fixture(scope="module")
def boot_image():
    require_engine()
    build(TAG, {}, {})
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        data = BOOT_DOCKERFILE.encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    docker("build", "--network", "host", "-t", BOOT_TAG, "-", input=context.getvalue(), timeout=900)
    return BOOT_TAG


def inside(name: str, *command: str, check: bool = True, timeout: float = 300) -> str:
    done = docker("exec", name, *command, check=check, timeout=timeout)
    return done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")


def processes(name: str) -> list[str]:
    """Every process in the container: its user id and command line."""
    listing = inside(
        name,
        "sh",
        "-c",
        'for p in /proc/[0-9]*; do [ -r "$p/cmdline" ] && '
        'echo "$(stat -c %u "$p") $(tr "\\0" " " < "$p/cmdline")"; done',
    )
    return [line for line in listing.splitlines() if line.strip()]


@pytest.fixture
def booted(boot_image):
    name = f"cvlb-boot-{os.getpid()}"
    docker(
        "run",
        "-d",
        "--name",
        name,
        "--network",
        "host",
        "-e",
        "container=docker",
        "--tmpfs",
        "/run",
        "--tmpfs",
        "/run/lock",
        "-v",
        "/sys/fs/cgroup:/sys/fs/cgroup:ro",
        boot_image,
    )
    try:
        assert wait_for(lambda: system_up(name), timeout=60), inside(name, "systemctl", "--failed", check=False)
        yield name
    finally:
        docker("rm", "-f", name, check=False)


def system_up(name: str) -> bool:
    return inside(name, "systemctl", "is-system-running", check=False).strip() in ("running", "degraded")


def serving(url: str, session: requests.Session) -> bool:
    try:
        return session.get(url + "/ping", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def test_the_unit_brings_the_cluster_back_after_a_reboot_and_stops_it_drained(booted):
    port = free_port_block(4)
    url = f"http://127.0.0.1:{port}"
    session = requests.Session()
    session.trust_env = False
    flags = ["--host", "127.0.0.1", "--port", str(port), "--base-port", str(port + 1), "--instances", "2"]
    install = ["env", "COSYVOICE_LB_PUBLIC=0", LAUNCHER, "service", "install"]  # (the image sets it: a pod's)
    said = inside(booted, *install, "--state-dir", STATE, "--run-as", "cvlb", *flags)
    assert "enabled: it starts at boot" in said, said
    assert inside(booted, "stat", "-c", "%a %U", f"{STATE}/cosyvoice-lb.env").split() == ["600", "root"]
    assert not serving(url, session)  # enabled, not started

    started = time.monotonic()
    docker("restart", "-t", "150", booted, timeout=200)  # a reboot: systemd starts what is enabled
    assert wait_for(lambda: serving(url, session), timeout=300), inside(
        booted, "journalctl", "-u", "cosyvoice-lb", "--no-pager", check=False
    )[-3000:]
    print(f"\nafter the reboot the cluster served /ping 200 in {time.monotonic() - started:.1f} s")
    spoken = session.post(url + "/v1/tts", json={"text": "Back after a reboot."}, timeout=60)  # (loopback: no token)
    assert spoken.status_code == 200 and spoken.content[:4] == b"RIFF"
    cluster = [line for line in processes(booted) if STATE in line]
    assert cluster and all(line.split()[0] != "0" for line in cluster)  # all as cvlb, none as root

    status = inside(booted, LAUNCHER, "service", "status")
    assert "enabled: enabled" in status and "active: active" in status

    # (by the unit's SyslogIdentifier: a line the launcher writes as it exits may reach
    # journald once its cgroup is gone, without the unit's name that `-u` matches)
    def journal() -> str:
        return inside(booted, "journalctl", "-t", "cosyvoice-lb", "--no-pager", check=False)

    # /ping answers once one instance is ready; `up` is done when all are, and a stop before
    # that is a stop while starting (another path: tests/launcher/cluster/test_lifecycle_foreground.py)
    assert wait_for(lambda: "running in the foreground" in journal(), timeout=180), journal()[-3000:]
    stopping = time.monotonic()
    inside(booted, "systemctl", "stop", "cosyvoice-lb")
    print(f"systemctl stop took {time.monotonic() - stopping:.1f} s")
    shown = inside(booted, "systemctl", "show", "cosyvoice-lb", "-p", "Result", "-p", "ExecMainStatus")
    assert set(shown.split()) == {"Result=success", "ExecMainStatus=0"}

    assert wait_for(lambda: "drained and stopped" in journal(), timeout=15), journal()[-3000:]
    assert [line for line in processes(booted) if STATE in line or line.split()[0] != "0"] == []
    assert not serving(url, session)

    assert f"removed /etc/systemd/system/cosyvoice-lb.service and {STATE}/cosyvoice-lb.env" in inside(
        booted, LAUNCHER, "service", "uninstall"
    )
    assert docker("exec", booted, LAUNCHER, "service", "status", check=False).returncode == 3
