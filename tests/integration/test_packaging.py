"""A wheel carries the templates inside the package: installed from it (not editable, no
checkout on the path), the launcher renders, stages the instance code and finds the panel."""

from __future__ import annotations

import subprocess
import sys
import sysconfig

from conftest import ROOT, clean_env


def test_a_wheel_renders_from_its_own_templates(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("cosyvoice_lb-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # The package alone, installed for real; its dependencies are borrowed from this
    # interpreter (PYTHONPATH comes after the venv's own site-packages).
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    installed = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages" / "cosyvoice_lb"
    template = installed / "templates" / "nginx.conf.j2"
    assert template.is_file() and not template.is_symlink()  # the files themselves, not the checkout's link
    assert not (venv / "share" / "cosyvoice-lb").exists()

    env = clean_env(PYTHONPATH=sysconfig.get_path("purelib"))
    page = subprocess.run(
        [str(python), "-c", "from cosyvoice_lb.launcher.render import templates; print(templates.read('admin.html'))"],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        check=True,
    )
    assert "<title>cosyvoice-lb control panel</title>" in page.stdout
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
    assert str(installed) not in conf and str(ROOT) not in conf.replace(str(state), "")
    # instances run a staged copy of the installed instance code
    staged = state / "run" / "lib"
    assert str(staged / "app.py") in conf
    assert (staged / "app.py").read_text() == (installed / "instance" / "__main__.py").read_text()
    server = staged / "cosyvoice_lb" / "instance" / "server.py"
    assert server.read_text() == (installed / "instance" / "server.py").read_text()
    assert not (staged / "cosyvoice_lb" / "launcher").exists()
