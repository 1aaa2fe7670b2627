"""Which processes belong to a cluster: exactly its programs, nothing that merely names the dir."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.processes import is_cluster_program, port_taken

LAYOUT = Layout(Path("/srv/cvlb"))


@pytest.mark.parametrize(
    "args",
    [
        ["/usr/bin/python3", "-m", "supervisor.supervisord", "-c", "/srv/cvlb/run/supervisord.conf"],
        ["/usr/sbin/nginx", "-p", "/srv/cvlb/nginx", "-c", "/srv/cvlb/nginx/nginx.conf", "-e", "/srv/cvlb/logs/x.log"],
        ["/venv/bin/python", "/x/app.py", "--port", "7860", "--starts-file", "/srv/cvlb/run/instance-0.starts"],
        ["/venv/bin/python", "-m", "cosyvoice_lb.launcher.health.loop", "--state-dir", "/srv/cvlb"],
        ["/venv/bin/python", "-m", "cosyvoice_lb.launcher.panel.server", "--state-dir", "/srv/cvlb"],
        ["/venv/bin/python", "-m", "cosyvoice_lb.jobs", "--state-dir", "/srv/cvlb"],
        # (the module paths of 0.1: a cluster it started)
        ["/venv/bin/python", "-m", "cosyvoice_lb.health_loop", "--state-dir", "/srv/cvlb"],
        ["/venv/bin/python", "-m", "cosyvoice_lb.health", "--state-dir", "/srv/cvlb"],
        ["/venv/bin/python", "-m", "cosyvoice_lb.admin", "--state-dir", "/srv/cvlb"],
    ],
)
def test_the_cluster_programs_are_recognised(args):
    assert is_cluster_program(args, LAYOUT)


@pytest.mark.parametrize(
    "args",
    [
        ["/venv/bin/python", "-m", "cosyvoice_lb.launcher.cli", "logs", "health", "-f", "--state-dir", "/srv/cvlb"],
        ["python3", "-c", "import time; time.sleep(50)", "--state-dir", "/srv/cvlb"],
        ["tail", "-f", "/srv/cvlb/logs/instance-0.log"],
        ["/venv/bin/python", "-m", "cosyvoice_lb.launcher.health.loop", "--state-dir", "/srv/cvlb-other"],
        ["/venv/bin/python", "-m", "cosyvoice_lb.launcher.panel.server", "--state-dir", "/srv/cvlb-other"],
        ["/venv/bin/python", "-m", "cosyvoice_lb.jobs", "--state-dir", "/srv/cvlb-other"],
        ["/usr/sbin/nginx", "-c", "/srv/cvlb-other/nginx/nginx.conf"],
        ["/venv/bin/python", "app.py", "--starts-file", "/srv/cvlb/runaway/instance-0.starts"],
        [],
    ],
)
def test_other_processes_are_not(args):
    assert not is_cluster_program(args, LAYOUT)


def test_port_taken_says_by_whom():
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        why = port_taken("127.0.0.1", port)
        assert "in use" in why.lower() and "pid" in why and Path(sys.executable).name[:6] in why
    assert port_taken("127.0.0.1", port) == ""


def test_listening_is_seen_per_process():
    import socket as socket_module

    import psutil

    from cosyvoice_lb.launcher.state.processes import _listens_on

    with socket_module.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert _listens_on(psutil.Process(), port)
        assert not _listens_on(psutil.Process(), port + 1 if port < 65535 else port - 1)
    assert not _listens_on(psutil.Process(), port)  # closed
