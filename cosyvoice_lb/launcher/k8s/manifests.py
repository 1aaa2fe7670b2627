"""Kubernetes manifests: each pod owns one GPU and runs the launcher (`up --foreground`),
which plans and supervises the instances that fit on that GPU; Kubernetes spreads the pods
over hosts and scales them.

Pure: :func:`manifests` returns ``{file name: YAML text}`` from the same settings as `up`
(they reach the pod as its ``COSYVOICE_LB_*`` environment) and the deployment's own
options; the command writes them. Every timing a probe or the grace period uses is
derived here, with its arithmetic in the file it lands in.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.common.settings import Settings, envvar, problems
from cosyvoice_lb.common.sizes import SizeError, parse_size
from cosyvoice_lb.common.timeouts import Timeouts
from cosyvoice_lb.launcher.cluster.layout import layout_for
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.plan.footprint import budget_for, parse_instances
from cosyvoice_lb.launcher.plan.planner import Gpu, Inventory, PlanError, plan
from cosyvoice_lb.launcher.render.credentials import given_tokens

PORT = 8080  # nginx in the pod
STATE = "/var/lib/cosyvoice-lb"  # the pod's state dir (an emptyDir): configs, logs, sockets
SECRETS = "/run/secrets/cosyvoice-lb"
VOICES = "/srv/voices"  # the saved-voice registry, shared by every pod (ReadWriteMany)
OUTPUTS = "/srv/outputs"  # results, a dir per pod on a shared volume
USER_ID = 10001  # the image's non-root user (Dockerfile)
PRE_STOP_SECONDS = 5  # for the pod's removal from the Service to reach every ingress controller
PROBE_PERIOD = 10
# Settings the pod sets itself: where things are, who may get in, how it listens.
OWN = (
    "state_dir",
    "voices_dir",
    "outputs_dir",
    "api_token_file",
    "admin_token_file",
    "public",
    "host",
    "port",
    "gpus",
    "python",
    "nginx",
)


@dataclass(frozen=True)
class Deployment:
    """What `k8s render` asks beyond the cluster settings."""

    name: str = "cosyvoice-lb"
    namespace: str = "default"
    image: str = "cosyvoice-lb:latest"
    replicas: int = 2
    max_replicas: int = 8
    gpu_memory: str = "24GiB"  # one pod's GPU: what the instance count is planned against
    host: str = ""  # the Ingress host ("" = every host)
    storage_class: str = ""  # for the ReadWriteMany volumes ("" = the cluster's default)
    voices_size: str = "10Gi"
    outputs_size: str = "50Gi"
    target_queue: float = 1.0  # HPA: requests waiting per pod it aims at
    target_cpu: int = 70
    api_tokens: tuple[str, ...] = ()  # from --api-token-file; one is generated when none
    admin_tokens: tuple[str, ...] = ()
    scrape_token: str = ""
    model_volume: str = ""  # a PVC holding the CosyVoice model (--model-dir is its path in the pod)
    labels: dict[str, str] = field(default_factory=dict)


def instances_per_pod(settings: Settings, deployment: Deployment) -> int:
    """How many instances fit on one pod's GPU (planned as `plan --gpus` would)."""
    memory = parse_size(deployment.gpu_memory)
    box = Inventory(
        gpus=(Gpu(0, memory, memory, "pod GPU"),),
        cpu_cores=8,
        ram_total=64 * 2**30,
        ram_available=64 * 2**30,
        source="k8s render",
    )
    budget, _ = budget_for(settings, layout_for(settings))  # (a footprint calibrated here counts)
    return len(plan(box, budget, instances=parse_instances(settings.instances), force=settings.force).slots)


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


def startup_failures(settings: Settings) -> int:
    """The startup probe's failureThreshold: --startup-timeout plus a minute for the launcher
    and the warm-up, and never under the 5 minutes the seeds measured a load to take."""
    return math.ceil(max(settings.startup_timeout + 60, 300) / PROBE_PERIOD)


def pod_env(settings: Settings) -> list[dict[str, str]]:
    """The settings that differ from the defaults, as the pod's COSYVOICE_LB_* variables."""
    defaults = Settings()
    env = [
        {"name": envvar("state_dir"), "value": STATE},
        {"name": envvar("public"), "value": "1"},
        {"name": envvar("port"), "value": str(PORT)},
        {"name": envvar("voices_dir"), "value": VOICES},
        {"name": envvar("outputs_dir"), "value": f"{OUTPUTS}/$(POD_NAME)"},
        {"name": envvar("api_token_file"), "value": f"{STATE}/api-tokens"},
        {"name": envvar("admin_token_file"), "value": f"{STATE}/admin-tokens"},
        {"name": envvar("python"), "value": "/opt/cosyvoice-lb/bin/python"},
    ]
    for f in dataclasses.fields(Settings):
        value = getattr(settings, f.name)
        if f.name in OWN or value == getattr(defaults, f.name):
            continue
        env.append({"name": envvar(f.name), "value": ("1" if value else "") if isinstance(value, bool) else str(value)})
    return env


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _meta(deployment: Deployment, name: str = "", **extra: Any) -> dict[str, Any]:
    return {"name": name or deployment.name, "namespace": deployment.namespace, "labels": labels(deployment), **extra}


def labels(deployment: Deployment) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "cosyvoice-lb",
        "app.kubernetes.io/instance": deployment.name,
        **deployment.labels,
    }


def selector(deployment: Deployment) -> dict[str, str]:
    return {"app.kubernetes.io/name": "cosyvoice-lb", "app.kubernetes.io/instance": deployment.name}


def _dump(document: dict[str, Any], header: str = "") -> str:
    return (header + "\n" if header else "") + yaml.safe_dump(document, sort_keys=False, width=120)


def _secrets(deployment: Deployment) -> tuple[str, str, str]:
    api = "\n".join(deployment.api_tokens) or secrets.token_urlsafe(32)
    admin = "\n".join(deployment.admin_tokens) or secrets.token_urlsafe(32)
    return api + "\n", admin + "\n", (deployment.scrape_token or secrets.token_urlsafe(32)) + "\n"


def manifests(settings: Settings, deployment: Deployment) -> dict[str, str]:
    """Every manifest, keyed by its file name (apply them with ``kubectl apply -f DIR``)."""
    name, per_pod = deployment.name, instances_per_pod(settings, deployment)
    grace, arithmetic = grace_seconds(settings)
    api, admin, scrape = _secrets(deployment)
    secret_name = f"{name}-tokens"
    probe = {"httpGet": {"path": "/ping", "port": "http"}, "periodSeconds": PROBE_PERIOD, "timeoutSeconds": 3}
    # The secrets arrive group-readable (fsGroup); the launcher wants its token files 0600 and its own.
    copy = " && ".join(
        f"install -m 0600 {SECRETS}/{key} {STATE}/{target}"
        for key, target in (
            ("api-tokens", "api-tokens"),
            ("admin-tokens", "admin-tokens"),
            ("scrape-token", "monitoring/scrape-token"),
        )
    )
    command = f"mkdir -p {STATE}/monitoring {OUTPUTS}/$POD_NAME && {copy} && exec cosyvoice-lb up --foreground"
    container: dict[str, Any] = {
        "name": "cosyvoice-lb",
        "image": deployment.image,
        "command": ["sh", "-c", command],
        "ports": [{"name": "http", "containerPort": PORT}],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}, *pod_env(settings)],
        "resources": {
            "requests": {"nvidia.com/gpu": 1, "cpu": "2", "memory": "8Gi"},
            "limits": {"nvidia.com/gpu": 1, "memory": "24Gi"},
        },
        # Loading: --startup-timeout plus a minute, never under 5 minutes (the seeds measured ~240 s).
        "startupProbe": {**probe, "failureThreshold": startup_failures(settings)},
        # In the Service while at least one instance is ready (/ping is 503 when none is).
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 2},
        # Alive while nginx answers at all: instances that restart inside are the launcher's job.
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": PROBE_PERIOD, "failureThreshold": 6},
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SECONDS)]}}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [
            {"name": "state", "mountPath": STATE},
            {"name": "tokens", "mountPath": SECRETS, "readOnly": True},
            {"name": "voices", "mountPath": VOICES},
            {"name": "outputs", "mountPath": OUTPUTS},
            *(
                [{"name": "model", "mountPath": settings.model_dir, "readOnly": True}]
                if deployment.model_volume and settings.model_dir
                else []
            ),
        ],
    }
    volumes: list[dict[str, Any]] = [
        {"name": "state", "emptyDir": {}},
        {"name": "tokens", "secret": {"secretName": secret_name, "defaultMode": 0o440}},
        {"name": "voices", "persistentVolumeClaim": {"claimName": f"{name}-voices"}},
        {"name": "outputs", "persistentVolumeClaim": {"claimName": f"{name}-outputs"}},
        *(
            [{"name": "model", "persistentVolumeClaim": {"claimName": deployment.model_volume, "readOnly": True}}]
            if deployment.model_volume
            else []
        ),
    ]
    deployment_doc = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(deployment),
        "spec": {
            "replicas": deployment.replicas,
            "selector": {"matchLabels": selector(deployment)},
            # One pod more at a time, never one less: a model load takes minutes.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": labels(deployment)},
                "spec": {
                    "terminationGracePeriodSeconds": grace,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": USER_ID,
                        "runAsGroup": USER_ID,
                        "fsGroup": USER_ID,
                    },
                    "affinity": {
                        "podAntiAffinity": {
                            "preferredDuringSchedulingIgnoredDuringExecution": [
                                {
                                    "weight": 100,
                                    "podAffinityTerm": {
                                        "topologyKey": "kubernetes.io/hostname",
                                        "labelSelector": {"matchLabels": selector(deployment)},
                                    },
                                }
                            ]
                        }
                    },
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }
    header = (
        f"# {name}: one GPU per pod; the launcher inside runs the {per_pod} instance(s) that fit on it\n"
        f"# ({deployment.gpu_memory} planned), nginx and the health loop, as `cosyvoice-lb up` does on a box.\n"
        "# SIGTERM drains: the pod is out of the Service first (preStop), then every instance finishes\n"
        "# its requests (--drain-timeout) before the launcher exits. terminationGracePeriodSeconds:\n" + arithmetic
    )

    def pvc(which: str, size: str) -> dict[str, Any]:
        spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": size}}}
        if deployment.storage_class:
            spec["storageClassName"] = deployment.storage_class
        return {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": _meta(deployment, f"{name}-{which}"),
            "spec": spec,
        }

    def ingress(which: str, path: str, annotations: dict[str, str]) -> dict[str, Any]:
        rule: dict[str, Any] = {
            "http": {
                "paths": [
                    {
                        "path": path,
                        "pathType": "Prefix",
                        "backend": {"service": {"name": name, "port": {"name": "http"}}},
                    }
                ]
            }
        }
        if deployment.host:
            rule["host"] = deployment.host
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "Ingress",
            "metadata": _meta(deployment, f"{name}-{which}", annotations=annotations),
            "spec": {"ingressClassName": "nginx", "rules": [rule]},
        }

    common = {
        "nginx.ingress.kubernetes.io/proxy-body-size": settings.max_body.replace("iB", ""),
        "nginx.ingress.kubernetes.io/proxy-read-timeout": "3600",
        "nginx.ingress.kubernetes.io/proxy-send-timeout": "3600",
    }
    relays = ["/metrics"] + [f"/metrics/instance-{i}" for i in range(per_pod)]
    return {
        "secret.yaml": _dump(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": _meta(deployment, secret_name),
                "type": "Opaque",
                "data": {"api-tokens": _b64(api), "admin-tokens": _b64(admin), "scrape-token": _b64(scrape)},
            },
            "# The API tokens, the control panel's admin tokens and the token Prometheus scrapes with.\n"
            "# A secret: this file is written 0600; keep it out of version control.",
        ),
        "volumes.yaml": _dump(
            pvc("voices", deployment.voices_size),
            "# Saved voices: one registry every pod reads and writes (ReadWriteMany).",
        )
        + "---\n"
        + _dump(pvc("outputs", deployment.outputs_size), "# Results: a dir per pod."),
        "deployment.yaml": _dump(deployment_doc, header),
        "service.yaml": _dump(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": _meta(deployment),
                "spec": {
                    "selector": selector(deployment),
                    "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
                },
            }
        ),
        "ingress.yaml": _dump(
            ingress(
                "ui",
                "/",
                {
                    **common,
                    # Gradio's protocol takes several requests per call: one pod per browser.
                    "nginx.ingress.kubernetes.io/affinity": "cookie",
                    "nginx.ingress.kubernetes.io/session-cookie-name": "cvlb_pod",
                    "nginx.ingress.kubernetes.io/session-cookie-samesite": "Lax",
                },
            ),
            "# The UI sticks to a pod by cookie; the API (/v1) is balanced request by request.",
        )
        + "---\n"
        + _dump(ingress("api", "/v1", {**common, "nginx.ingress.kubernetes.io/load-balance": "ewma"})),
        "hpa.yaml": _dump(
            {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": _meta(deployment),
                "spec": {
                    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                    "minReplicas": deployment.replicas,
                    "maxReplicas": deployment.max_replicas,
                    "metrics": [
                        {
                            "type": "Pods",
                            "pods": {
                                "metric": {"name": "cosyvoice_queue_depth"},
                                "target": {"type": "AverageValue", "averageValue": str(deployment.target_queue)},
                            },
                        },
                        {
                            "type": "Resource",
                            "resource": {
                                "name": "cpu",
                                "target": {"type": "Utilization", "averageUtilization": deployment.target_cpu},
                            },
                        },
                    ],
                    # Up fast, down slowly: a new pod needs minutes to load, a removed one is gone.
                    "behavior": {
                        "scaleUp": {"stabilizationWindowSeconds": 60},
                        "scaleDown": {"stabilizationWindowSeconds": 600},
                    },
                },
            },
            "# Scales on requests waiting per pod (Prometheus Adapter: prometheus-adapter-rules.yaml) and CPU.",
        ),
        "pdb.yaml": _dump(
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": _meta(deployment),
                "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(deployment)}},
            },
            "# A node drain takes one pod at a time.",
        ),
        "servicemonitor.yaml": _dump(
            {
                "apiVersion": "monitoring.coreos.com/v1",
                "kind": "ServiceMonitor",
                "metadata": _meta(deployment),
                "spec": {
                    "selector": {"matchLabels": selector(deployment)},
                    "endpoints": [
                        {
                            "port": "http",
                            "path": path,
                            "interval": "15s",
                            "authorization": {
                                "type": "Bearer",
                                "credentials": {"name": secret_name, "key": "scrape-token"},
                            },
                        }
                        for path in relays
                    ],
                },
            },
            "# Prometheus Operator: the pod's cluster metrics and each instance's (relayed by the pod's nginx).",
        ),
        "prometheus-adapter-rules.yaml": _dump(
            {
                "rules": [
                    {
                        "seriesQuery": 'cosyvoice_lb_instance_queue_depth{namespace!="",pod!=""}',
                        "resources": {
                            "overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
                        },
                        "name": {"matches": "^cosyvoice_lb_instance_queue_depth$", "as": "cosyvoice_queue_depth"},
                        "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
                    }
                ]
            },
            "# Prometheus Adapter's rules (its `rules:` value): requests waiting for an engine, summed per pod.",
        ),
    }


def write_manifests(settings: Settings, deployment: Deployment, out_dir: str) -> list[Path]:
    """Write :func:`manifests` into ``out_dir`` (atomically; the Secret 0600). Token files
    given with --api-token-file / --admin-token-file fill the Secret; else tokens are made."""
    found = [p for p in problems(settings) if "--api-token-file" not in p and "--admin-token-file" not in p]
    if found:
        raise ClusterError(found[0])
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
    return written
