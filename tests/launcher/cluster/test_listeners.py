"""Where a process really listens: read from the OS, compared with a config's address."""

from __future__ import annotations

import socket

import psutil

from cosyvoice_lb.launcher.cluster.listeners import beyond_loopback, describe, listening, wanted


def test_the_sockets_a_process_holds_are_read_from_the_os():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert ("127.0.0.1", port) in listening([psutil.Process()])
    assert ("127.0.0.1", port) not in listening([psutil.Process()])


def test_what_a_listen_line_binds():
    assert wanted("127.0.0.1", 8080) == {("127.0.0.1", 8080)}
    assert wanted("0.0.0.0", 8080) == {("0.0.0.0", 8080)}
    assert wanted("[::]", 8080) == {("::", 8080)}
    assert ("127.0.0.1", 8080) in wanted("localhost", 8080)


def test_beyond_loopback_and_words():
    assert not beyond_loopback({("127.0.0.1", 1), ("::1", 1)})
    assert beyond_loopback({("0.0.0.0", 1)}) and beyond_loopback({("::", 1)})
    assert describe({("::", 80), ("0.0.0.0", 80)}) == "0.0.0.0:80, [::]:80"
    assert describe(set()) == "nothing"


def test_a_config_written_just_after_the_workers_started_is_seen_as_behind(tmp_path):
    """A reload that failed a moment after one that took: the workers are the older ones."""
    import subprocess
    import time

    from cosyvoice_lb.launcher.cluster.listeners import config_behind, started

    worker = subprocess.Popen(["sleep", "30"])
    try:
        proc = psutil.Process(worker.pid)
        begun, slack = started(proc)
        assert slack < 0.5 and abs(begun - time.time()) < 2
        time.sleep(0.3)  # less than the whole second psutil's own start time may be off by
        conf = tmp_path / "nginx.conf"
        conf.write_text("events {}\n")
        assert config_behind([proc], [conf], grace=0) == conf.stat().st_mtime
        assert config_behind([proc], [conf], grace=60) == 0.0  # a reload may still be under way
        newer = psutil.Process(subprocess.Popen(["sleep", "30"]).pid)  # a reload that took
        try:
            assert config_behind([proc, newer], [conf], grace=0) == 0.0
        finally:
            newer.kill()
            newer.wait()
    finally:
        worker.kill()
        worker.wait()
