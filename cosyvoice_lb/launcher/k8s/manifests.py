"""Kubernetes manifests: each pod owns one GPU and runs the launcher (`up --foreground`),
which plans and supervises the instances that fit on that GPU; Kubernetes spreads the pods
over hosts and scales them.

Pure: :func:`manifests` returns ``{file name: YAML text}`` from the same settings as `up`
(they reach the pod as its ``COSYVOICE_LB_*`` environment) and the deployment's own
options; the command writes them. This module computes what the objects share (the
instances per pod, the grace period, the tokens) and assembles the files from the builders
in :mod:`cosyvoice_lb.launcher.k8s.objects`, :mod:`~cosyvoice_lb.launcher.k8s.pod`,
:mod:`~cosyvoice_lb.launcher.k8s.ingress` and :mod:`cosyvoice_lb.launcher.k8s.monitoring`.
Every timing a probe or the grace period uses is derived there or here, with its arithmetic
in the file it lands in.
"""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path
from typing import Any

import yaml

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.common.networks import parse_networks
from cosyvoice_lb.common.schedule import parse_schedule
from cosyvoice_lb.common.setting_errors import setting_errors
from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.sizes import SizeError, parse_size
from cosyvoice_lb.common.timeouts import Timeouts
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.k8s.ingress import api_ingress, tls_problem, ui_ingress
from cosyvoice_lb.launcher.k8s.jobs import jobs_problem, written_url
from cosyvoice_lb.launcher.k8s.monitoring import alertmanager_config, prometheus_rule, service_monitor
from cosyvoice_lb.launcher.k8s.network import policy_file
from cosyvoice_lb.launcher.k8s.objects import (
    PRE_STOP_SECONDS,
    Deployment,
    adapter_config,
    adapter_config_name,
    adapter_rules,
    autoscaler,
    disruption_budget,
    service,
    token_secret,
    volume_claim,
)
from cosyvoice_lb.launcher.k8s.pod import deployment_object
from cosyvoice_lb.launcher.k8s.scaling import header as scaling_header
from cosyvoice_lb.launcher.k8s.scaling import scaled_object
from cosyvoice_lb.launcher.k8s.sizing import PodSize, pod_size
from cosyvoice_lb.launcher.plan.footprint import budget_for, parse_instances
from cosyvoice_lb.launcher.plan.planner import Gpu, Inventory, PlanError, plan
from cosyvoice_lb.launcher.render.credentials import given_tokens
from cosyvoice_lb.launcher.state.layout import layout_for

__all__ = [
    "PRE_STOP_SECONDS",
    "Deployment",
    "grace_seconds",
    "instances_per_pod",
    "manifests",
    "write_manifests",
]


def instances_per_pod(settings: Settings, deployment: Deployment) -> int:
    """How many instances one pod's GPU holds: every slot its `up` plans (as `plan --gpus` would),
    spares and surge slots included, for they run too."""
    memory = parse_size(deployment.gpu_memory)
    box = Inventory(
        gpus=(Gpu(0, memory, memory, "pod GPU"),),
        cpu_cores=8,
        ram_total=64 * 2**30,
        ram_available=64 * 2**30,
        source="k8s render",
    )
    budget, _ = budget_for(settings, layout_for(settings))  # (a footprint calibrated here counts)
    planned = plan(
        box,
        budget,
        instances=parse_instances(settings.instances),
        force=settings.force,
        spares=settings.spares,
        surge=settings.surge,
        min_instances=settings.min_instances,
    )
    return len(planned.slots)


def grace_seconds(settings: Settings) -> tuple[int, str]:
    """terminationGracePeriodSeconds, and its arithmetic as a comment."""
    timeouts = Timeouts(settings)
    parts = [
        (PRE_STOP_SECONDS, "preStop: the pod leaves the Service's endpoints everywhere"),
        (10, "the health loop stops (its stopwaitsecs)"),
        (timeouts.supervisord_stop_wait, "the instances drain their requests (--drain-timeout + 5, in parallel)"),
        (15, "nginx's graceful QUIT"),
        (10, "slack"),
    ]
    total = sum(p for p, _ in parts)
    lines = [f"#   {p:>4} s  {what}" for p, what in parts] + [f"#   {total:>4} s  terminationGracePeriodSeconds"]
    return total, "\n".join(lines)


def _secrets(deployment: Deployment) -> tuple[str, str, str]:
    api = "\n".join(deployment.api_tokens) or secrets.token_urlsafe(32)
    admin = "\n".join(deployment.admin_tokens) or secrets.token_urlsafe(32)
    return api + "\n", admin + "\n", (deployment.scrape_token or secrets.token_urlsafe(32)) + "\n"


def _dump(document: dict[str, Any], header: str = "") -> str:
    return (header + "\n" if header else "") + yaml.safe_dump(document, sort_keys=False, width=120)


class _FilesDumper(yaml.SafeDumper):
    """Writes a multi-line string (a file's text in a ConfigMap) as a literal block, as it reads."""


_FilesDumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def _dump_files(document: dict[str, Any], header: str) -> str:
    return header + "\n" + yaml.dump(document, Dumper=_FilesDumper, sort_keys=False, width=120)


def _deployment_header(deployment: Deployment, size: PodSize, arithmetic: str) -> str:
    return (
        f"# {deployment.name}: one GPU per pod; the launcher inside runs the {size.instances} instance(s) that fit on "
        f"it\n# ({deployment.gpu_memory} planned), nginx and the health loop, as `cosyvoice-lb up` does on a box.\n"
        "# SIGTERM drains: the pod is out of the Service first (preStop), then every instance finishes\n"
        "# its requests (--drain-timeout) before the launcher exits. terminationGracePeriodSeconds:\n"
        + arithmetic
        + "\n# Resources: requests = limits (QoS Guaranteed), the instances x host memory per instance\n"
        "# (--host-memory-per-instance, else the engine's) and x CPU per instance (--cpu-per-instance, else the\n"
        "# engine's), plus what runs beside them; `up` refuses to plan more instances than this memory holds.\n"
        + size.arithmetic()
    )


ADAPTER_HEADER = """# Prometheus Adapter's config (the file it reads with --config: its `rules:`), as a ConfigMap so that
# `kubectl apply -f DIR` takes every file. Its rule: the requests waiting for an engine, summed per pod,
# as the custom metric cosyvoice_queue_depth the HPA (hpa.yaml) scales on. Give it to the adapter either way:
# - the prometheus-community/prometheus-adapter chart mounts it as the adapter's config, from the adapter's
#   own namespace (set metadata.namespace to it first):
#     helm upgrade --install prometheus-adapter prometheus-community/prometheus-adapter -n NAMESPACE \\
#       --set rules.existing={name}
# - or add the rule (the list under config.yaml's `rules:`) to the chart's `rules.custom` in its values
#   (`helm ... -f values.yaml`), or to your adapter's own config."""


def manifests(settings: Settings, deployment: Deployment) -> dict[str, str]:
    """Every manifest, keyed by its file name (apply them with ``kubectl apply -f DIR``)."""
    per_pod = instances_per_pod(settings, deployment)
    size = pod_size(settings, per_pod, deployment.cpu_per_instance)
    grace, arithmetic = grace_seconds(settings)
    api, admin, scrape = _secrets(deployment)
    url = written_url(settings, deployment)
    return {
        "secret.yaml": _dump(
            token_secret(deployment, api, admin, scrape, url),
            "# The API tokens, the control panel's admin tokens and the token Prometheus scrapes with"
            + (";\n# jobs-redis: --jobs-redis's URL, which the pods read as COSYVOICE_LB_JOBS_REDIS" if url else ".")
            + "\n# A secret: this file is written 0600; keep it out of version control.",
        ),
        "volumes.yaml": _dump(
            volume_claim(deployment, "voices", deployment.voices_size),
            "# Saved voices: one registry every pod reads and writes (ReadWriteMany).",
        )
        + "---\n"
        + _dump(volume_claim(deployment, "outputs", deployment.outputs_size), "# Results: a dir per pod."),
        "deployment.yaml": _dump(
            deployment_object(settings, deployment, grace, size), _deployment_header(deployment, size, arithmetic)
        ),
        "service.yaml": _dump(service(deployment)),
        "ingress.yaml": _dump(
            ui_ingress(settings, deployment),
            "# The UI sticks to a pod by cookie; the API (/v1) is balanced request by request.",
        )
        + "---\n"
        + _dump(api_ingress(settings, deployment)),
        **_autoscaler_file(settings, deployment),
        **policy_file(settings, deployment, _dump),  # --network-policy's networkpolicy.yaml
        "pdb.yaml": _dump(disruption_budget(deployment), "# A node drain takes one pod at a time."),
        "servicemonitor.yaml": _dump(
            service_monitor(deployment, per_pod),
            "# Prometheus Operator: the pod's cluster metrics and each instance's (relayed by the pod's nginx,\n"
            "# each labelled name: instance-N, as on a box, so that two instances' series never collide).",
        ),
        "prometheusrule.yaml": _dump(
            prometheus_rule(settings, deployment),
            "# Prometheus Operator: the box's alert rules (its alerts.yml), for this deployment's pods.",
        ),
        **_alerting_file(settings, deployment),
        "prometheus-adapter-rules.yaml": _dump_files(
            adapter_config(deployment, yaml.safe_dump(adapter_rules(), sort_keys=False, width=120)),
            ADAPTER_HEADER.format(name=adapter_config_name(deployment)),
        ),
    }


def _alerting_file(settings: Settings, deployment: Deployment) -> dict[str, str]:
    found = alertmanager_config(settings, deployment)
    if found is None:
        return {}
    header = (
        "# Prometheus Operator: the PrometheusRule's alerts, firing and resolved, to --alert-webhook. An Alertmanager\n"
        "# takes it when its alertmanagerConfigSelector matches these labels (see --monitor-label)."
    )
    return {"alertmanagerconfig.yaml": _dump(found, header)}


AUTOSCALER_FILES = ("hpa.yaml", "scaledobject.yaml")  # one of them: --schedule's KEDA ScaledObject, else the HPA


def _autoscaler_file(settings: Settings, deployment: Deployment) -> dict[str, str]:
    schedule = parse_schedule(settings.schedule)
    if schedule:
        return {"scaledobject.yaml": _dump(scaled_object(deployment, schedule), scaling_header(schedule, deployment))}
    return {
        "hpa.yaml": _dump(
            autoscaler(deployment),
            "# Scales on requests waiting per pod (Prometheus Adapter's config: prometheus-adapter-rules.yaml) and CPU.",
        )
    }


def deployment_problem(deployment: Deployment) -> str:
    """What is wrong with the deployment's own options ("" when nothing)."""
    try:
        parse_networks(deployment.pod_cidr)
    except ValueError as exc:
        return f"--pod-cidr: {exc}"
    return tls_problem(deployment)


def write_manifests(settings: Settings, deployment: Deployment, out_dir: str) -> list[Path]:
    """Write :func:`manifests` into ``out_dir`` (atomically; the Secret 0600). Token files
    given with --api-token-file / --admin-token-file fill the Secret; else tokens are made."""
    found = [p for p in setting_errors(settings) if "--api-token-file" not in p and "--admin-token-file" not in p]
    if found:
        raise ClusterError(found[0])
    problem = deployment_problem(deployment) or jobs_problem(settings, deployment)
    if problem:
        raise ClusterError(problem)
    try:  # (the same reading, and refusals, as `up`'s)
        api = given_tokens(settings.api_token_file, "--api-token-file")
        admin = given_tokens(settings.admin_token_file, "--admin-token-file")
    except ValueError as exc:
        raise ClusterError(str(exc)) from None
    try:
        files = manifests(settings, dataclasses.replace(deployment, api_tokens=tuple(api), admin_tokens=tuple(admin)))
    except (PlanError, SizeError) as exc:
        raise ClusterError(str(exc)) from None
    out = Path(out_dir)
    written = []
    for name, text in files.items():
        write_atomic(out / name, text, mode=0o600 if name == "secret.yaml" else 0o644)
        written.append(out / name)
    for stale in set(AUTOSCALER_FILES) - set(files):  # (a render before, with or without --schedule)
        (out / stale).unlink(missing_ok=True)  # two autoscalers on one Deployment would fight
    if "networkpolicy.yaml" not in files:  # (a render before with --network-policy: not applied again)
        (out / "networkpolicy.yaml").unlink(missing_ok=True)
    return written
