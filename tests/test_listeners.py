"""Where a process really listens: read from the OS, compared with a config's address."""

from __future__ import annotations

import socket

import psutil

from cosyvoice_lb.listeners import beyond_loopback, describe, listening, wanted


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
