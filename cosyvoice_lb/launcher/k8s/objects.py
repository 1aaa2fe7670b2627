"""The Kubernetes objects `k8s render` writes, one pure builder each: every builder takes the
deployment's options (:class:`Deployment`), the cluster :class:`Settings` where the pod needs
them, and the values :mod:`cosyvoice_lb.launcher.k8s.manifests` computes (instances per pod,
the grace period, the tokens), and returns the object as the dict that is dumped to YAML.

Key order is the order the YAML is written in.
"""

from __future__ import annotations

import base64
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from cosyvoice_lb.common.settings import Settings, envvar

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


def labels(deployment: Deployment) -> dict[str, str]:
    """Every object's labels: the app, this deployment, and the ones asked for."""
    return {
        "app.kubernetes.io/name": "cosyvoice-lb",
        "app.kubernetes.io/instance": deployment.name,
        **deployment.labels,
    }


def selector(deployment: Deployment) -> dict[str, str]:
    """The labels that pick this deployment's pods (never the asked-for ones: a selector is fixed)."""
    return {"app.kubernetes.io/name": "cosyvoice-lb", "app.kubernetes.io/instance": deployment.name}


def _meta(deployment: Deployment, name: str = "", **extra: Any) -> dict[str, Any]:
    return {"name": name or deployment.name, "namespace": deployment.namespace, "labels": labels(deployment), **extra}


def secret_name(deployment: Deployment) -> str:
    """The Secret holding the tokens (mounted by the pod, read by the ServiceMonitor)."""
    return f"{deployment.name}-tokens"


def claim_name(deployment: Deployment, which: str) -> str:
    """A shared volume's PersistentVolumeClaim (``voices`` or ``outputs``)."""
    return f"{deployment.name}-{which}"


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


def token_secret(deployment: Deployment, api: str, admin: str, scrape: str) -> dict[str, Any]:
    """The Secret: the API tokens, the control panel's admin tokens and the token Prometheus
    scrapes with, each a file's text (a token a line)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(deployment, secret_name(deployment)),
        "type": "Opaque",
        "data": {"api-tokens": _b64(api), "admin-tokens": _b64(admin), "scrape-token": _b64(scrape)},
    }


def volume_claim(deployment: Deployment, which: str, size: str) -> dict[str, Any]:
    """A ReadWriteMany PersistentVolumeClaim every pod mounts (the saved voices, the outputs),
    of --storage-class when one is given, else of the cluster's default class."""
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": size}}}
    if deployment.storage_class:
        spec["storageClassName"] = deployment.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(deployment, claim_name(deployment, which)),
        "spec": spec,
    }


def container_command() -> str:
    """The container's shell command: make the state dirs, copy the tokens in, run the launcher.

    The secrets arrive group-readable (fsGroup); the launcher wants its token files 0600 and
    its own, so they are installed into the state dir rather than read where mounted."""
    copy = " && ".join(
        f"install -m 0600 {SECRETS}/{key} {STATE}/{target}"
        for key, target in (
            ("api-tokens", "api-tokens"),
            ("admin-tokens", "admin-tokens"),
            ("scrape-token", "monitoring/scrape-token"),
        )
    )
    return f"mkdir -p {STATE}/monitoring {OUTPUTS}/$POD_NAME && {copy} && exec cosyvoice-lb up --foreground"


def pod_container(settings: Settings, deployment: Deployment) -> dict[str, Any]:
    """The pod's one container: the launcher (`up --foreground`) on one GPU, given the settings
    as its environment, probed through nginx, and mounting the model only when --model-volume
    and --model-dir are both given."""
    probe = {"httpGet": {"path": "/ping", "port": "http"}, "periodSeconds": PROBE_PERIOD, "timeoutSeconds": 3}
    return {
        "name": "cosyvoice-lb",
        "image": deployment.image,
        "command": ["sh", "-c", container_command()],
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


def pod_volumes(deployment: Deployment) -> list[dict[str, Any]]:
    """The pod's volumes: its own state dir, the tokens' Secret, the two shared claims, and
    the model's claim (read-only) when --model-volume is given."""
    return [
        {"name": "state", "emptyDir": {}},
        {"name": "tokens", "secret": {"secretName": secret_name(deployment), "defaultMode": 0o440}},
        {"name": "voices", "persistentVolumeClaim": {"claimName": claim_name(deployment, "voices")}},
        {"name": "outputs", "persistentVolumeClaim": {"claimName": claim_name(deployment, "outputs")}},
        *(
            [{"name": "model", "persistentVolumeClaim": {"claimName": deployment.model_volume, "readOnly": True}}]
            if deployment.model_volume
            else []
        ),
    ]


def pod_spec(settings: Settings, deployment: Deployment, grace: int) -> dict[str, Any]:
    """The pod template's spec: the non-root user, a preference for one pod per host, the
    container and its volumes, and ``grace`` seconds to drain on SIGTERM."""
    return {
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
        "containers": [pod_container(settings, deployment)],
        "volumes": pod_volumes(deployment),
    }


def deployment_object(settings: Settings, deployment: Deployment, grace: int) -> dict[str, Any]:
    """The Deployment: --replicas pods of :func:`pod_spec`, rolled one extra pod at a time."""
    return {
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
                "spec": pod_spec(settings, deployment, grace),
            },
        },
    }


def service(deployment: Deployment) -> dict[str, Any]:
    """The Service: port 80 to every ready pod's nginx."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(deployment),
        "spec": {
            "selector": selector(deployment),
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def ingress_annotations(settings: Settings) -> dict[str, str]:
    """The ingress-nginx annotations both Ingresses share: --max-body, and an hour to stream."""
    return {
        "nginx.ingress.kubernetes.io/proxy-body-size": settings.max_body.replace("iB", ""),
        "nginx.ingress.kubernetes.io/proxy-read-timeout": "3600",
        "nginx.ingress.kubernetes.io/proxy-send-timeout": "3600",
    }


def ingress(deployment: Deployment, which: str, path: str, annotations: dict[str, str]) -> dict[str, Any]:
    """An ingress-nginx Ingress named ``<name>-<which>`` sending ``path`` to the Service, on
    --ingress-host when one is given, else on every host."""
    rule: dict[str, Any] = {
        "http": {
            "paths": [
                {
                    "path": path,
                    "pathType": "Prefix",
                    "backend": {"service": {"name": deployment.name, "port": {"name": "http"}}},
                }
            ]
        }
    }
    if deployment.host:
        rule["host"] = deployment.host
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": _meta(deployment, f"{deployment.name}-{which}", annotations=annotations),
        "spec": {"ingressClassName": "nginx", "rules": [rule]},
    }


def ui_ingress(settings: Settings, deployment: Deployment) -> dict[str, Any]:
    """The UI's Ingress (``/``): Gradio's protocol takes several requests per call, so a
    browser sticks to one pod by cookie."""
    return ingress(
        deployment,
        "ui",
        "/",
        {
            **ingress_annotations(settings),
            "nginx.ingress.kubernetes.io/affinity": "cookie",
            "nginx.ingress.kubernetes.io/session-cookie-name": "cvlb_pod",
            "nginx.ingress.kubernetes.io/session-cookie-samesite": "Lax",
        },
    )


def api_ingress(settings: Settings, deployment: Deployment) -> dict[str, Any]:
    """The API's Ingress (``/v1``): balanced request by request (EWMA), no stickiness."""
    return ingress(
        deployment, "api", "/v1", {**ingress_annotations(settings), "nginx.ingress.kubernetes.io/load-balance": "ewma"}
    )


def autoscaler(deployment: Deployment) -> dict[str, Any]:
    """The HorizontalPodAutoscaler: --replicas to --max-replicas pods, on the requests waiting
    per pod (``cosyvoice_queue_depth``, from :func:`adapter_rules`) and on CPU."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(deployment),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment.name},
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
    }


def disruption_budget(deployment: Deployment) -> dict[str, Any]:
    """The PodDisruptionBudget: a node drain takes one pod at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(deployment),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(deployment)}},
    }


def service_monitor(deployment: Deployment, per_pod: int) -> dict[str, Any]:
    """The Prometheus Operator's ServiceMonitor: the pod's cluster metrics (``/metrics``) and
    each of its ``per_pod`` instances' (relayed by the pod's nginx), with the scrape token."""
    relays = ["/metrics"] + [f"/metrics/instance-{i}" for i in range(per_pod)]
    return {
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
                        "credentials": {"name": secret_name(deployment), "key": "scrape-token"},
                    },
                }
                for path in relays
            ],
        },
    }


def adapter_rules() -> dict[str, Any]:
    """Prometheus Adapter's ``rules:`` value (not a Kubernetes object): the requests waiting
    for an engine, summed per pod, as the ``cosyvoice_queue_depth`` the autoscaler reads."""
    return {
        "rules": [
            {
                "seriesQuery": 'cosyvoice_lb_instance_queue_depth{namespace!="",pod!=""}',
                "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
                "name": {"matches": "^cosyvoice_lb_instance_queue_depth$", "as": "cosyvoice_queue_depth"},
                "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
            }
        ]
    }
