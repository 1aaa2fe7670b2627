"""The cluster's Alertmanager (``--alertmanager``): its config, and how supervisord runs it.

Pure, like ``render``: every function returns text or a command and writes nothing. The
rendered ``prometheus.yml`` sends its alerts to :func:`alertmanager_target`; Alertmanager
sends them on to the receivers of ``alertmanager.yml`` (a webhook, email), firing and
resolved. It listens on loopback only, with its gossip port off: one box, one Alertmanager.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass

from cosyvoice_lb.common.alert_settings import email_addresses, webhook_urls
from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.render.templates import supervisor_env, template_environment
from cosyvoice_lb.launcher.state.layout import Layout

# The environment variable of the program that carries its config's digest: a changed config
# is a changed program, which `up` restarts (supervisord compares programs, not the files they read).
CONFIG_DIGEST = "COSYVOICE_LB_ALERTMANAGER_CONFIG"


@dataclass(frozen=True)
class Timing:
    """How Alertmanager groups and repeats notifications (its route's intervals)."""

    group_wait: str = "30s"  # a new group's first notification waits for its other alerts this long
    group_interval: str = "5m"  # news of a group (a new alert, a resolved one) at most this often
    repeat_interval: str = "4h"  # a group still firing is sent again this often


@dataclass(frozen=True)
class Email:
    to: str
    sender: str
    smarthost: str
    user: str
    password_file: str


def alertmanager_target(settings: Settings) -> str:
    """``host:port`` at which Prometheus on this box reaches the cluster's Alertmanager."""
    return f"127.0.0.1:{settings.alertmanager_port}"


def email_of(settings: Settings) -> Email | None:
    if not settings.alert_email_to:
        return None
    return Email(
        to=", ".join(email_addresses(settings.alert_email_to)),
        sender=settings.alert_email_from,
        smarthost=settings.alert_smtp,
        user=settings.alert_smtp_user,
        password_file=settings.alert_smtp_password_file,
    )


def alertmanager_config(settings: Settings, timing: Timing = Timing()) -> str:
    """alertmanager.yml: one route, one receiver with every webhook URL and the email, if any.
    The mail password is read by Alertmanager from its 0600 file, never written here."""
    env = template_environment()
    env.filters["yq"] = lambda value: json.dumps(str(value))  # a JSON string is a YAML scalar
    return env.get_template("alertmanager.yml.j2").render(
        webhooks=webhook_urls(settings.alert_webhook), email=email_of(settings), timing=timing
    )


def alertmanager_command(binary: str, settings: Settings, layout: Layout) -> list[str]:
    """Alertmanager as supervisord runs it: loopback only, no cluster gossip, its data in the
    state dir."""
    return [
        binary,
        f"--config.file={layout.alertmanager_yml}",
        f"--storage.path={layout.alertmanager_data}",
        f"--web.listen-address={alertmanager_target(settings)}",
        f"--web.external-url=http://{alertmanager_target(settings)}/",
        "--cluster.listen-address=",
    ]


def alertmanager_env(config: str) -> dict[str, str]:
    """The program's environment: the digest of its config (see :data:`CONFIG_DIGEST`)."""
    return {CONFIG_DIGEST: hashlib.sha256(config.encode()).hexdigest()[:16]}


def alertmanager_program(settings: Settings, layout: Layout, binary: str) -> dict[str, str] | None:
    """What supervisord.conf's ``[program:alertmanager]`` says: its command and environment
    (None without --alertmanager)."""
    if not settings.alertmanager:
        return None
    return {
        "command": shlex.join(alertmanager_command(binary, settings, layout)),
        "environment": supervisor_env(alertmanager_env(alertmanager_config(settings))),
    }
