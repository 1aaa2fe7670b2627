"""supervisord adapter: start it, talk XML-RPC over its 0700 unix socket, stop it.

Every failure of a call (an XML-RPC fault, a socket that times out or refuses, a broken
answer) leaves this module as :class:`SupervisionError`, which says which call on which
socket failed; callers never see supervisor's or the socket's own exceptions.
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import tempfile
import time
import xmlrpc.client
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.xmlrpc import SupervisorTransport

from cosyvoice_lb.common.names import StrEnum
from cosyvoice_lb.common.timeouts import SUPERVISOR_CALL, SUPERVISOR_WAIT
from cosyvoice_lb.launcher.state.layout import Layout

# What a call to supervisord can raise: faults, protocol errors, and the socket's errors
# (a timeout is an OSError; so is a refused or missing socket).
RPC_ERRORS = (
    OSError,
    xmlrpc.client.Fault,
    xmlrpc.client.ProtocolError,
    xmlrpc.client.ResponseError,
    http.client.HTTPException,
    EOFError,
)

# Programs no request goes through, which nothing needs to drain or wait for: when their
# config changes, supervisord replaces them at once (the cluster's Alertmanager).
SIDE_PROGRAMS = ("alertmanager",)


class TimedUnixConnection(http.client.HTTPConnection):
    """HTTP over a unix socket with a timeout on connect and on every read (supervisor's own
    connection has none: a stopped supervisord would hang its caller forever)."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


class SupervisionError(RuntimeError):
    """A supervisord call failed; the message says which and why."""

    def __init__(self, message: str, fault: str = "", timed_out: bool = False):
        super().__init__(message)
        self.fault = fault  # supervisord's fault name (e.g. BAD_NAME), "" for a transport failure
        self.timed_out = timed_out  # it is there but did not answer in time (busy or stopped)


class ProgramState(StrEnum):
    """A program's state as supervisord names it (its ``statename``); the value is that name,
    so what is shown or written of it (status, metrics, logs) reads as supervisord says it."""

    STOPPED = "STOPPED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    BACKOFF = "BACKOFF"
    STOPPING = "STOPPING"
    EXITED = "EXITED"
    FATAL = "FATAL"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, name: object) -> ProgramState:
        """The state of that name; a name this version does not know is UNKNOWN."""
        try:
            return cls(name)
        except ValueError:
            return cls.UNKNOWN


# A process runs, or is being started (supervisord will say whether it stays up).
ALIVE = frozenset({ProgramState.RUNNING, ProgramState.STARTING})
# It is not running and supervisord is not bringing it back by itself.
DOWN = frozenset({ProgramState.STOPPED, ProgramState.EXITED, ProgramState.FATAL})


@dataclass(frozen=True)
class ProcessInfo:
    name: str
    state: ProgramState  # (a string given is read as supervisord's name: see ProgramState.parse)
    pid: int
    start: float  # epoch seconds of the last start, 0 if never
    now: float  # supervisord's clock when read
    description: str
    exitstatus: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", ProgramState.parse(self.state))

    @property
    def uptime(self) -> float:
        return max(0.0, self.now - self.start) if self.start else 0.0


class Supervisor:
    """One cluster's supervisord, addressed through the socket in its state dir."""

    def __init__(self, layout: Layout, timeout: float = SUPERVISOR_CALL, wait_timeout: float = SUPERVISOR_WAIT):
        self.layout = layout
        self.timeout = timeout  # a call that answers at once
        self.wait_timeout = wait_timeout  # a start or stop that answers once the process got there

    def _rpc(self, method: str, *args: Any, harmless: str = "", waits: bool = False) -> Any:
        """One XML-RPC call; a fault naming ``harmless`` (already in that state) is fine.
        ``waits``: supervisord answers only once a process started or stopped."""
        transport = SupervisorTransport(None, None, f"unix://{self.layout.socket}")
        path, timeout = str(self.layout.socket), self.wait_timeout if waits else self.timeout
        transport._get_connection = lambda: TimedUnixConnection(path, timeout)
        proxy = xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport)
        try:
            return getattr(proxy.supervisor, method)(*args)
        except xmlrpc.client.Fault as fault:
            if harmless and harmless in fault.faultString:
                return None
            raise SupervisionError(
                f"supervisord refused {method}{args!r}: {fault.faultString}", fault=fault.faultString.split(":")[0]
            ) from None
        except TimeoutError:
            raise SupervisionError(
                f"supervisord did not answer {method} within {timeout:g}s on {self.layout.socket} (busy or stopped?)",
                timed_out=True,
            ) from None
        except RPC_ERRORS as exc:
            raise SupervisionError(
                f"supervisord could not be asked {method} on {self.layout.socket}: {type(exc).__name__}: {exc}"
            ) from None

    def running(self) -> bool:
        """True when a supervisord answers on this state dir's socket."""
        if not self.layout.socket.exists():
            return False
        try:
            # (supervisord's own state, RUNNING once it serves: not one of a program's)
            return self._rpc("getState")["statename"] == "RUNNING"
        except (SupervisionError, KeyError, TypeError):
            return False

    def pid(self) -> int:
        return int(self._rpc("getPID"))

    def start_daemon(self, wait: float = 15.0) -> None:
        """Start supervisord (it daemonizes) and wait until its socket answers."""
        # Its output goes to a file, not a pipe: the daemon it forks could hold a pipe open
        # (and this wait with it) for as long as it lives.
        with tempfile.TemporaryFile() as output:
            try:
                done = subprocess.run(
                    [sys.executable, "-m", "supervisor.supervisord", "-c", str(self.layout.supervisord_conf)],
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    cwd=str(self.layout.root),
                    check=False,
                    timeout=wait,
                )
            except subprocess.TimeoutExpired:
                raise SupervisionError(
                    f"supervisord did not start within {wait:.0f}s; see {self.layout.log('supervisord')}"
                ) from None
            output.seek(0)
            said = output.read().decode("utf-8", errors="replace").strip()
        if done.returncode != 0:
            raise SupervisionError(f"supervisord did not start: {said[-800:]}")
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.running():
                return
            time.sleep(0.1)
        raise SupervisionError(
            f"supervisord did not answer on {self.layout.socket} within {wait:.0f}s; "
            f"see {self.layout.log('supervisord')}"
        )

    def processes(self) -> dict[str, ProcessInfo]:
        try:
            return {
                p["name"]: ProcessInfo(
                    name=p["name"],
                    state=ProgramState.parse(p["statename"]),
                    pid=int(p["pid"]),
                    start=float(p["start"]),
                    now=float(p["now"]),
                    description=p["description"],
                    exitstatus=int(p["exitstatus"]),
                )
                for p in self._rpc("getAllProcessInfo")
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise SupervisionError(f"supervisord answered getAllProcessInfo oddly: {exc!r}") from None

    def signal(self, name: str, signal: str) -> None:
        self._rpc("signalProcess", name, signal)

    def start(self, name: str, wait: bool = False) -> None:
        self._rpc("startProcess", name, wait, harmless="ALREADY_STARTED", waits=wait)

    def stop(self, name: str, wait: bool = True) -> None:
        self._rpc("stopProcess", name, wait, harmless="NOT_RUNNING", waits=wait)

    def tail(self, name: str, length: int = 4000) -> str:
        """The last ``length`` bytes of a program's log, read from the file itself."""
        path = self.layout.log(name)
        return read_tail(path, length)

    def reload(self) -> tuple[list[str], list[str], list[str]]:
        """Re-read the config file; (added, changed, removed) groups, not yet applied, but for
        the programs that serve no request (:data:`SIDE_PROGRAMS`): a changed one is replaced
        at once, and left out."""
        added, changed, removed = self._rpc("reloadConfig")[0]
        for name in [n for n in changed if n in SIDE_PROGRAMS]:
            self.remove_group(name)
            self.add_group(name)
            changed.remove(name)
        return added, changed, removed

    def add_group(self, name: str) -> None:
        self._rpc("addProcessGroup", name, harmless="ALREADY_ADDED")

    def remove_group(self, name: str) -> None:
        self.stop_group(name)
        self._rpc("removeProcessGroup", name, harmless="BAD_NAME")

    def stop_group(self, name: str) -> None:
        self._rpc("stopProcessGroup", name, True, harmless="BAD_NAME", waits=True)

    def shutdown(self) -> None:
        self._rpc("shutdown")


def read_tail(path: Path, length: int = 4000) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - length))
            return handle.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
