"""The Deployment and its pod: the one container (the launcher, `up --foreground`, on one
GPU), its environment from the settings, its probes, its resources (sized from the plan by
:mod:`cosyvoice_lb.launcher.k8s.sizing`, Guaranteed), where it may run
(:mod:`cosyvoice_lb.launcher.k8s.scheduling`) and its volumes. Pure builders, as in
:mod:`cosyvoice_lb.launcher.k8s.objects`: each returns the object as the dict dumped to YAML.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from cosyvoice_lb.common.settings import Settings, envvar
from cosyvoice_lb.launcher.k8s.jobs import jobs_env
from cosyvoice_lb.launcher.k8s.network import pod_template_labels
from cosyvoice_lb.launcher.k8s.objects import (
    OUTPUTS,
    OWN,
    PORT,
    PRE_STOP_SECONDS,
    PROBE_PERIOD,
    SECRETS,
    STATE,
    USER_ID,
    VOICES,
    Deployment,
    _meta,
    claim_name,
    secret_name,
    selector,
)
from cosyvoice_lb.launcher.k8s.prepare import (
    PYTHON,
    init_containers,
    model_mount,
    needs_prepare,
    prepared_dir,
    prepared_mount,
    prepared_volume,
)
from cosyvoice_lb.launcher.k8s.scheduling import placement
from cosyvoice_lb.launcher.k8s.sizing import PodSize

# Where the image built with upstream's code keeps it (the Dockerfile), Matcha-TTS in
# third_party/Matcha-TTS: the pod's --cosyvoice-root for cosyvoice3 unless one is given.
COSYVOICE_ROOT = "/opt/cosyvoice"
# The pod's name from the Downward API: its outputs dir, and the prefix of every line the
# launcher relays to the container's log (cluster/log_relay.py).
POD_NAME_VARIABLES = ("POD_NAME",)


def startup_failures(settings: Settings) -> int:
    """The startup probe's failureThreshold: --startup-timeout plus a minute for the launcher
    and the warm-up, and never under the 5 minutes the seeds measured a load to take."""
    return math.ceil(max(settings.startup_timeout + 60, 300) / PROBE_PERIOD)


def pod_settings(settings: Settings, deployment: Deployment) -> Settings:
    """The settings as the pod runs them: nginx takes the client's address from the ingress
    controller's pods (--pod-cidr) unless --trusted-proxies says otherwise, and cosyvoice3
    finds upstream's code where the image keeps it unless --cosyvoice-root says otherwise."""
    changes: dict[str, Any] = {}
    if not settings.trusted_proxies and deployment.pod_cidr:
        changes["trusted_proxies"] = deployment.pod_cidr
    if settings.resolved_engine == "cosyvoice3" and not settings.cosyvoice_root:
        changes["cosyvoice_root"] = COSYVOICE_ROOT
    if needs_prepare(settings):  # (--load-vllm / --load-trt: the initContainer's dir, k8s/prepare.py)
        changes["model_dir"] = prepared_dir(settings)
    return dataclasses.replace(settings, **changes)


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
        {"name": envvar("python"), "value": PYTHON},
    ]
    for f in dataclasses.fields(Settings):
        value = getattr(settings, f.name)
        if f.name in OWN or value == getattr(defaults, f.name):
            continue
        env.append({"name": envvar(f.name), "value": ("1" if value else "") if isinstance(value, bool) else str(value)})
    return env


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


def pod_container(settings: Settings, deployment: Deployment, size: PodSize) -> dict[str, Any]:
    """The pod's one container: the launcher (`up --foreground`) on one GPU, given the settings
    as its environment (:func:`pod_settings`; --jobs-redis from its Secret), with ``size``'s CPU and memory as both its
    requests and its limits, probed through nginx, and mounting the model only when
    --model-volume and --model-dir are both given."""
    probe = {"httpGet": {"path": "/ping", "port": "http"}, "periodSeconds": PROBE_PERIOD, "timeoutSeconds": 3}
    downward = [{"name": n, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} for n in POD_NAME_VARIABLES]
    return {
        "name": "cosyvoice-lb",
        "image": deployment.image,
        "imagePullPolicy": deployment.image_pull_policy,
        "command": ["sh", "-c", container_command()],
        "ports": [{"name": "http", "containerPort": PORT}],
        "env": [*downward, *pod_env(pod_settings(settings, deployment)), *jobs_env(settings, deployment)],
        "resources": size.resources(),
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
            *model_mount(settings, deployment),
            *prepared_mount(settings, read_only=True),  # (--load-vllm / --load-trt: what the initContainer made)
        ],
    }


def pod_volumes(deployment: Deployment, settings: Settings | None = None) -> list[dict[str, Any]]:
    """The pod's volumes: its own state dir, the tokens' Secret, the two shared claims, the
    model's claim (read-only) when --model-volume is given, and with --load-vllm / --load-trt
    the emptyDir the model dir is prepared in."""
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
        *(prepared_volume(settings) if settings is not None else []),
    ]


def pod_spec(settings: Settings, deployment: Deployment, grace: int, size: PodSize) -> dict[str, Any]:
    """The pod template's spec: the non-root user, one pod per host (preferred or required),
    the node selector and tolerations asked for, the container and its volumes, and
    ``grace`` seconds to drain on SIGTERM; with --load-vllm / --load-trt, the initContainer
    that prepares the model dir first."""
    main = pod_container(settings, deployment, size)
    prepare = init_containers(settings, deployment, main, pod_settings(settings, deployment).cosyvoice_root)
    return {
        "terminationGracePeriodSeconds": grace,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": USER_ID,
            "runAsGroup": USER_ID,
            "fsGroup": USER_ID,
        },
        **placement(deployment),
        **({"initContainers": prepare} if prepare else {}),
        "containers": [main],
        "volumes": pod_volumes(deployment, settings),
    }


def deployment_object(settings: Settings, deployment: Deployment, grace: int, size: PodSize) -> dict[str, Any]:
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
                "metadata": {"labels": pod_template_labels(deployment)},  # (--pod-label: here only)
                "spec": pod_spec(settings, deployment, grace, size),
            },
        },
    }
