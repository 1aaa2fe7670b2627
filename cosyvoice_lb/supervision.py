"""supervisord adapter: start it, talk XML-RPC over its 0700 unix socket, stop it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import xmlrpc.client
from dataclasses import dataclass
from pathlib import Path

from supervisor.xmlrpc import SupervisorTransport

from .render import Layout


class SupervisionError(RuntimeError):
    pass


@dataclass(frozen=True)
class ProcessInfo:
    name: str
    state: str  # STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, EXITED, FATAL, UNKNOWN
    pid: int
    start: float  # epoch seconds of the last start, 0 if never
    now: float  # supervisord's clock when read
    description: str
    exitstatus: int

    @property
    def uptime(self) -> float:
        return max(0.0, self.now - self.start) if self.start else 0.0


class Supervisor:
    """One cluster's supervisord, addressed through the socket in its state dir."""

    def __init__(self, layout: Layout, timeout: float = 10.0):
        self.layout = layout
        self.timeout = timeout

    @property
    def rpc(self):
        transport = SupervisorTransport(None, None, f"unix://{self.layout.socket}")
        transport.timeout = self.timeout
        return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport)

    def running(self) -> bool:
        """True when a supervisord answers on this state dir's socket."""
        if not self.layout.socket.exists():
            return False
        try:
            return self.rpc.supervisor.getState()["statename"] == "RUNNING"
        except (OSError, xmlrpc.client.Fault, xmlrpc.client.ProtocolError, socket.timeout):
            return False

    def pid(self) -> int:
        return int(self.rpc.supervisor.getPID())

    def start_daemon(self, wait: float = 15.0) -> None:
        """Start supervisord (it daemonizes) and wait until its socket answers."""
        done = subprocess.run(
            [sys.executable, "-m", "supervisor.supervisord", "-c", str(self.layout.supervisord_conf)],
            capture_output=True, text=True, cwd=str(self.layout.root), check=False,
        )
        if done.returncode != 0:
            raise SupervisionError(f"supervisord did not start: {(done.stderr or done.stdout).strip()[-800:]}")
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
        return {
            p["name"]: ProcessInfo(
                name=p["name"], state=p["statename"], pid=int(p["pid"]), start=float(p["start"]),
                now=float(p["now"]), description=p["description"], exitstatus=int(p["exitstatus"]),
            )
            for p in self.rpc.supervisor.getAllProcessInfo()
        }

    def signal(self, name: str, signal: str) -> None:
        self.rpc.supervisor.signalProcess(name, signal)

    def _call(self, method: str, *args, harmless: str = "") -> None:
        """One XML-RPC call; a fault naming ``harmless`` (already in that state) is fine."""
        try:
            getattr(self.rpc.supervisor, method)(*args)
        except xmlrpc.client.Fault as fault:
            if not harmless or harmless not in fault.faultString:
                raise

    def start(self, name: str, wait: bool = False) -> None:
        self._call("startProcess", name, wait, harmless="ALREADY_STARTED")

    def stop(self, name: str, wait: bool = True) -> None:
        self._call("stopProcess", name, wait, harmless="NOT_RUNNING")

    def tail(self, name: str, length: int = 4000) -> str:
        """The last ``length`` bytes of a program's log, read from the file itself."""
        path = self.layout.log(name)
        return read_tail(path, length)

    def reload(self) -> tuple[list[str], list[str], list[str]]:
        """Re-read the config file; (added, changed, removed) groups, not yet applied."""
        added, changed, removed = self.rpc.supervisor.reloadConfig()[0]
        return added, changed, removed

    def add_group(self, name: str) -> None:
        self._call("addProcessGroup", name, harmless="ALREADY_ADDED")

    def remove_group(self, name: str) -> None:
        self.stop_group(name)
        self._call("removeProcessGroup", name, harmless="BAD_NAME")

    def stop_group(self, name: str) -> None:
        self._call("stopProcessGroup", name, True, harmless="BAD_NAME")

    def shutdown(self) -> None:
        self.rpc.supervisor.shutdown()


def read_tail(path: Path, length: int = 4000) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - length))
            return handle.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
