"""The one pid check (cosyvoice_lb/common/pids.py): a zombie and an exiting process are dead."""

from __future__ import annotations

import os
import subprocess
import time

from cosyvoice_lb.common.pids import alive


def test_a_zombie_is_dead_and_a_running_process_alive():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert alive(child.pid) and alive(os.getpid())
        child.kill()
        deadline = time.monotonic() + 10
        while alive(child.pid) and time.monotonic() < deadline:  # a zombie until waited for
            time.sleep(0.01)
        assert not alive(child.pid) and os.path.exists(f"/proc/{child.pid}")
    finally:
        child.wait()
    assert not alive(child.pid)


def test_no_pid_of_a_group_is_alive():
    assert not alive(0) and not alive(-1)  # (kill(0) would signal our own group)
