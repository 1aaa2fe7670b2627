"""Where nginx listens, written as its config and this box's clients need it."""

from __future__ import annotations

from cosyvoice_lb.common.settings import Settings


def listen_address(host: str, port: int) -> str:
    """nginx's ``listen`` argument: IPv6 addresses go in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def balancer_url(settings: Settings) -> str:
    """nginx as an instance on this box reaches it (long texts' segments go there)."""
    host = settings.listen_host
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "::1"
    return f"http://{listen_address(host, settings.port)}"
