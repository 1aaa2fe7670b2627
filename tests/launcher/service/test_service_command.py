"""`cosyvoice-lb service install/status/uninstall` through the real CLI: the files it writes
(the settings file 0600, nothing secret in the unit), systemd's verdict on the unit it wrote,
and the messages where systemd is not there to take it."""

from __future__ import annotations

import stat
import subprocess

import pytest
from conftest import clean_env, cli_here
from test_service_unit import verify

from cosyvoice_lb.launcher.service.systemd import Systemctl, systemd_missing
from cosyvoice_lb.launcher.service.unit import ServiceError

NO_SYSTEMD = systemd_missing("system")


def install(tmp_path, *extra: str):
    return cli_here(
        "service",
        "install",
        "--unit-dir",
        str(tmp_path / "units"),
        "--state-dir",
        str(tmp_path / "my state"),
        *extra,
        env=clean_env(COSYVOICE_LB_JOBS_REDIS="redis://:s3cret@127.0.0.1:6379/0"),
    )


def test_install_writes_the_unit_and_its_private_settings(tmp_path):
    done = install(tmp_path, "--instances", "2", "--drain-timeout", "45", "--unit-name", "tts")
    assert done.returncode == 0, done.stdout
    unit = tmp_path / "units" / "tts.service"
    env_file = tmp_path / "my state" / "tts.env"
    assert f"wrote {unit}" in done.stdout and "systemctl was left alone" in done.stdout
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644
    settings = env_file.read_text()
    assert 'COSYVOICE_LB_INSTANCES="2"' in settings and "s3cret" in settings  # (from the environment)
    assert "s3cret" not in unit.read_text()
    assert "TimeoutStopSec=150" in unit.read_text().splitlines()  # 2 x 45 + 30, and 30 more
    done = verify(unit)
    assert (done.returncode, done.stderr) == (0, "")


def test_status_shows_the_unit_and_uninstall_removes_it(tmp_path):
    assert install(tmp_path).returncode == 0
    where = ("--unit-dir", str(tmp_path / "units"))
    shown = cli_here("service", "status", *where)
    assert f"unit: {tmp_path / 'units' / 'cosyvoice-lb.service'}" in shown.stdout
    assert f"settings: {tmp_path / 'my state' / 'cosyvoice-lb.env'}" in shown.stdout
    assert shown.returncode == 3  # (nothing runs it from that folder)
    gone = cli_here("service", "uninstall", *where)
    assert gone.returncode == 0, gone.stdout
    assert not (tmp_path / "units" / "cosyvoice-lb.service").exists()
    assert not (tmp_path / "my state" / "cosyvoice-lb.env").exists()
    again = cli_here("service", "uninstall", *where)
    assert again.returncode == 1 and "no unit cosyvoice-lb.service in" in again.stderr
    assert cli_here("service", "status", *where).returncode == 3


def test_a_unit_it_did_not_write_is_left_alone(tmp_path):
    (tmp_path / "nginx.service").write_text("[Service]\nExecStart=/usr/sbin/nginx\n")
    done = cli_here("service", "uninstall", "--unit-dir", str(tmp_path), "--unit-name", "nginx")
    assert done.returncode == 1 and "was not written by 'cosyvoice-lb service install'" in done.stderr
    assert (tmp_path / "nginx.service").exists()


def test_bad_settings_and_names_are_refused_before_anything_is_written(tmp_path):
    done = install(tmp_path, "--unit-name", "a b")
    assert done.returncode != 0 and "not a unit name systemd takes" in done.stderr
    done = install(tmp_path, "--min-instances", "5", "--max-instances", "2")
    assert done.returncode != 0 and "error:" in done.stderr
    assert not (tmp_path / "units").exists()


@pytest.mark.skipif(not NO_SYSTEMD, reason="systemd runs this box: the message is for boxes without it")
@pytest.mark.parametrize("scope", [(), ("--user",)])
def test_without_systemd_install_says_so_and_writes_nothing(scope, tmp_path):
    done = cli_here("service", "install", *scope, "--state-dir", str(tmp_path / "state"))
    assert done.returncode == 1
    assert NO_SYSTEMD in done.stderr and "pass --unit-dir DIR to only write the unit" in done.stderr
    assert not (tmp_path / "state").exists()


def scripted(returncode: int = 0, stderr: str = "", raises: Exception | None = None):
    """systemctl as a box with systemd answers (none runs here): what it was asked, and one answer."""
    asked: list[list[str]] = []

    def run(argv, **kwargs):
        asked.append(argv)
        if raises is not None:
            raise raises
        return subprocess.CompletedProcess(argv, returncode, "", stderr)

    return run, asked


def test_systemctls_refusals_become_messages_that_say_what_to_do():
    run, asked = scripted(1, "Failed to enable unit: Access denied\n")
    with pytest.raises(ServiceError, match="Access denied \\(run it with sudo, or pass --user\\)"):
        Systemctl("system", run).install("cosyvoice-lb.service", now=True)
    assert asked == [["systemctl", "daemon-reload"]]
    run, asked = scripted()
    Systemctl("user", run).install("tts.service", now=True)
    assert asked == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "--now", "tts.service"],
    ]
    run, _ = scripted(raises=FileNotFoundError("systemctl"))
    with pytest.raises(ServiceError, match="systemctl is not installed"):
        Systemctl("system", run).reload()
