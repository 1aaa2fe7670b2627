"""Kubernetes manifests (cosyvoice_lb/launcher/k8s/, `cosyvoice-lb k8s render`): strict offline
validation against two Kubernetes versions' schemas, probe timings and the grace period's
arithmetic, secrets only in the Secret, the HPA's metric the cluster really exposes, and the
Dockerfile the Deployment runs."""

from __future__ import annotations

import dataclasses
import re
import stat

import pytest
import yaml
from conftest import ROOT, cli

from cosyvoice_lb.common.settings import ENV_PREFIX, Settings, envvar
from cosyvoice_lb.launcher.cluster.status import ClusterStatus, InstanceStatus
from cosyvoice_lb.launcher.k8s.manifests import PRE_STOP_SECONDS, Deployment, manifests, write_manifests
from cosyvoice_lb.launcher.k8s.objects import pod_container, pod_volumes, volume_claim
from cosyvoice_lb.launcher.panel.metrics import ClusterView, families

kubernetes_validate = pytest.importorskip("kubernetes_validate")
VERSIONS = ("1.30.0", "1.37.0")
CRDS = {"ServiceMonitor"}  # (a Prometheus Operator resource: no schema in Kubernetes' own)
V3 = Settings(engine="cosyvoice3", model_dir="/models/cv3", max_chars=300, drain_timeout=40)


def documents(files: dict[str, str]) -> list[dict]:
    return [
        doc
        for name, text in files.items()
        if name != "prometheus-adapter-rules.yaml"
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def one(files: dict[str, str], kind: str, name: str = "") -> dict:
    found = [d for d in documents(files) if d["kind"] == kind and (not name or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


@pytest.fixture(scope="module")
def files():
    return manifests(V3, Deployment(model_volume="models", host="tts.example.org", storage_class="nfs"))


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_strictly(files, version):
    checked = []
    for doc in documents(files):
        if doc["kind"] in CRDS:
            continue
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any unknown or wrong field
        checked.append(doc["kind"])
    assert sorted(checked) == sorted(
        [
            "Secret",
            "PersistentVolumeClaim",
            "PersistentVolumeClaim",
            "Deployment",
            "Service",
            "Ingress",
            "Ingress",
            "HorizontalPodAutoscaler",
            "PodDisruptionBudget",
        ]
    )


def test_strict_validation_can_fail(files):
    broken = one(files, "Deployment")
    broken = {**broken, "spec": {**broken["spec"], "replicaz": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[0], strict=True)


def container(files) -> dict:
    return one(files, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def test_one_gpu_per_pod_running_the_launcher_in_the_foreground(files):
    c = container(files)
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["command"][:2] == ["sh", "-c"] and c["command"][2].endswith("exec cosyvoice-lb up --foreground")
    pod = one(files, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    terms = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert one(files, "Deployment")["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_the_pod_gets_the_settings_as_the_launcher_reads_them(files):
    env = {e["name"]: e.get("value") for e in container(files)["env"]}
    assert env[envvar("max_chars")] == "300" and env[envvar("engine")] == "cosyvoice3"
    assert env[envvar("model_dir")] == "/models/cv3" and env[envvar("drain_timeout")] == str(V3.drain_timeout)
    assert envvar("probe_interval") not in env  # a default: left to the launcher
    fields = {envvar(f.name) for f in dataclasses.fields(Settings)}
    assert {name for name in env if name.startswith(ENV_PREFIX)} <= fields  # every one a real setting
    assert env[envvar("public")] == "1" and env[envvar("port")] == "8080"


def test_probes_allow_a_long_load_and_say_ready_only_with_an_instance_ready(files):
    c = container(files)
    startup = c["startupProbe"]
    assert startup["httpGet"] == {"path": "/ping", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= max(300, V3.startup_timeout + 60)
    assert c["readinessProbe"]["httpGet"]["path"] == "/ping"
    assert "tcpSocket" in c["livenessProbe"]  # nginx alive; instances restarting inside are not a dead pod
    slow = manifests(dataclasses.replace(V3, startup_timeout=900), Deployment())
    probe = container(slow)["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 960


def test_the_grace_period_covers_the_drain_and_says_how(files):
    pod = one(files, "Deployment")["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    # preStop, health loop, the instances' drain (+5 s to exit), nginx's QUIT, slack
    assert grace == PRE_STOP_SECONDS + 10 + (V3.drain_timeout + 5) + 15 + 10 == 85
    assert container(files)["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRE_STOP_SECONDS)]
    assert re.search(rf"#\s+{grace} s\s+terminationGracePeriodSeconds", files["deployment.yaml"])
    longer = manifests(dataclasses.replace(V3, drain_timeout=120), Deployment())
    assert one(longer, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == grace + 80


def test_tokens_live_in_the_secret_only(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("# ours\n" + "a" * 32 + "\n")
    tokens.chmod(0o600)
    written = write_manifests(dataclasses.replace(V3, api_token_file=str(tokens)), Deployment(), str(tmp_path / "k"))
    secret_file = tmp_path / "k" / "secret.yaml"
    assert secret_file in written and stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    import base64

    data = yaml.safe_load(secret_file.read_text())["data"]
    assert base64.b64decode(data["api-tokens"]).decode() == "a" * 32 + "\n"
    assert len(base64.b64decode(data["admin-tokens"]).strip()) >= 32  # made: none was given
    for path in written:
        if path != secret_file:
            assert "a" * 32 not in path.read_text() and stat.S_IMODE(path.stat().st_mode) == 0o644


def test_shared_voices_and_per_pod_outputs(files):
    voices = one(files, "PersistentVolumeClaim", "cosyvoice-lb-voices")
    assert voices["spec"]["accessModes"] == ["ReadWriteMany"] and voices["spec"]["storageClassName"] == "nfs"
    env = {e["name"]: e.get("value") for e in container(files)["env"]}
    assert env[envvar("voices_dir")] == "/srv/voices" and env[envvar("outputs_dir")] == "/srv/outputs/$(POD_NAME)"
    assert env["POD_NAME"] is None  # (from the downward API, defined before its use)


def test_a_claim_without_a_storage_class_leaves_the_class_out():
    # (absent: the cluster's default class; "" would ask for no class at all)
    claim = volume_claim(Deployment(), "outputs", "50Gi")
    assert "storageClassName" not in claim["spec"] and claim["metadata"]["name"] == "cosyvoice-lb-outputs"
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"


def test_the_model_is_mounted_read_only_at_the_model_dir_only_with_a_model_volume():
    given = Deployment(model_volume="models")
    mounts = {m["name"]: m for m in pod_container(V3, given)["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": V3.model_dir, "readOnly": True}
    claims = {v["name"]: v for v in pod_volumes(given)}
    assert claims["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert "model" not in {m["name"] for m in pod_container(V3, Deployment())["volumeMounts"]}
    assert "model" not in {v["name"] for v in pod_volumes(Deployment())}
    without_dir = pod_container(dataclasses.replace(V3, model_dir=""), given)
    assert "model" not in {m["name"] for m in without_dir["volumeMounts"]}  # nowhere to mount it


def test_the_ui_sticks_and_the_api_balances(files):
    ui, api = one(files, "Ingress", "cosyvoice-lb-ui"), one(files, "Ingress", "cosyvoice-lb-api")
    assert ui["metadata"]["annotations"]["nginx.ingress.kubernetes.io/affinity"] == "cookie"
    assert "nginx.ingress.kubernetes.io/affinity" not in api["metadata"]["annotations"]
    assert api["spec"]["rules"][0]["http"]["paths"][0]["path"] == "/v1"
    assert ui["spec"]["rules"][0]["host"] == "tts.example.org"


def test_the_hpa_scales_on_a_metric_the_cluster_exposes(files):
    hpa = one(files, "HorizontalPodAutoscaler")
    pods = next(m for m in hpa["spec"]["metrics"] if m["type"] == "Pods")
    assert {m["type"] for m in hpa["spec"]["metrics"]} == {"Pods", "Resource"}
    (rule,) = yaml.safe_load(files["prometheus-adapter-rules.yaml"])["rules"]
    assert rule["name"]["as"] == pods["pods"]["metric"]["name"]
    series = rule["seriesQuery"].split("{")[0]
    view = ClusterView(
        status=ClusterStatus(
            running=True, instances=[InstanceStatus("instance-0", 7860, 0, 1, "RUNNING", True, True, 0, 1.0, waiting=3)]
        )
    )
    assert series in {f.name for f in families(view)}
    assert one(files, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


def test_the_service_monitor_reads_every_metrics_endpoint_with_the_scrape_token(files):
    monitor = one(files, "ServiceMonitor")
    paths = [e["path"] for e in monitor["spec"]["endpoints"]]
    assert paths == ["/metrics"] + [f"/metrics/instance-{i}" for i in range(4)]  # 4 x 5 GiB fit 24 GiB less 1
    secret = one(files, "Secret")
    for endpoint in monitor["spec"]["endpoints"]:
        credentials = endpoint["authorization"]["credentials"]
        assert credentials["name"] == secret["metadata"]["name"] and credentials["key"] in secret["data"]


def test_the_image_is_multi_stage_cuda_non_root_and_runs_the_launcher():
    dockerfile = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    assert len(stages) == 2 and all("CUDA_IMAGE" in s for s in stages)
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-runtime-", dockerfile, re.M)
    assert re.search(r"^USER 10001:10001$", dockerfile, re.M)  # the Deployment's runAsUser
    assert dockerfile.rstrip().endswith('CMD ["cosyvoice-lb", "up", "--foreground"]')
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests", "api-token", "admin-token"} <= set(ignored)


def test_the_command_writes_the_files_and_refuses_what_cannot_work(tmp_path):
    done = cli("k8s", "render", "--out", str(tmp_path / "m"), "--instances", "1", "--replicas", "3")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == sorted(
        [
            "secret.yaml",
            "volumes.yaml",
            "deployment.yaml",
            "service.yaml",
            "ingress.yaml",
            "hpa.yaml",
            "pdb.yaml",
            "servicemonitor.yaml",
            "prometheus-adapter-rules.yaml",
        ]
    )
    assert "kubectl apply -f" in done.stdout
    bad = cli("k8s", "render", "--out", str(tmp_path / "n"), "--replicas", "9", "--max-replicas", "4")
    assert bad.returncode == 2 and "--replicas 9 is above --max-replicas 4" in bad.stderr
    refused = cli("k8s", "render", "--out", str(tmp_path / "o"), "--engine", "cosyvoice3")
    assert refused.returncode != 0 and "needs --model-dir" in refused.stderr
