"""`cosyvoice-lb service`: start the cluster at boot with systemd (install, uninstall, status)."""

from __future__ import annotations

import dataclasses
import getpass
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import click

from cosyvoice_lb.common.setting_errors import setting_errors
from cosyvoice_lb.launcher.options import CLUSTER_OPTIONS, fail, options, settings_from
from cosyvoice_lb.launcher.service import systemd
from cosyvoice_lb.launcher.service.unit import (
    DEFAULT_NAME,
    Scope,
    Service,
    ServiceError,
    check_name,
    plan_service,
    render_env,
    render_unit,
    service_env,
)


def where_options(command: Any) -> Any:
    """--user, --unit-name, --unit-dir: which unit, and where it lives."""
    for decorate in reversed(
        (
            click.option(
                "--user",
                "user_scope",
                is_flag=True,
                help="A unit of your own systemd user manager (~/.config/systemd/user, started when you log in, "
                "or at boot with 'loginctl enable-linger'); default: a system unit in /etc/systemd/system (sudo).",
            ),
            click.option(
                "--unit-name", default=DEFAULT_NAME, show_default=True, metavar="NAME", help="The unit's name."
            ),
            click.option(
                "--unit-dir",
                type=click.Path(file_okay=False),
                default=None,
                help="Write (or remove) the unit in this folder instead, and leave systemctl alone: for a box "
                "without systemd running, or to look at the unit first.",
            ),
        )
    ):
        command = decorate(command)
    return command


@click.group("service")
def service_group() -> None:
    """Start the cluster at boot: a systemd unit that runs `up --foreground`."""


@service_group.command("install")
@options(*CLUSTER_OPTIONS)
@where_options
@click.option(
    "--run-as",
    default=None,
    metavar="USER",
    help="A system unit's User= (default: the user behind sudo, or you; root runs it as root).",
)
@click.option("--now", is_flag=True, help="Start it now too (systemctl enable --now).")
def install_command(
    user_scope: bool, unit_name: str, unit_dir: str | None, run_as: str | None, now: bool, **kwargs: Any
) -> None:
    """Write a systemd unit that runs `cosyvoice-lb up --foreground` with these settings, and
    enable it. The settings go into NAME.env in the state dir (0600), never the unit's command
    line; SIGTERM (systemctl stop) drains and stops the cluster."""
    settings = settings_from(kwargs)
    found = setting_errors(settings)
    if found:
        fail(found[0])
    scope: Scope = "user" if user_scope else "system"
    missing = "" if unit_dir else systemd.systemd_missing(scope)
    if missing:
        fail(
            f"{missing}: cannot install a unit. Run 'cosyvoice-lb up --foreground' under this box's own "
            "init system, or pass --unit-dir DIR to only write the unit",
            code=1,
        )
    user = run_as if run_as is not None else systemd.run_as(dict(os.environ), os.getuid(), getpass.getuser())
    try:
        service = plan_service(
            settings,
            name=unit_name,
            command=systemd.launcher_command(sys.executable),
            scope=scope,
            user=user,
        )
        prepare_state_dir(Path(service.state_dir), service.user)
        env_text = render_env(service_env(dataclasses.replace(settings, state_dir=service.state_dir), launcher_path()))
        directory = Path(unit_dir) if unit_dir else systemd.unit_dir(scope)
        path = systemd.write_files(service, render_unit(service), env_text, directory)
        if not unit_dir:
            systemd.Systemctl(scope).install(service.unit_file, now)
    except ServiceError as exc:
        fail(str(exc), code=1)
    for line in installed_lines(service, path, bool(unit_dir), now):
        click.echo(line)


def launcher_path() -> str:
    """The unit's PATH: this launcher's venv first (its supervisord), then the PATH it was
    installed from (nginx, prometheus), then systemd's usual one."""
    parts = [str(Path(sys.executable).parent), *os.environ.get("PATH", "").split(os.pathsep)]
    parts += ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
    return os.pathsep.join(dict.fromkeys(p for p in parts if p))


def prepare_state_dir(state_dir: Path, user: str) -> None:
    """The state dir exists before the unit starts in it, and a new one belongs to the user
    the unit runs as (sudo would leave it root's)."""
    if state_dir.is_dir():
        return
    try:
        state_dir.mkdir(parents=True)
        if user and os.getuid() == 0:
            shutil.chown(state_dir, user)
    except (OSError, LookupError) as exc:
        raise ServiceError(f"cannot make the state dir {state_dir}: {exc}") from exc


def installed_lines(service: Service, path: Path, written_only: bool, now: bool) -> list[str]:
    systemctl = "systemctl --user" if service.scope == "user" else "systemctl"
    journal = "journalctl --user" if service.scope == "user" else "journalctl"
    lines = [
        f"wrote {path}",
        f"wrote {service.env_file} (the settings, 0600)",
        f"stops within {service.stop_timeout}s (the drains, then whatever is left is killed)",
    ]
    if written_only:
        lines.append(
            f"systemctl was left alone: copy it into {systemd.unit_dir(service.scope)} and run "
            f"'{systemctl} daemon-reload && {systemctl} enable --now {service.unit_file}'"
        )
        return lines
    lines.append(f"enabled: it starts at boot{' and was started now' if now else ''}")
    if not now:
        lines.append(f"start it now: {systemctl} start {service.unit_file}")
    lines.append(f"its log: {journal} -u {service.unit_file} -f   (and 'cosyvoice-lb logs NAME')")
    if service.scope == "user":
        lines.append(f"at boot without a login: sudo loginctl enable-linger {shlex.quote(getpass.getuser())}")
    return lines


@service_group.command("uninstall")
@where_options
def uninstall_command(user_scope: bool, unit_name: str, unit_dir: str | None) -> None:
    """Stop the unit (the cluster drains), disable it, and remove it and its settings file."""
    scope: Scope = "user" if user_scope else "system"
    try:
        path = unit_path(scope, unit_name, unit_dir)
        env_file = systemd.env_file_of(path)
        if not unit_dir and not systemd.systemd_missing(scope):
            systemctl = systemd.Systemctl(scope)
            systemctl.uninstall(path.name, stop_timeout=stop_timeout_of(path))
        path.unlink()
        if env_file is not None:
            env_file.unlink(missing_ok=True)
        if not unit_dir and not systemd.systemd_missing(scope):
            systemctl.reload()
    except ServiceError as exc:
        fail(str(exc), code=1)
    except OSError as exc:
        fail(f"cannot remove {exc.filename}: {exc.strerror}: run it with sudo, or pass --user", code=1)
    click.echo(f"removed {path}" + (f" and {env_file}" if env_file else ""))


def unit_path(scope: Scope, name: str, unit_dir: str | None) -> Path:
    """An installed unit of ours, or a :class:`ServiceError` that says where none was found."""
    path = (Path(unit_dir) if unit_dir else systemd.unit_dir(scope)) / f"{check_name(name)}.service"
    if not path.exists():
        other = "" if unit_dir else (" (installed with --user?)" if scope == "system" else " (a system unit?)")
        raise ServiceError(f"no unit {path.name} in {path.parent}{other}")
    if not systemd.is_ours(path):
        raise ServiceError(f"{path} was not written by 'cosyvoice-lb service install': left as it is")
    return path


def stop_timeout_of(path: Path) -> float:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("TimeoutStopSec="):
            try:
                return float(line.removeprefix("TimeoutStopSec="))
            except ValueError:
                break
    return systemd.SYSTEMCTL_TIMEOUT


@service_group.command("status")
@where_options
def status_command(user_scope: bool, unit_name: str, unit_dir: str | None) -> None:
    """Where the unit is and what systemd says of it (is-enabled, is-active). Exit 0 when it
    is active, 3 when not (or not installed)."""
    scope: Scope = "user" if user_scope else "system"
    try:
        path = unit_path(scope, unit_name, unit_dir)
    except ServiceError as exc:
        fail(str(exc), code=3)
    click.echo(f"unit: {path}")
    click.echo(f"settings: {systemd.env_file_of(path)}")
    missing = systemd.systemd_missing(scope)
    if missing:
        click.echo(f"systemd: {missing}")
        sys.exit(3)
    systemctl = systemd.Systemctl(scope)
    try:
        enabled, active = systemctl.query("is-enabled", path.name), systemctl.query("is-active", path.name)
    except ServiceError as exc:
        fail(str(exc), code=3)
    click.echo(f"enabled: {enabled}")
    click.echo(f"active: {active}")
    sys.exit(0 if active == "active" else 3)
