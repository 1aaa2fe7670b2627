"""Prometheus Operator's objects for `k8s render`: the ServiceMonitor that scrapes every pod
and the PrometheusRule that alerts on what it scrapes. Pure builders, as in
:mod:`cosyvoice_lb.launcher.k8s.objects`: each returns the object as the dict dumped to YAML.

- Each pod serves its cluster metrics at ``/metrics`` and relays each instance's at
  ``/metrics/instance-N``: one address, several paths. Prometheus Operator labels a target by
  its address (``instance``), pod, service and port, never by its path, so the relayed series
  of two instances would be the same series. Each relay's endpoint therefore sets
  :data:`INSTANCE_LABEL` (``name``, as on a box) to its instance's name.
- The PrometheusRule carries the box's alert rules
  (:func:`~cosyvoice_lb.launcher.render.prometheus.alert_groups`, the one source), in the
  scope of a pod (:func:`pod_scope`).
- With ``--alert-webhook``, an AlertmanagerConfig routes the PrometheusRule's alerts to it
  (:func:`alertmanager_config`).
- ``--monitor-label KEY=VALUE`` labels both objects, so that a Prometheus picking them with
  ``serviceMonitorSelector`` / ``ruleSelector`` finds them (:func:`parse_monitor_labels`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from cosyvoice_lb.common.alert_settings import webhook_urls
from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.k8s.objects import Deployment, labels, secret_name, selector
from cosyvoice_lb.launcher.render.alertmanager import Timing
from cosyvoice_lb.launcher.render.prometheus import RuleScope, alert_groups

# The label that tells a pod's instances apart: the one a box's Prometheus puts on an
# instance's series (its file-SD target label) and the cluster's metrics carry, so the alert
# rules and the dashboard read both alike. Not ``instance``: Prometheus gives every target
# that label (its address, here the pod's), and the operator's Prometheus tells the pods by it.
INSTANCE_LABEL = "name"

_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _metadata(deployment: Deployment) -> dict[str, Any]:
    return {
        "name": deployment.name,
        "namespace": deployment.namespace,
        "labels": {**labels(deployment), **dict(deployment.monitor_labels)},
    }


def relabelings(instance: str) -> list[dict[str, str]]:
    """A relay endpoint's relabelings: its target, hence every series scraped from it, gets
    :data:`INSTANCE_LABEL` = ``instance``."""
    return [{"action": "replace", "targetLabel": INSTANCE_LABEL, "replacement": instance}]


def service_monitor(deployment: Deployment, per_pod: int) -> dict[str, Any]:
    """The Prometheus Operator's ServiceMonitor: the pod's cluster metrics (``/metrics``) and
    each of its ``per_pod`` instances' (relayed by the pod's nginx, each labelled with its
    instance's name), with the scrape token."""

    def endpoint(path: str, instance: str = "") -> dict[str, Any]:
        token = {"name": secret_name(deployment), "key": "scrape-token"}
        found: dict[str, Any] = {
            "port": "http",
            "path": path,
            "interval": "15s",
            "authorization": {"type": "Bearer", "credentials": token},  # (its own dict: no YAML alias)
        }
        if instance:
            found["relabelings"] = relabelings(instance)
        return found

    relays = [f"instance-{i}" for i in range(per_pod)]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _metadata(deployment),
        "spec": {
            "selector": {"matchLabels": selector(deployment)},
            "endpoints": [endpoint("/metrics")] + [endpoint(f"/metrics/{name}", name) for name in relays],
        },
    }


def pod_scope(deployment: Deployment) -> RuleScope:
    """The alert rules' scope on Kubernetes. The operator's Prometheus scrapes every pod as one
    job, the Service's name, so: this deployment's series are its namespace's and job's; an
    instance's target is a relay (it has :data:`INSTANCE_LABEL`), the cluster's the pod's
    ``/metrics`` (it has none); an instance is told by its namespace, pod and name, a cluster
    (every pod of the deployment) by namespace and job; and a command to run is run in the pod
    with ``kubectl exec``."""
    namespace = deployment.namespace
    return RuleScope(
        select=f"namespace={json.dumps(namespace)},job={json.dumps(deployment.name)}",
        instance_targets=f'{INSTANCE_LABEL}!=""',
        cluster_target=f'{INSTANCE_LABEL}=""',
        instance=("namespace", "pod", INSTANCE_LABEL),
        cluster=("namespace", "job"),
        of=" of {{ $labels.pod }}",
        target="pod {{ $labels.pod }}",
        run_here=f"kubectl exec -n {namespace} {{{{ $labels.pod }}}} -- ",
        run_anywhere=f"kubectl exec -n {namespace} deploy/{deployment.name} -- ",
        token=f"the scrape token in the Secret {secret_name(deployment)}",
    )


def prometheus_rule(settings: Settings, deployment: Deployment) -> dict[str, Any]:
    """The PrometheusRule: the box's alert rules (:func:`alert_groups`) in a pod's scope."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": _metadata(deployment),
        "spec": {"groups": alert_groups(settings, pod_scope(deployment))},
    }


# The AlertmanagerConfig picks the PrometheusRule's alerts by their names (every one starts
# so, whatever its severity); the operator adds a matcher on the object's own namespace, a
# label every one of them carries.
ALERT_MATCHERS = ({"name": "alertname", "matchType": "=~", "value": "CosyVoice.+"},)


def alertmanager_config(settings: Settings, deployment: Deployment) -> dict[str, Any] | None:
    """The Prometheus Operator's AlertmanagerConfig: the PrometheusRule's alerts, firing and
    resolved, to every ``--alert-webhook`` URL, grouped and repeated as on a box (None
    without a webhook: the Alertmanager's own routes apply then)."""
    urls = webhook_urls(settings.alert_webhook)
    if not urls:
        return None
    timing = Timing()
    return {
        "apiVersion": "monitoring.coreos.com/v1alpha1",
        "kind": "AlertmanagerConfig",
        "metadata": _metadata(deployment),
        "spec": {
            "route": {
                "receiver": "webhook",
                "groupBy": ["alertname"],
                "groupWait": timing.group_wait,
                "groupInterval": timing.group_interval,
                "repeatInterval": timing.repeat_interval,
                "matchers": [dict(m) for m in ALERT_MATCHERS],
            },
            "receivers": [{"name": "webhook", "webhookConfigs": [{"url": url, "sendResolved": True} for url in urls]}],
        },
    }


def label_problem(key: str, value: str) -> str:
    """Why ``key: value`` is not a Kubernetes label ("" when it is one)."""
    prefix, slash, name = key.rpartition("/")
    if not key:
        return "its key is empty"
    if slash and not prefix:
        return f"the key {key!r} has an empty prefix before '/'"
    if slash and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return f"the key's prefix {prefix!r} is not a DNS subdomain (lower-case letters, digits, '-' and '.')"
    if len(name) > 63 or not _NAME.fullmatch(name):
        return (
            f"the key's name {name!r} is not a label name: 1 to 63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    if value and (len(value) > 63 or not _NAME.fullmatch(value)):
        return (
            f"the value {value!r} is not a label value: at most 63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit (or empty)"
        )
    return ""


def parse_monitor_labels(given: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``--monitor-label KEY=VALUE`` (repeatable) as (key, value) pairs, in the order given.
    A ClusterError (the CLI prints it, with the fix) for one that is not ``KEY=VALUE``, is no
    Kubernetes label, is one of the app's own labels, or gives a key twice with two values."""
    return parse_labels("--monitor-label", given, "e.g. --monitor-label team=audio", "")


def parse_labels(option: str, given: Iterable[str], example: str, why_own: str) -> tuple[tuple[str, str], ...]:
    """``option KEY=VALUE`` (repeatable) as (key, value) pairs, in the order given; a
    ClusterError saying the fix (``example``) for one that is not ``KEY=VALUE``, is no
    Kubernetes label, is one of the app's own (``why_own`` says what that would break), or
    gives a key twice with two values."""
    found: dict[str, str] = {}
    for text in given:
        key, eq, value = (part.strip() for part in text.partition("="))
        if not eq:
            raise ClusterError(f"{option} {text!r} has no '=': give KEY=VALUE, {example}")
        problem = label_problem(key, value)
        if problem:
            raise ClusterError(f"{option} {text!r}: {problem}; {example}")
        if key in labels(Deployment()):
            raise ClusterError(f"{option} {text!r}: {key} is the app's own label{why_own}; choose another key")
        if found.get(key, value) != value:
            raise ClusterError(f"{option} {key} is given twice ({found[key]!r} and {value!r}): give it once")
        found[key] = value
    return tuple(found.items())
