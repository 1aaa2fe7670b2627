"""The boot unit's texts: every setting reaches `up --foreground` as given (the environment
file read back by a real shell and by `up`'s own options), paths that need quoting, the stop
timeout against the drain, and systemd's own `systemd-analyze verify` on what is rendered."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import installed

from cosyvoice_lb.common.settings import Settings, declarations, envvar
from cosyvoice_lb.common.timeouts import Timeouts
from cosyvoice_lb.launcher.options import settings_from
from cosyvoice_lb.launcher.service.systemd import launcher_command, run_as
from cosyvoice_lb.launcher.service.unit import (
    STOP_MARGIN,
    ServiceError,
    check_name,
    exec_word,
    plan_service,
    render_env,
    render_unit,
    service_env,
)

LAUNCHER = launcher_command(sys.executable)
HOSTILE = 'a b "q" $HOME `x` \\ 100% it\'s'


def changed(field: dataclasses.Field) -> object:
    """A value of ``field`` other than its default, with what a shell or systemd could bend."""
    default = field.default
    choices = field.metadata.get("choices")
    if isinstance(default, bool):
        return not default
    if choices:
        return next(c for c in choices if c != default)
    if isinstance(default, int):
        return default + 3
    if isinstance(default, float):
        return default + 1.25
    separator = field.metadata.get("separator")
    if separator:
        return separator.join(["one two", "th$ree"])
    return f"/srv/{field.name} {HOSTILE}"


def up_reads(env_file: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """What `up --foreground` parses from ``env_file``: the file read by a real shell (the
    same double-quote rules systemd's EnvironmentFile follows), then `up`'s own options."""
    from cosyvoice_lb.launcher.cli import up_command

    dumped = subprocess.run(
        ["sh", "-c", 'set -a; . "$1"; env -0', "sh", str(env_file)],
        capture_output=True,
        check=True,
        env={"PATH": os.environ["PATH"]},
    ).stdout.decode()
    for name in list(os.environ):
        if name.startswith("COSYVOICE_LB_"):
            monkeypatch.delenv(name)
    for entry in filter(None, dumped.split("\0")):
        key, _, value = entry.partition("=")
        if key.startswith("COSYVOICE_LB_"):
            monkeypatch.setenv(key, value)
    context = up_command.make_context("up", ["--foreground"])
    assert context.params["foreground"] is True
    return settings_from(context.params)


@pytest.mark.parametrize("field", declarations(), ids=lambda f: f.name)
def test_every_setting_reaches_up_as_given(field, tmp_path, monkeypatch):
    settings = dataclasses.replace(Settings(state_dir=str(tmp_path / "state dir")), **{field.name: changed(field)})
    env = service_env(settings, "/usr/bin:/bin")
    if field.name != "state_dir":
        assert envvar(field.name) in env
    env_file = tmp_path / "cosyvoice-lb.env"
    env_file.write_text(render_env(env))
    read = up_reads(env_file, monkeypatch)
    assert getattr(read, field.name) == getattr(settings_from(dataclasses.asdict(settings)), field.name)
    assert read.state_dir == settings.state_dir


def test_only_what_differs_from_the_defaults_is_written(tmp_path):
    env = service_env(Settings(state_dir=str(tmp_path), instances=2), "/bin")
    assert env == {"PATH": "/bin", envvar("state_dir"): str(tmp_path), envvar("instances"): "2"}


def test_a_line_break_in_a_value_is_refused():
    with pytest.raises(ServiceError, match="line break"):
        render_env({"COSYVOICE_LB_HOST": "a\nb"})


def service_for(settings: Settings, **changes):
    base = {"name": "cosyvoice-lb", "command": LAUNCHER, "scope": "system", "user": ""}
    return plan_service(settings, **{**base, **changes})


@pytest.mark.parametrize("drain", [1.0, 30.0, 45.5, 600.0])
def test_systemd_waits_past_downs_own_bound(drain, tmp_path):
    settings = Settings(state_dir=str(tmp_path), drain_timeout=drain)
    service = service_for(settings)
    assert service.stop_timeout >= Timeouts(settings).down + STOP_MARGIN
    assert service.stop_timeout > 2 * drain
    assert f"TimeoutStopSec={service.stop_timeout}\n" in render_unit(service)


def test_the_unit_runs_up_in_the_foreground_from_the_state_dir(tmp_path):
    settings = Settings(state_dir=str(tmp_path / "state"), jobs_redis="redis://:s3cret@127.0.0.1:6379/0")
    text = render_unit(service_for(settings, user="tts"))
    lines = text.splitlines()
    assert f"ExecStart={LAUNCHER[0]} up --foreground" in lines
    assert f"WorkingDirectory={tmp_path / 'state'}" in lines
    assert f"EnvironmentFile={tmp_path / 'state' / 'cosyvoice-lb.env'}" in lines
    assert {"User=tts", "KillMode=mixed", "Restart=on-failure", "RestartSec=10", "LimitNOFILE=65536"} <= set(lines)
    assert {"After=network-online.target", "WantedBy=multi-user.target"} <= set(lines)
    assert "s3cret" not in text and "COSYVOICE_LB" not in text.split("[Service]")[1]


def test_a_user_unit_names_no_user_and_starts_with_the_users_manager(tmp_path):
    text = render_unit(service_for(Settings(state_dir=str(tmp_path)), scope="user", user="tts"))
    assert "User=" not in text and "network-online" not in text
    assert "WantedBy=default.target" in text.splitlines()


def test_unit_names(tmp_path):
    assert check_name("tts@a.service") == "tts@a"
    for bad in ("", "a b", "../x", "x/y"):
        with pytest.raises(ServiceError, match="unit name"):
            check_name(bad)


def test_who_a_system_unit_runs_as():
    assert run_as({"SUDO_USER": "alice"}, 0, "root") == "alice"
    assert run_as({}, 0, "root") == ""
    assert run_as({"SUDO_USER": "root"}, 0, "root") == ""
    assert run_as({}, 1000, "bob") == "bob"


def verify(unit: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [installed("systemd-analyze", "systemd"), *extra, "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=unit.parent,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("scope", ["system", "user"])
def test_systemd_accepts_the_unit(scope, tmp_path):
    settings = Settings(state_dir=str(tmp_path / "state"), drain_timeout=90.0)
    unit = tmp_path / "cosyvoice-lb.service"
    unit.write_text(render_unit(service_for(settings, scope=scope, user="root")))
    # (a user manager wants its runtime dir, which only a login session has: a private one here)
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    extra = ["--user"] if scope == "user" else []
    done = verify(unit, *extra, env={"XDG_RUNTIME_DIR": str(runtime)})
    assert (done.returncode, done.stderr) == (0, "")


def test_systemd_finds_a_launcher_whose_path_needs_quoting(tmp_path):
    """systemd checks that ExecStart's program exists: it finds it only if the path was
    carried whole (a space, a %, a $), and so do the state dir's lines."""
    odd = tmp_path / "venv with 100% $PATH" / "bin"
    odd.mkdir(parents=True)
    (odd / "cosyvoice-lb").symlink_to(Path(LAUNCHER[0]).absolute())
    state = tmp_path / "state 50% $x"
    command = (str(odd / "cosyvoice-lb"), "up", "--foreground")
    unit = tmp_path / "tts.service"
    unit.write_text(render_unit(service_for(Settings(state_dir=str(state)), name="tts", command=command)))
    assert (verify(unit).returncode, verify(unit).stderr) == (0, "")
    assert f"WorkingDirectory={tmp_path}/state 50%% $x" in unit.read_text().splitlines()
    missing = (str(tmp_path / "venv with") + "/cosyvoice-lb", "up")
    unit.write_text(render_unit(service_for(Settings(state_dir=str(state)), name="tts", command=missing)))
    broken = verify(unit)
    assert broken.returncode != 0 and "venv with/cosyvoice-lb is not executable" in broken.stderr


def test_a_launcher_path_systemd_cannot_run_is_refused(tmp_path):
    command = (str(tmp_path / 'a "b"' / "cosyvoice-lb"), "up", "--foreground")
    with pytest.raises(ServiceError, match="quote or a backslash"):
        render_unit(service_for(Settings(state_dir=str(tmp_path)), command=command))


def test_arguments_are_quoted_and_kept_from_expansion():
    assert exec_word("--foreground") == "--foreground"
    assert exec_word("a b$c 5%") == '"a b$$c 5%%"'
    assert exec_word('say "hi"') == '"say \\"hi\\""'
