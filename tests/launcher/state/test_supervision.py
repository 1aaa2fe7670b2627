"""The supervisord adapter (cosyvoice_lb/launcher/state/supervision.py) against a small XML-RPC server on a
real unix socket: its errors come out as SupervisionError, and its calls time out."""

from __future__ import annotations

import json
import socketserver
import threading
import time
import xmlrpc.client
from contextlib import contextmanager
from pathlib import Path

import pytest

from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.supervision import ProcessInfo, ProgramState, SupervisionError, Supervisor


class Script:
    """What the fake supervisord answers: method -> (delay seconds, result or xmlrpc Fault)."""

    def __init__(self):
        self.answers: dict[str, tuple[float, object]] = {}
        self.asked: list[str] = []


@contextmanager
def fake_supervisord(root: Path):
    script = Script()
    layout = Layout(root)
    layout.run.mkdir(parents=True, exist_ok=True)

    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            length = 0
            while True:
                line = self.rfile.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            params, method = xmlrpc.client.loads(self.rfile.read(length))
            name = method.split(".")[-1]
            script.asked.append(name)
            delay, result = script.answers.get(name, (0.0, True))
            time.sleep(delay)
            if isinstance(result, xmlrpc.client.Fault):
                body = xmlrpc.client.dumps(result, methodresponse=True)
            else:
                body = xmlrpc.client.dumps((result,), methodresponse=True)
            data = body.encode()
            try:
                self.wfile.write(
                    b"HTTP/1.0 200 OK\r\nContent-Type: text/xml\r\n"
                    + f"Content-Length: {len(data)}\r\n\r\n".encode()
                    + data
                )
            except OSError:  # the caller gave up (timed out) and closed
                pass

    server = socketserver.ThreadingUnixStreamServer(str(layout.socket), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield layout, script
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def short_dir(state_dir):
    return state_dir  # (short: a unix socket path must stay under 108 bytes)


def test_answers_come_through(short_dir):
    with fake_supervisord(short_dir) as (layout, script):
        script.answers["getState"] = (0.0, {"statename": "RUNNING"})
        script.answers["getPID"] = (0.0, 4242)
        supervisor = Supervisor(layout)
        assert supervisor.running() and supervisor.pid() == 4242


def test_a_fault_is_a_supervision_error_naming_it_and_a_harmless_one_is_fine(short_dir):
    with fake_supervisord(short_dir) as (layout, script):
        script.answers["signalProcess"] = (0.0, xmlrpc.client.Fault(10, "BAD_NAME: instance-9"))
        script.answers["startProcess"] = (0.0, xmlrpc.client.Fault(60, "ALREADY_STARTED: instance-0"))
        supervisor = Supervisor(layout)
        with pytest.raises(SupervisionError, match="refused signalProcess.*BAD_NAME") as caught:
            supervisor.signal("instance-9", "KILL")
        assert caught.value.fault == "BAD_NAME" and not caught.value.timed_out
        supervisor.start("instance-0")  # already started: what was asked for


def test_a_supervisord_that_does_not_answer_times_out_as_a_supervision_error(short_dir):
    """supervisor's own transport has no timeout: a stopped supervisord used to hang its caller."""
    with fake_supervisord(short_dir) as (layout, script):
        script.answers["getAllProcessInfo"] = (3.0, [])
        script.answers["getState"] = (3.0, {"statename": "RUNNING"})
        supervisor = Supervisor(layout, timeout=0.3)
        started = time.monotonic()
        with pytest.raises(SupervisionError, match="did not answer getAllProcessInfo within 0.3s") as caught:
            supervisor.processes()
        assert caught.value.timed_out and time.monotonic() - started < 2.5
        assert supervisor.running() is False  # (a yes/no question: no means no)


def test_a_stop_that_waits_gets_the_longer_bound(short_dir):
    """A stop answers once the process is gone (a drain, nginx's graceful QUIT): it must not
    be cut off by the bound for calls that answer at once."""
    with fake_supervisord(short_dir) as (layout, script):
        script.answers["stopProcess"] = (0.6, True)  # (twice the short bound)
        script.answers["stopProcessGroup"] = (0.6, True)
        supervisor = Supervisor(layout, timeout=0.3, wait_timeout=10.0)
        supervisor.stop("nginx")
        supervisor.stop_group("instance-0")
        assert script.asked == ["stopProcess", "stopProcessGroup"]
        with pytest.raises(SupervisionError, match="within 0.3s"):
            supervisor.stop("nginx", wait=False)  # does not wait: the short bound


def test_no_socket_is_a_supervision_error_too(short_dir):
    supervisor = Supervisor(Layout(short_dir), timeout=0.5)
    with pytest.raises(SupervisionError, match="could not be asked getAllProcessInfo"):
        supervisor.processes()
    assert supervisor.running() is False


def process_info(name: str, statename: str) -> dict:
    """One program as supervisord's getAllProcessInfo gives it."""
    return {
        "name": name,
        "statename": statename,
        "pid": 0,
        "start": 0,
        "now": 100,
        "description": "",
        "exitstatus": 0,
    }


def test_program_states_are_read_by_supervisords_names_and_an_unknown_one_is_unknown(short_dir):
    with fake_supervisord(short_dir) as (layout, script):
        names = {"nginx": "RUNNING", "instance-0": "BACKOFF", "instance-1": "SOMETHING_NEWER"}
        script.answers["getAllProcessInfo"] = (0.0, [process_info(n, s) for n, s in names.items()])
        states = {name: info.state for name, info in Supervisor(layout).processes().items()}
    assert states == {
        "nginx": ProgramState.RUNNING,
        "instance-0": ProgramState.BACKOFF,
        "instance-1": ProgramState.UNKNOWN,
    }
    assert all(type(state) is ProgramState for state in states.values())


def test_a_program_state_is_its_supervisord_name_wherever_it_is_written():
    assert [str(s) for s in ProgramState] == [
        "STOPPED",
        "STARTING",
        "RUNNING",
        "BACKOFF",
        "STOPPING",
        "EXITED",
        "FATAL",
        "UNKNOWN",
    ]
    info = ProcessInfo("nginx", "FATAL", 0, 0.0, 0.0, "", 1)  # (given as text: read as the member)
    assert info.state is ProgramState.FATAL
    assert json.dumps({"state": info.state}) == '{"state": "FATAL"}' and f"{info.state}" == "FATAL"
    assert ProcessInfo("nginx", "nonsense", 0, 0.0, 0.0, "", 0).state is ProgramState.UNKNOWN
