"""--load-vllm / --load-trt on Kubernetes (cosyvoice_lb/launcher/k8s/prepare.py): the pods mount
the model read-only, so an initContainer runs `prepare-model` from that mount into an emptyDir
and the launcher's container loads from the prepared dir. Rendered only with those flags; the
initContainer runs as the main container does (image, user, resources with the GPU, for the
TensorRT engine is built for it); every object still validates strictly."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from conftest import cli_here
from test_k8s import V3, VERSIONS, documents, one, validate

from cosyvoice_lb.common.settings import envvar
from cosyvoice_lb.launcher.k8s.manifests import Deployment, manifests
from cosyvoice_lb.launcher.k8s.prepare import PREPARED, PYTHON

pytest.importorskip("kubernetes_validate")
MODEL = "/models/Fun-CosyVoice3-0.5B"
BASE = dataclasses.replace(V3, model_dir=MODEL)
VLLM = dataclasses.replace(BASE, load_vllm=True)
TRT = dataclasses.replace(BASE, load_trt=True, fp16=True)
ON_VOLUME = Deployment(model_volume="cosyvoice-models")


def pod(settings, deployment=ON_VOLUME) -> dict:
    return one(manifests(settings, deployment), "Deployment")["spec"]["template"]["spec"]


def mounts(container: dict) -> dict[str, dict]:
    return {m["name"]: m for m in container["volumeMounts"]}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("settings", [VLLM, TRT, dataclasses.replace(VLLM, load_trt=True)])
def test_every_object_validates_strictly_with_the_init_container(settings, version):
    for doc in documents(manifests(settings, ON_VOLUME)):
        validate(doc, version)


def test_no_init_container_without_a_flag_that_writes_into_the_model_dir():
    spec = pod(BASE)
    assert "initContainers" not in spec and "prepared-model" not in {v["name"] for v in spec["volumes"]}
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env[envvar("model_dir")] == MODEL
    assert "initContainers" not in pod(dataclasses.replace(VLLM, engine="espeak", model_dir=""))


def test_the_init_container_prepares_the_read_only_model_into_an_empty_dir_the_instances_load_from():
    spec = pod(VLLM)
    (init,) = spec["initContainers"]
    (main_container,) = spec["containers"]
    prepared = f"{PREPARED}/Fun-CosyVoice3-0.5B"
    assert init["command"] == [
        "cosyvoice-lb", "prepare-model", "--model-dir", MODEL, "--out", prepared,
        "--python", PYTHON, "--cosyvoice-root", "/opt/cosyvoice", "--load-vllm",
    ]  # fmt: skip
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["prepared-model"] == {"name": "prepared-model", "emptyDir": {}}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "cosyvoice-models", "readOnly": True}
    # the model at the same path in both (the prepared dir's links point there), read-only in both
    for container in (init, main_container):
        assert mounts(container)["model"] == {"name": "model", "mountPath": MODEL, "readOnly": True}
    # the init container writes the prepared dir; the instances only read it (upstream then writes nothing)
    assert mounts(init)["prepared-model"] == {"name": "prepared-model", "mountPath": PREPARED, "readOnly": False}
    assert mounts(main_container)["prepared-model"]["readOnly"] is True
    assert prepared.startswith(mounts(init)["prepared-model"]["mountPath"] + "/")  # (a dir inside: it is renamed)
    env = {e["name"]: e.get("value") for e in main_container["env"]}
    assert env[envvar("model_dir")] == prepared and env[envvar("load_vllm")] == "1"
    assert env[envvar("python")] == PYTHON
    assert set(mounts(init)) == {"model", "prepared-model"}  # (no tokens, no state: it needs none)


def test_the_init_container_runs_as_the_pod_does_with_its_gpu():
    spec = pod(TRT)
    (init,), (main_container,) = spec["initContainers"], spec["containers"]
    assert init["command"][-2:] == ["--load-trt", "--fp16"]
    assert init["image"] == main_container["image"] and init["imagePullPolicy"] == main_container["imagePullPolicy"]
    # the same resources: the GPU TensorRT builds its engine for, and requests = limits (QoS Guaranteed
    # counts the initContainers too); the pod asks for the larger of the two, so nothing more
    assert init["resources"] == main_container["resources"]
    assert init["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert init["securityContext"] == main_container["securityContext"]
    assert spec["securityContext"]["runAsNonRoot"]
    text = manifests(TRT, ON_VOLUME)["deployment.yaml"]
    init_part = text.split("initContainers:")[1].split("\n      containers:")[0]
    assert "&id" not in init_part and "*id" not in init_part  # (its own dicts: no YAML anchors to the main's)


def test_a_model_dir_given_with_a_trailing_slash_keeps_its_name():
    spec = pod(dataclasses.replace(VLLM, model_dir="/models/cv3/"))
    assert spec["initContainers"][0]["command"][5] == f"{PREPARED}/cv3"


def test_the_command_renders_it(tmp_path):
    out = tmp_path / "k"
    args = ["k8s", "render", "--out", str(out), "--engine", "cosyvoice3", "--model-dir", MODEL]
    done = cli_here(*args, "--model-volume", "m", "--load-vllm")
    assert done.returncode == 0, done.stderr
    deployment = yaml.safe_load((out / "deployment.yaml").read_text())
    assert deployment["spec"]["template"]["spec"]["initContainers"][0]["name"] == "prepare-model"
