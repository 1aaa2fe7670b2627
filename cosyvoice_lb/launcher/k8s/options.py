"""`k8s render`'s own options: TLS, client addresses, the pod's size and where it runs
(:func:`pod_options`), and --schedule's KEDA ScaledObject (:func:`keda_options`); and the
:class:`~cosyvoice_lb.launcher.k8s.objects.Deployment` fields they become (:func:`pod_fields`,
which refuses a malformed value with the fix, and :func:`keda_fields`). The settings `up`
takes (--trusted-proxies, --host-memory-per-instance among them) come from their
declarations, as for every command.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import click

from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.k8s.objects import Deployment
from cosyvoice_lb.launcher.k8s.scheduling import (
    ANTI_AFFINITIES,
    PULL_POLICIES,
    TOLERATION_SYNTAX,
    parse_node_selector,
    parse_tolerations,
)

DEFAULTS = Deployment()
OPTIONS = [
    click.option(
        "--tls-secret",
        default="",
        metavar="NAME",
        help="A kubernetes.io/tls Secret for --ingress-host (needs it): both Ingresses serve HTTPS with it and "
        "redirect plain HTTP there.",
    ),
    click.option(
        "--pod-cidr",
        default=DEFAULTS.pod_cidr,
        show_default=True,
        metavar="CIDR",
        help="The cluster's pod network, where the ingress controller's pods are: the pod's nginx takes the "
        "client's address from their X-Forwarded-For (its --trusted-proxies, unless those are given; '' for none).",
    ),
    click.option(
        "--cpu-per-instance",
        default=0.0,
        type=click.FloatRange(min=0),
        metavar="N",
        help="Cores one instance takes, for the pod's CPU (default: the engine's: cosyvoice3 2, espeak 1, "
        "simulated 0.25).",
    ),
    click.option(
        "--node-selector",
        multiple=True,
        metavar="KEY=VALUE",
        help="Run pods only on nodes with this label (repeatable).",
    ),
    click.option(
        "--toleration",
        multiple=True,
        metavar="SPEC",
        help=f"Tolerate a node taint, written {TOLERATION_SYNTAX} (no VALUE: any value; no EFFECT: every effect; "
        "repeatable).",
    ),
    click.option(
        "--anti-affinity",
        default=DEFAULTS.anti_affinity,
        show_default=True,
        type=click.Choice(ANTI_AFFINITIES),
        help="One pod per host: preferred, or required (a roll-out's extra pod then needs a host without one).",
    ),
    click.option(
        "--image-pull-policy",
        default=DEFAULTS.image_pull_policy,
        show_default=True,
        type=click.Choice(PULL_POLICIES),
        help="When the kubelet pulls --image.",
    ),
]
NAMES = (
    "tls_secret",
    "pod_cidr",
    "cpu_per_instance",
    "node_selector",
    "toleration",
    "anti_affinity",
    "image_pull_policy",
)


def pod_options(command: Callable) -> Callable:
    """The options, on `k8s render`."""
    for option in reversed(OPTIONS):
        command = option(command)
    return command


def pod_fields(values: dict[str, Any]) -> dict[str, Any]:
    """The Deployment's fields from the options (taken out of ``values``); a ClusterError with
    the fix for a node selector or a toleration that cannot work."""
    given = {name: values.pop(name) for name in NAMES if name in values}
    try:
        node_selector = parse_node_selector(given.pop("node_selector", ()))
        tolerations = parse_tolerations(given.pop("toleration", ()))
    except ValueError as exc:
        raise ClusterError(str(exc)) from None
    return {**given, "node_selector": node_selector, "tolerations": tolerations}


# --- --schedule's KEDA ScaledObject (k8s/scaling.py) ---

KEDA_OPTIONS = [
    click.option(
        "--timezone",
        default=DEFAULTS.timezone,
        show_default=True,
        metavar="ZONE",
        help="With --schedule: the IANA time zone of its times (KEDA's cron triggers).",
    ),
    click.option(
        "--prometheus-url",
        default=DEFAULTS.prometheus_url,
        show_default=True,
        metavar="URL",
        help="With --schedule: the Prometheus KEDA asks for the requests waiting per pod.",
    ),
]


def keda_options(command: Callable) -> Callable:
    """`k8s render`'s --timezone and --prometheus-url."""
    for option in reversed(KEDA_OPTIONS):
        command = option(command)
    return command


def keda_fields(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The Deployment fields of :func:`keda_options`' values (checked where the ScaledObject is built)."""
    return {"timezone": kwargs["timezone"], "prometheus_url": kwargs["prometheus_url"]}
