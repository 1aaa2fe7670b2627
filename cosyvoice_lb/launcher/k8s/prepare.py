"""--load-vllm and --load-trt on a read-only model volume: an initContainer runs
`cosyvoice-lb prepare-model` (:mod:`cosyvoice_lb.launcher.model.prepare`) from the model's
mount into an emptyDir, and the launcher's container loads from that prepared dir.

Upstream writes into the model dir at its first load with those flags (the LLM's export for
vLLM, the TensorRT engine), which a volume mounted read-only refuses. The prepared dir holds
links to the model's files (so both containers mount the model at the same path, --model-dir)
and what upstream would have written; the main container mounts it read-only, for upstream
then writes nothing. The initContainer gets the pod's resources, its GPU included: TensorRT's
engine is built for the GPU it will run on, and an initContainer's resources add nothing to
the pod's (the larger of the two counts) nor change its QoS class. Pure builders.
"""

from __future__ import annotations

import copy
from pathlib import PurePosixPath
from typing import Any

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.k8s.objects import Deployment

PREPARED = "/srv/prepared-model"  # the emptyDir the prepared model dir is made in
PYTHON = "/opt/cosyvoice-lb/bin/python"  # the image's venv: the launcher and the instances' Python
VOLUME = "prepared-model"


def needs_prepare(settings: Settings) -> bool:
    """Whether the pods load with a flag that writes into the model dir."""
    return (
        settings.resolved_engine == "cosyvoice3"
        and bool(settings.model_dir)
        and (settings.load_vllm or settings.load_trt)
    )


def prepared_dir(settings: Settings) -> str:
    """The model dir the instances load from: in the emptyDir, named as the model's."""
    return f"{PREPARED}/{PurePosixPath(settings.model_dir).name or 'model'}"


def model_mount(settings: Settings, deployment: Deployment) -> list[dict[str, Any]]:
    """The model volume at --model-dir, read-only (when --model-volume and --model-dir are given)."""
    if not (deployment.model_volume and settings.model_dir):
        return []
    return [{"name": "model", "mountPath": settings.model_dir, "readOnly": True}]


def prepared_mount(settings: Settings, read_only: bool) -> list[dict[str, Any]]:
    """The emptyDir of the prepared model dir (when the pods need one)."""
    return [{"name": VOLUME, "mountPath": PREPARED, "readOnly": read_only}] if needs_prepare(settings) else []


def prepared_volume(settings: Settings) -> list[dict[str, Any]]:
    return [{"name": VOLUME, "emptyDir": {}}] if needs_prepare(settings) else []


def prepare_command(settings: Settings, cosyvoice_root: str) -> list[str]:
    """`cosyvoice-lb prepare-model` from the model's mount into the emptyDir, with the pods' flags."""
    flags = [f"--{name.replace('_', '-')}" for name in ("load_vllm", "load_trt", "fp16") if getattr(settings, name)]
    root = ["--cosyvoice-root", cosyvoice_root] if cosyvoice_root else []
    return [
        "cosyvoice-lb", "prepare-model", "--model-dir", settings.model_dir, "--out", prepared_dir(settings),
        "--python", PYTHON, *root, *flags,
    ]  # fmt: skip


def init_containers(
    settings: Settings, deployment: Deployment, main: dict[str, Any], cosyvoice_root: str
) -> list[dict[str, Any]]:
    """The initContainer that prepares the model dir, as the ``main`` container runs: its image,
    user, privileges and resources (the GPU among them); none when the pods need none."""
    if not needs_prepare(settings):
        return []
    return [
        {
            "name": "prepare-model",
            "image": main["image"],
            "imagePullPolicy": main["imagePullPolicy"],
            "command": prepare_command(settings, cosyvoice_root),
            "resources": copy.deepcopy(main["resources"]),  # (their own dicts: no YAML alias)
            "securityContext": copy.deepcopy(main["securityContext"]),
            "volumeMounts": [*model_mount(settings, deployment), *prepared_mount(settings, read_only=False)],
        }
    ]
