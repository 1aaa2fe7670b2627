"""Who may reach the pods, and the pods' own labels: `k8s render --network-policy` writes a
NetworkPolicy (networking.k8s.io/v1) for this deployment's pods, and ``--pod-label KEY=VALUE``
labels the pod template. Pure, as the other builders: the options (:func:`network_options`),
the Deployment fields they become (:func:`network_fields`, which refuses a malformed value
with the fix) and the object (:func:`network_policy`).

The pod serves everything on one port, its nginx's (:data:`~cosyvoice_lb.launcher.k8s.objects.PORT`):
the API, the UI and the metrics Prometheus scrapes (``/metrics`` and each instance's relay).
So the policy lets in that port only, from two namespaces, picked by the label Kubernetes puts
on every namespace (``kubernetes.io/metadata.name``): the ingress controller's and the
monitoring one's. Without it any pod of the cluster network could reach the pods' nginx, and
name a client for itself in X-Forwarded-For (``--pod-cidr`` is trusted). Out of the pods: DNS,
and the jobs' Redis when the pods share one (its port; its address is not known here).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import click

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.k8s.jobs import redis_ref
from cosyvoice_lb.launcher.k8s.monitoring import parse_labels
from cosyvoice_lb.launcher.k8s.objects import PORT, Deployment, _meta, labels, selector

NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set by Kubernetes on every namespace (1.21 and later)
DNS_PORT = 53
REDIS_PORT = 6379  # a redis:// URL's own default; the port of --jobs-redis's URL when it names one
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
LABEL_EXAMPLE = "e.g. --pod-label cost-center=tts"

OPTIONS = [
    click.option(
        "--network-policy",
        is_flag=True,
        help="Write networkpolicy.yaml: the pods take connections on their port only from --ingress-namespace "
        "and --monitoring-namespace, and connect out only to DNS (and the jobs' Redis).",
    ),
    click.option(
        "--ingress-namespace",
        default=Deployment().ingress_namespace,
        show_default=True,
        metavar="NAMESPACE",
        help="With --network-policy: the ingress controller's namespace, whose pods reach the pods' nginx.",
    ),
    click.option(
        "--monitoring-namespace",
        default=Deployment().monitoring_namespace,
        show_default=True,
        metavar="NAMESPACE",
        help="With --network-policy: Prometheus's namespace, whose pods scrape the pods ('' for none).",
    ),
    click.option(
        "--pod-label",
        multiple=True,
        metavar="KEY=VALUE",
        help="Label the pods (their template only, never a selector), e.g. for cost attribution (repeatable).",
    ),
]
NAMES = ("network_policy", "ingress_namespace", "monitoring_namespace", "pod_label")


def network_options(command: Callable) -> Callable:
    """`k8s render`'s --network-policy, --ingress-namespace, --monitoring-namespace and --pod-label."""
    for option in reversed(OPTIONS):
        command = option(command)
    return command


def parse_pod_labels(given: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``--pod-label KEY=VALUE`` (repeatable) as (key, value) pairs, in the order given; a
    ClusterError with the fix for one that is not ``KEY=VALUE``, is no Kubernetes label, is one
    of the app's own (the selector's: changing it would orphan the pods), or gives a key twice
    with two values."""
    return parse_labels("--pod-label", given, LABEL_EXAMPLE, ", which the Deployment selects its pods by")


def namespace_problem(option: str, name: str, may_be_empty: bool) -> str:
    """Why ``name`` cannot be a namespace's name ("" when it can)."""
    if not name:
        if may_be_empty:
            return ""
        return f"{option} '' would let no client reach the pods: give the ingress controller's namespace"
    if len(name) > 63 or not _DNS_LABEL.fullmatch(name):
        return (
            f"{option} {name!r} is not a namespace's name (1 to 63 lower-case letters, digits and '-', starting "
            "and ending with a letter or digit)"
        )
    return ""


def network_fields(values: dict[str, Any]) -> dict[str, Any]:
    """The Deployment's fields of :func:`network_options` (taken out of ``values``); a
    ClusterError with the fix for a malformed one."""
    given = {name: values.pop(name) for name in NAMES if name in values}
    ingress = given.get("ingress_namespace", Deployment().ingress_namespace).strip()
    monitoring = given.get("monitoring_namespace", Deployment().monitoring_namespace).strip()
    problem = namespace_problem("--ingress-namespace", ingress, may_be_empty=False) or namespace_problem(
        "--monitoring-namespace", monitoring, may_be_empty=True
    )
    if problem:
        raise ClusterError(problem)
    return {
        "network_policy": bool(given.get("network_policy", False)),
        "ingress_namespace": ingress,
        "monitoring_namespace": monitoring,
        "pod_labels": parse_pod_labels(given.get("pod_label", ())),
    }


def pod_template_labels(deployment: Deployment) -> dict[str, str]:
    """The pod template's labels: every object's (:func:`labels`), then --pod-label's."""
    return {**labels(deployment), **dict(deployment.pod_labels)}


def redis_port(settings: Settings) -> int:
    """The port the pods reach the jobs' Redis on: its URL's when it is given here, else Redis's own."""
    try:
        return urlsplit(settings.jobs_redis).port or REDIS_PORT
    except ValueError:  # (a malformed URL is the setting's check's to refuse)
        return REDIS_PORT


def _from(namespace: str) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: namespace}}}


def network_policy(settings: Settings, deployment: Deployment) -> dict[str, Any]:
    """The NetworkPolicy: in, the pod's port from the ingress controller's namespace and the
    monitoring one's; out, DNS (UDP and TCP) and, with a shared jobs' store, Redis's port."""
    port = [{"protocol": "TCP", "port": PORT}]
    sources = [
        deployment.ingress_namespace,
        *([deployment.monitoring_namespace] * bool(deployment.monitoring_namespace)),
    ]
    egress: list[dict[str, Any]] = [
        {"ports": [{"protocol": "UDP", "port": DNS_PORT}, {"protocol": "TCP", "port": DNS_PORT}]}
    ]
    if redis_ref(settings, deployment) is not None:
        egress.append({"ports": [{"protocol": "TCP", "port": redis_port(settings)}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(deployment),
        "spec": {
            "podSelector": {"matchLabels": selector(deployment)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [_from(namespace) for namespace in sources], "ports": port}],
            "egress": egress,
        },
    }


def policy_header(settings: Settings, deployment: Deployment) -> str:
    """networkpolicy.yaml's header: what it lets in and out, and why."""
    monitoring = deployment.monitoring_namespace
    redis = redis_ref(settings, deployment) is not None
    return (
        f"# Only the ingress controller's pods (namespace {deployment.ingress_namespace})"
        + (f" and Prometheus's (namespace {monitoring})" if monitoring else "")
        + f" reach the pods, on nginx's port {PORT}\n"
        "# (the API, the UI and /metrics): no other pod can name a client for itself in X-Forwarded-For.\n"
        f"# Out: DNS (port {DNS_PORT})"
        + (
            f" and the jobs' Redis (port {redis_port(settings)}, any address: its own is not known here)"
            if redis
            else ""
        )
        + ".\n# The kubelet's probes come from the node, which most network plugins let through whatever the policy;\n"
        "# NetworkPolicies add up: allow more with a policy of your own beside this one."
    )


def policy_file(
    settings: Settings, deployment: Deployment, dump: Callable[[dict[str, Any], str], str]
) -> Mapping[str, str]:
    """``{"networkpolicy.yaml": text}`` with --network-policy, else nothing."""
    if not deployment.network_policy:
        return {}
    return {"networkpolicy.yaml": dump(network_policy(settings, deployment), policy_header(settings, deployment))}
