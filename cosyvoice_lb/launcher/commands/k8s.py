"""`cosyvoice-lb k8s`: the Kubernetes commands (a pod per GPU, each running the launcher)."""

from __future__ import annotations

import shlex
from typing import Any

import click

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.k8s.jobs import jobs_fields, jobs_options, per_pod_warning
from cosyvoice_lb.launcher.k8s.network import network_fields, network_options
from cosyvoice_lb.launcher.k8s.options import keda_fields, keda_options, pod_fields, pod_options
from cosyvoice_lb.launcher.options import CLUSTER_OPTIONS, fail, options


@click.group("k8s")
def k8s_group() -> None:
    """Kubernetes: a pod per GPU, each running the launcher (`up --foreground`)."""


@k8s_group.command("render")
@options(*CLUSTER_OPTIONS)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Where the manifests go.")
@click.option("--name", "k8s_name", default="cosyvoice-lb", show_default=True, help="The Deployment's name.")
@click.option("--namespace", default="default", show_default=True)
@click.option("--image", default="cosyvoice-lb:latest", show_default=True, help="The image (see Dockerfile).")
@click.option("--replicas", default=2, show_default=True, type=click.IntRange(min=1), help="Pods at least.")
@click.option("--max-replicas", default=8, show_default=True, type=click.IntRange(min=1), help="Pods at most (HPA).")
@click.option("--gpu-memory", default="24GiB", show_default=True, help="One pod's GPU: instances are planned on it.")
@click.option("--ingress-host", default="", help="The Ingress host (default: any).")
@click.option("--storage-class", default="", help="For the ReadWriteMany volumes (default: the cluster's).")
@click.option("--voices-size", default="10Gi", show_default=True)
@click.option("--outputs-size", default="50Gi", show_default=True)
@click.option(
    "--target-queue",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Requests waiting per pod the HPA aims at.",
)
@click.option("--model-volume", default="", help="A PVC with the CosyVoice model, mounted at --model-dir.")
@click.option(
    "--monitor-label", multiple=True, metavar="KEY=VALUE", help="Label ServiceMonitor and PrometheusRule (repeatable)."
)
@pod_options
@keda_options
@jobs_options
@network_options
def k8s_render_command(
    out_dir: str,
    k8s_name: str,
    namespace: str,
    image: str,
    replicas: int,
    max_replicas: int,
    gpu_memory: str,
    ingress_host: str,
    storage_class: str,
    voices_size: str,
    outputs_size: str,
    target_queue: float,
    model_volume: str,
    monitor_label: tuple[str, ...],
    **kwargs: Any,
) -> None:
    """Write the Kubernetes manifests (and the tokens' Secret, 0600) for the settings `up` takes."""
    from cosyvoice_lb.launcher.k8s.manifests import Deployment, write_manifests
    from cosyvoice_lb.launcher.k8s.monitoring import parse_monitor_labels

    settings = Settings.from_mapping(kwargs)
    if replicas > max_replicas:
        fail(f"--replicas {replicas} is above --max-replicas {max_replicas}: raise --max-replicas")
    deployment = Deployment(
        name=k8s_name,
        namespace=namespace,
        image=image,
        replicas=replicas,
        max_replicas=max_replicas,
        gpu_memory=gpu_memory,
        host=ingress_host,
        storage_class=storage_class,
        voices_size=voices_size,
        outputs_size=outputs_size,
        target_queue=target_queue,
        model_volume=model_volume,
        monitor_labels=parse_monitor_labels(monitor_label),  # (refuses a malformed one)
        **pod_fields(kwargs),  # TLS, client addresses, the pod's size and place (k8s/options.py)
        **keda_fields(kwargs),  # --timezone, --prometheus-url: --schedule's KEDA ScaledObject
        **jobs_fields(kwargs),  # --jobs-redis-secret: the Secret the pods read the jobs' Redis from
        **network_fields(kwargs),  # --network-policy (who reaches the pods), --pod-label
    )
    for path in write_manifests(settings, deployment, out_dir):
        click.echo(str(path))
    warning = per_pod_warning(settings, deployment)
    if warning:
        click.echo(warning, err=True)
    click.echo(f"apply with: kubectl apply -f {shlex.quote(out_dir)}   (secret.yaml holds tokens: keep it private)")
