"""The Kubernetes objects `k8s render` writes, one pure builder each: every builder takes the
deployment's options (:class:`Deployment`), the cluster :class:`Settings` where the pod needs
them, and the values :mod:`cosyvoice_lb.launcher.k8s.manifests` computes (instances per pod,
the grace period, the tokens), and returns the object as the dict that is dumped to YAML.
The Deployment and its pod are built in :mod:`cosyvoice_lb.launcher.k8s.pod`, the Ingresses
in :mod:`cosyvoice_lb.launcher.k8s.ingress`; the objects they share are here.

Key order is the order the YAML is written in.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

PORT = 8080  # nginx in the pod
STATE = "/var/lib/cosyvoice-lb"  # the pod's state dir (an emptyDir): configs, logs, sockets
SECRETS = "/run/secrets/cosyvoice-lb"
VOICES = "/srv/voices"  # the saved-voice registry, shared by every pod (ReadWriteMany)
OUTPUTS = "/srv/outputs"  # results, a dir per pod on a shared volume
USER_ID = 10001  # the image's non-root user (Dockerfile)
PRE_STOP_SECONDS = 5  # for the pod's removal from the Service to reach every ingress controller
PROBE_PERIOD = 10
JOBS_REDIS_KEY = "jobs-redis"  # secret.yaml's key for --jobs-redis's URL (k8s/jobs.py)
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
    "schedule",  # (the pods' count follows it: KEDA's ScaledObject, k8s/scaling.py; a pod serves its plan)
    "jobs_redis",  # (from a Secret, never a plain value: k8s/jobs.py)
    "job_results",  # (on the shared volume with --jobs-redis, else the state dir's: k8s/jobs.py)
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
    # --monitor-label: on the ServiceMonitor and the PrometheusRule too (k8s/monitoring.py)
    monitor_labels: tuple[tuple[str, str], ...] = ()
    # TLS on the Ingresses, and the ingress controller's pods nginx takes client addresses from (k8s/ingress.py)
    tls_secret: str = ""  # a kubernetes.io/tls Secret for --ingress-host ("" = plain HTTP)
    pod_cidr: str = "10.0.0.0/8"  # the pod network: the pod's --trusted-proxies unless those are given
    # The pod's size and place (k8s/sizing.py, k8s/scheduling.py)
    cpu_per_instance: float = 0.0  # cores (0 = the engine's)
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[dict[str, str], ...] = ()
    anti_affinity: str = "preferred"  # one pod per host: preferred or required
    image_pull_policy: str = "IfNotPresent"
    # --schedule's KEDA ScaledObject (k8s/scaling.py): its cron windows' zone, and the Prometheus it asks
    timezone: str = "UTC"
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"
    # --jobs-redis-secret NAME[:KEY] as (name, key): the Secret the pods read --jobs-redis from (k8s/jobs.py)
    jobs_redis_secret: tuple[str, ...] = ()
    # --network-policy: who may reach the pods (k8s/network.py); --pod-label: on the pod template only
    network_policy: bool = False
    ingress_namespace: str = "ingress-nginx"  # the ingress controller's namespace
    monitoring_namespace: str = "monitoring"  # Prometheus's ("" = none)
    pod_labels: tuple[tuple[str, str], ...] = ()


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


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def token_secret(deployment: Deployment, api: str, admin: str, scrape: str, jobs_redis: str = "") -> dict[str, Any]:
    """The Secret: the API tokens, the control panel's admin tokens and the token Prometheus
    scrapes with, each a file's text (a token a line); and --jobs-redis's URL when given."""
    data = {"api-tokens": _b64(api), "admin-tokens": _b64(admin), "scrape-token": _b64(scrape)}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(deployment, secret_name(deployment)),
        "type": "Opaque",
        "data": {**data, **({JOBS_REDIS_KEY: _b64(jobs_redis)} if jobs_redis else {})},
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


def adapter_rules() -> dict[str, Any]:
    """Prometheus Adapter's config (its ``rules:``): the requests waiting for an engine, summed
    per pod, as the ``cosyvoice_queue_depth`` the autoscaler reads (:func:`adapter_config`)."""
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


def adapter_config_name(deployment: Deployment) -> str:
    """The ConfigMap holding Prometheus Adapter's config (the chart's ``rules.existing``)."""
    return f"{deployment.name}-prometheus-adapter"


def adapter_config(deployment: Deployment, config: str) -> dict[str, Any]:
    """Prometheus Adapter's config file (``config``: :func:`adapter_rules` as YAML) as a
    ConfigMap, under the key ``config.yaml`` its chart mounts (``rules.existing``)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(deployment, adapter_config_name(deployment)),
        "data": {"config.yaml": config},
    }
