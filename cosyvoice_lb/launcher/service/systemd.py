"""The edge of the boot unit: where units go, writing the unit and its environment file
(atomically; the environment file 0600), and systemctl (daemon-reload, enable, disable,
is-enabled, is-active), its failures turned into :class:`~.unit.ServiceError` messages
that say what to do."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.launcher.service.unit import Scope, Service, ServiceError

SYSTEM_UNITS = Path("/etc/systemd/system")
# What sd_booted() checks: this directory exists only while systemd is the init system.
BOOTED_MARK = Path("/run/systemd/system")
SYSTEMCTL_TIMEOUT = 60.0
# `systemctl stop` waits for the drain, which TimeoutStopSec bounds; a moment more for systemd.
STOP_SLACK = 30.0

Runner = Callable[..., subprocess.CompletedProcess]


def unit_dir(scope: Scope, home: Path | None = None, environ: dict[str, str] | None = None) -> Path:
    """Where systemd looks for units an administrator (system) or a user (``--user``) installs."""
    if scope == "system":
        return SYSTEM_UNITS
    environ = dict(os.environ) if environ is None else environ
    config = environ.get("XDG_CONFIG_HOME") or str((home or Path.home()) / ".config")
    return Path(config) / "systemd" / "user"


def systemd_missing(scope: Scope) -> str:
    """Why systemctl cannot be used here ("" when it can)."""
    if shutil.which("systemctl") is None:
        return "systemctl is not installed on this box (no systemd)"
    if not BOOTED_MARK.is_dir():
        try:
            init = Path("/proc/1/comm").read_text().strip()
        except OSError:
            init = "unknown"
        return f"systemd is not this box's init system (PID 1 is {init!r}; a container, or another init)"
    if scope == "user" and not os.environ.get("XDG_RUNTIME_DIR"):
        return "no user session of systemd here (XDG_RUNTIME_DIR is not set: log in as that user, not via su)"
    return ""


def write_files(service: Service, unit_text: str, env_text: str, directory: Path) -> Path:
    """Write the environment file (0600) and then the unit (0644) into ``directory``; return
    the unit's path."""
    target = directory / service.unit_file
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(Path(service.env_file), env_text, mode=0o600)
        write_atomic(target, unit_text, mode=0o644)
    except PermissionError as exc:
        hint = "run it with sudo (the cluster still runs as User=)" if service.scope == "system" else "check its owner"
        raise ServiceError(f"cannot write {exc.filename}: permission denied: {hint}, or pass --user") from exc
    except OSError as exc:
        raise ServiceError(f"cannot write {exc.filename or target}: {exc.strerror or exc}") from exc
    return target


def env_file_of(unit_path: Path) -> Path | None:
    """The EnvironmentFile a unit names (the one `service install` wrote), if any."""
    try:
        text = unit_path.read_text(encoding="utf-8")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("EnvironmentFile="):
            return Path(line.removeprefix("EnvironmentFile=").lstrip("-").replace("%%", "%"))
    return None


def is_ours(unit_path: Path) -> bool:
    """The unit was written by `service install` (uninstall removes nothing else)."""
    try:
        return "cosyvoice-lb service install" in unit_path.read_text(encoding="utf-8").split("\n", 1)[0]
    except OSError:
        return False


@dataclass
class Systemctl:
    """systemctl for one scope. ``run`` is :func:`subprocess.run` (tests of the messages give
    another)."""

    scope: Scope
    run: Runner = subprocess.run

    def argv(self, *args: str) -> list[str]:
        return ["systemctl", *(["--user"] if self.scope == "user" else []), *args]

    def call(self, *args: str, timeout: float = SYSTEMCTL_TIMEOUT) -> subprocess.CompletedProcess:
        try:
            return self.run(self.argv(*args), capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError as exc:
            raise ServiceError("systemctl is not installed on this box (no systemd)") from exc
        except subprocess.TimeoutExpired as exc:
            raise ServiceError(f"'{' '.join(self.argv(*args))}' did not answer in {timeout:.0f}s") from exc

    def must(self, *args: str, timeout: float = SYSTEMCTL_TIMEOUT) -> None:
        done = self.call(*args, timeout=timeout)
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip() or f"exit {done.returncode}"
            hint = " (run it with sudo, or pass --user)" if "access denied" in said.lower() else ""
            raise ServiceError(f"'{' '.join(self.argv(*args))}' failed: {said}{hint}")

    def query(self, verb: str, unit: str) -> str:
        """``is-enabled``/``is-active``'s one word (e.g. enabled, disabled, active, inactive)."""
        done = self.call(verb, unit)
        return (done.stdout.strip() or done.stderr.strip() or f"exit {done.returncode}").splitlines()[0]

    def install(self, unit: str, now: bool) -> None:
        self.must("daemon-reload")
        self.must("enable", *(["--now"] if now else []), unit)

    def uninstall(self, unit: str, stop_timeout: float) -> None:
        """Disable and stop it (the stop drains the cluster, so it may take the unit's TimeoutStopSec)."""
        self.must("disable", "--now", unit, timeout=stop_timeout + STOP_SLACK)

    def reload(self) -> None:
        self.must("daemon-reload")


def launcher_command(executable: str) -> tuple[str, ...]:
    """ExecStart's command: the ``cosyvoice-lb`` script beside this Python (the venv's; its
    path as is, not resolved, which would leave the venv), else this Python with ``-m``."""
    script = Path(executable).parent / "cosyvoice-lb"
    if script.is_file() and os.access(script, os.X_OK):
        return (str(script.absolute()), "up", "--foreground")
    return (str(Path(executable).absolute()), "-m", "cosyvoice_lb.launcher.cli", "up", "--foreground")


def run_as(environ: dict[str, str], uid: int, user: str) -> str:
    """Who a system unit runs the cluster as: the user behind sudo, else the user installing
    it; nobody named (root) when that is root."""
    sudo_user = environ.get("SUDO_USER", "")
    if uid == 0:
        return sudo_user if sudo_user and sudo_user != "root" else ""
    return user
