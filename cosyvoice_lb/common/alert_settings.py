"""Where the alerts go: the box's own Alertmanager (``--alertmanager``) and its receivers, a
webhook and/or email; `k8s render` routes the PrometheusRule's alerts to the same webhook.
Standard library only: the instance imports it with the settings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from cosyvoice_lb.common.checks import private_file, tcp_port
from cosyvoice_lb.common.declaration import setting

# Between the webhook URLs in one value (COSYVOICE_LB_ALERT_WEBHOOK, cluster.json): a URL
# holds no space.
WEBHOOK_SEPARATOR = " "
_ADDRESS = re.compile(r"[^@\s,<>]+@[^@\s,<>]+")
_HOST_PORT = re.compile(r"[A-Za-z0-9.-]+:[0-9]{1,5}|\[[0-9A-Fa-f:.]+\]:[0-9]{1,5}")


def webhook_urls(value: str) -> list[str]:
    """The webhook URLs of ``--alert-webhook`` (given once per URL)."""
    return [part for part in value.split(WEBHOOK_SEPARATOR) if part]


def email_addresses(value: str) -> list[str]:
    """The addresses of ``--alert-email-to`` (comma-separated)."""
    return [part.strip() for part in value.split(",") if part.strip()]


def webhook_check(flag: str, value: Any) -> str:
    for url in webhook_urls(value):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return f"{flag} {url!r} is not an http(s) URL: give one like http://127.0.0.1:9000/alerts"
    return ""


def email_check(flag: str, value: Any) -> str:
    for address in email_addresses(value):
        if not _ADDRESS.fullmatch(address):
            return f"{flag} {address!r} is not an email address: give one like ops@example.org"
    return ""


def smarthost_check(flag: str, value: Any) -> str:
    if value == "" or _HOST_PORT.fullmatch(value):
        return ""
    return f"{flag} {value!r} is not HOST:PORT: give the mail server like smtp.example.org:587"


@dataclass(frozen=True)
class AlertSettings:
    """The alerts' way to a person: an Alertmanager the cluster runs, and where it sends."""

    alertmanager: bool = setting(
        False,
        "Run Alertmanager (Debian's prometheus-alertmanager) as a cluster program on 127.0.0.1:--alertmanager-port, "
        "its data in the state dir; the rendered prometheus.yml sends its alerts there. Needs a receiver: "
        "--alert-webhook or --alert-email-to.",
        is_flag=True,
    )
    alertmanager_port: int = setting(
        9093, "The port the cluster's Alertmanager listens on (127.0.0.1).", type=int, check=tcp_port
    )
    alert_webhook: str = setting(
        "",
        "Send alerts (firing and resolved) to this http(s) URL, Alertmanager's webhook JSON (repeatable; in the "
        "environment variable, URLs separated by spaces). With `k8s render`: an AlertmanagerConfig routes the "
        "PrometheusRule's alerts there.",
        metavar="URL",
        check=webhook_check,
        separator=WEBHOOK_SEPARATOR,
    )
    alert_email_to: str = setting(
        "",
        "Mail alerts to these addresses (comma-separated); needs --alert-smtp and --alert-email-from.",
        metavar="ADDRESSES",
        check=email_check,
    )
    alert_email_from: str = setting("", "The From address of alert mail.", metavar="ADDRESS", check=email_check)
    alert_smtp: str = setting(
        "",
        "The mail server alert mail goes through, HOST:PORT; Alertmanager asks it for STARTTLS.",
        metavar="HOST:PORT",
        check=smarthost_check,
    )
    alert_smtp_user: str = setting("", "The user name alert mail logs in to the mail server with.", metavar="USER")
    alert_smtp_password_file: str = setting(
        "",
        "A file (0600) holding the mail server's password for --alert-smtp-user; Alertmanager reads it from there "
        "(never on a command line or in a rendered config).",
        metavar="FILE",
        check=private_file,
    )


def alert_contradictions(settings: AlertSettings) -> list[str]:
    """Alert settings that each can work, but not together."""
    found = []
    if settings.alertmanager and not (settings.alert_webhook or settings.alert_email_to):
        found.append(
            "--alertmanager needs somewhere to send alerts: add --alert-webhook URL or --alert-email-to ADDRESS "
            "(with --alert-smtp and --alert-email-from)"
        )
    if settings.alert_email_to and not (settings.alert_smtp and settings.alert_email_from):
        found.append("--alert-email-to needs --alert-smtp HOST:PORT and --alert-email-from ADDRESS")
    if settings.alert_smtp_password_file and not settings.alert_smtp_user:
        found.append("--alert-smtp-password-file needs --alert-smtp-user: the user the password is for")
    return found
