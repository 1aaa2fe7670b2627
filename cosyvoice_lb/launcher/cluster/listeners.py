"""Where nginx really listens: the TCP sockets its processes hold (not what its config
says), and whether they are where the config asks. `up` checks every listener change
with it and `status` reports it."""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

Address = tuple[str, int]

# A reload under way: nginx takes a config a moment after it is written.
RELOAD_GRACE = 5.0
# How much earlier than it was a process's start may read: /proc counts it in clock ticks
# (10 ms), a file's mtime is the kernel's coarse clock (a few ms). psutil's own start time
# counts from a boot time given in whole seconds: up to 1 s off, where /proc cannot be read.
START_TIME_SLACK = 0.05
COARSE_START_SLACK = 1.0


def started(proc: psutil.Process) -> tuple[float, float]:
    """When ``proc`` started (wall clock, seconds) and how far off that may be: from its
    ticks since boot in /proc, against the boot clock now (a reload that failed a moment
    after one that took must still show)."""
    try:
        with open(f"/proc/{proc.pid}/stat", encoding="ascii", errors="replace") as stat:
            ticks = int(stat.read().rpartition(")")[2].split()[19])
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return boot + ticks / os.sysconf("SC_CLK_TCK"), START_TIME_SLACK
    except (OSError, IndexError, ValueError, AttributeError):
        return proc.create_time(), COARSE_START_SLACK


def nginx_processes(master_pid: int) -> list[psutil.Process]:
    """The master and its workers (none when the master is gone)."""
    try:
        master = psutil.Process(master_pid)
        return [master, *master.children()]
    except psutil.Error:
        return []


def listening(procs: list[psutil.Process]) -> set[Address]:
    """The TCP addresses ``procs`` listen on."""
    found: set[Address] = set()
    for proc in procs:
        try:
            conns = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        found |= {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN and c.laddr}
    return found


def nginx_listening(master_pid: int) -> set[Address]:
    return listening(nginx_processes(master_pid))


def wanted(host: str, port: int) -> set[Address]:
    """The sockets ``listen host:port`` makes (a name: each address it resolves to)."""
    host = host.strip("[]")
    if host in ("", "*"):
        host = "0.0.0.0"
    try:
        ipaddress.ip_address(host)
        return {(host, port)}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return {(host, port)}
    return {(str(info[4][0]), port) for info in infos}


def is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def beyond_loopback(addresses: set[Address]) -> bool:
    """Other machines may reach one of ``addresses``."""
    return any(not is_loopback(ip) for ip, _ in addresses)


def describe(addresses: set[Address]) -> str:
    """``127.0.0.1:8080`` (IPv6 in brackets), several joined; ``nothing`` when empty."""
    if not addresses:
        return "nothing"
    return ", ".join(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip, port in sorted(addresses))


def config_behind(
    procs: list[psutil.Process], files: Iterable[Path], grace: float = RELOAD_GRACE, now: float | None = None
) -> float:
    """When the newest of ``files`` was written, if nginx (``procs``: master, workers) has
    started no worker since (a reload that takes starts new ones): it runs an older config.
    0.0 when it is current, or a reload may still be under way (written within ``grace``)."""
    try:
        newest, slack = max(started(p) for p in (procs[1:] or procs))
    except (psutil.Error, ValueError):  # (none, or one went away meanwhile: the next look reads it)
        return 0.0
    written = max((f.stat().st_mtime for f in files if f.exists()), default=0.0)
    now = time.time() if now is None else now
    return written if written - newest > slack and now - written >= grace else 0.0
