"""HTTP to the instances on 127.0.0.1: ``/ping`` read into a :class:`Probe` (the health
loop judges it), or as plain JSON (``status``).

A :class:`Prober` keeps one keep-alive connection per instance: its connection pools are
sized for the instance count, since requests' default keeps ten and, probed round-robin,
more than ten instances would evict each other's pools every round (a fresh connection per
probe, and a window where a probe finds its pool closed under it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from cosyvoice_lb.common.names import StrEnum


class ProbeStatus(StrEnum):
    """What one ``/ping`` says of an instance (as the health loop's log shows it)."""

    READY = "ready"
    LOADING = "loading"  # 503 while the model loads
    BAD_AUDIO = "bad_audio"  # 503: its warm-up or a canary made bad audio
    FAILED = "failed"  # no answer, or one that is not a well-formed /ping


@dataclass(frozen=True)
class Probe:
    """One ``/ping``: ``ready``, ``loading`` (503 while the model loads), ``bad_audio`` (503:
    its warm-up or a canary made bad audio; ``detail`` says how) or ``failed``."""

    status: ProbeStatus  # (a status given as its text is read as that member)
    busy_seconds: float = 0.0
    detail: str = ""
    served: int = 0
    inflight: int = 0
    waiting: int = 0
    sessions: int = 0  # of inflight: streaming sessions (the instance's own drain closes them)
    stalled: tuple[float, ...] = ()  # per synthesis in flight: seconds since its last chunk

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", ProbeStatus(self.status))

    @property
    def stalled_seconds(self) -> float:
        return max(self.stalled, default=0.0)

    def progressing(self, hang_timeout: float) -> int:
        """Syntheses in flight that are still making progress (not hung)."""
        return sum(1 for s in self.stalled if s <= hang_timeout)


def loopback_session(instances: int = 10) -> requests.Session:
    """HTTP to 127.0.0.1 only: no proxies from the environment (they would see no instance),
    and a connection pool per instance kept (``instances``: how many are asked)."""
    session = requests.Session()
    session.trust_env = False
    adapter = HTTPAdapter(pool_connections=max(10, instances), pool_maxsize=4)
    session.mount("http://", adapter)
    return session


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_ping(status_code: int, body: Any) -> Probe:
    """Judge one ``/ping`` answer. Anything but a well-formed one counts as failed."""
    if not isinstance(body, dict):
        return Probe(ProbeStatus.FAILED, detail=f"/ping answered {status_code}")
    if status_code == 200 and body.get("ready") is True:
        busy, stalled = body.get("busy_seconds", 0.0), body.get("stalled_seconds", [])
        if not _number(busy):
            return Probe(ProbeStatus.FAILED, detail=f"/ping answered busy_seconds={busy!r}, not a number")
        if not isinstance(stalled, list) or not all(_number(s) for s in stalled):
            return Probe(
                ProbeStatus.FAILED, detail=f"/ping answered stalled_seconds={stalled!r}, not a list of numbers"
            )
        counts = [body.get(k, 0) for k in ("served", "inflight", "waiting", "sessions")]
        served, inflight, waiting, sessions = (
            int(c) if isinstance(c, int) and not isinstance(c, bool) else 0 for c in counts
        )
        return Probe(
            ProbeStatus.READY,
            busy_seconds=float(busy),
            served=served,
            inflight=inflight,
            waiting=waiting,
            sessions=sessions,
            stalled=tuple(float(s) for s in stalled),
        )
    if status_code == 503 and body.get("state") == "loading":
        return Probe(ProbeStatus.LOADING)
    if status_code == 503 and body.get("state") == "bad-audio":
        error = body.get("error")
        return Probe(ProbeStatus.BAD_AUDIO, detail=error[:300] if isinstance(error, str) and error else "bad audio")
    return Probe(ProbeStatus.FAILED, detail=f"/ping answered {status_code}")


class Prober:
    """``/ping`` of the instances on 127.0.0.1, safe to call from one thread per instance."""

    def __init__(self, instances: int = 10, session: requests.Session | None = None):
        self.session = session or loopback_session(instances)

    def ping(self, port: int, timeout: float) -> dict:
        """The /ping body ({} when it does not answer with one)."""
        try:
            body = self.session.get(f"http://127.0.0.1:{port}/ping", timeout=timeout).json()
        except (requests.RequestException, ValueError):
            return {}
        return body if isinstance(body, dict) else {}

    def probe(self, port: int, timeout: float) -> Probe:
        try:
            response = self.session.get(f"http://127.0.0.1:{port}/ping", timeout=timeout)
        except requests.Timeout:
            return Probe(ProbeStatus.FAILED, detail=f"/ping did not answer within {timeout:g}s")
        except requests.RequestException as exc:
            return Probe(ProbeStatus.FAILED, detail=f"/ping: {type(exc).__name__}")
        try:
            body = response.json()
        except ValueError:
            body = None
        return read_ping(response.status_code, body)

    def get_status(self, url: str, timeout: float) -> int:
        """The HTTP status of ``url`` (0: no answer)."""
        try:
            return self.session.get(url, timeout=timeout).status_code
        except requests.RequestException:
            return 0


def probe(port: int, timeout: float) -> Probe:
    """One probe with a fresh prober (tests, one-off checks)."""
    return Prober(1).probe(port, timeout)
