"""A plain (not editable) `pip install .` carries the templates and app.py."""

from __future__ import annotations

import subprocess
import sys
import sysconfig

from conftest import ROOT, clean_env


def test_plain_install_finds_its_templates_and_app(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # The package alone, installed for real; its dependencies are borrowed from this
    # interpreter (PYTHONPATH comes after the venv's own site-packages).
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    share = venv / "share" / "cosyvoice-lb"
    assert (share / "app.py").is_file() and (share / "templates" / "nginx.conf.j2").is_file()

    env = clean_env(PYTHONPATH=sysconfig.get_path("purelib"))
    where = subprocess.run(
        [str(python), "-c", "import cosyvoice_lb; print(cosyvoice_lb.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        check=True,
    )
    assert where.stdout.strip().startswith(str(venv))  # the installed copy, not the checkout
    state = tmp_path / "s"
    done = subprocess.run(
        [str(venv / "bin" / "cosyvoice-lb"), "render", "--state-dir", str(state), "--instances", "1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    conf = (state / "run" / "supervisord.conf").read_text()
    # instances run a staged copy of the installed app and instance modules
    staged = state / "run" / "lib"
    assert str(staged / "app.py") in conf
    assert (staged / "app.py").read_text() == (share / "app.py").read_text()
    installed = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages" / "cosyvoice_lb"
    assert (staged / "cosyvoice_lb" / "server.py").read_text() == (installed / "server.py").read_text()
