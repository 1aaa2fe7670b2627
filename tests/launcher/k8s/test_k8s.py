"""Kubernetes manifests (cosyvoice_lb/launcher/k8s/, `cosyvoice-lb k8s render`): strict offline
validation against two Kubernetes versions' schemas of every document of every file written,
probe timings and the grace period's arithmetic, the pod's size (Guaranteed, from the plan)
and place, TLS and the client's address behind the ingress, secrets only in the Secret, the
HPA's metric the cluster really exposes, and the Dockerfile the Deployment runs."""

from __future__ import annotations

import dataclasses
import re
import stat

import pytest
import yaml
from conftest import ROOT, cli, cli_here

from cosyvoice_lb.common.settings import ENV_PREFIX, Settings, envvar
from cosyvoice_lb.launcher.cluster.status import ClusterStatus, InstanceStatus
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.k8s.manifests import (
    PRE_STOP_SECONDS,
    Deployment,
    instances_per_pod,
    manifests,
    write_manifests,
)
from cosyvoice_lb.launcher.k8s.objects import volume_claim
from cosyvoice_lb.launcher.k8s.pod import COSYVOICE_ROOT, POD_NAME_VARIABLES, pod_container, pod_volumes
from cosyvoice_lb.launcher.k8s.scheduling import parse_node_selector, parse_toleration
from cosyvoice_lb.launcher.k8s.sizing import PodSize
from cosyvoice_lb.launcher.panel.metrics import ClusterView, families

kubernetes_validate = pytest.importorskip("kubernetes_validate")
VERSIONS = ("1.30.0", "1.37.0")
# Custom resources, no schema in Kubernetes' own: checked by shape. (Prometheus Operator's
# ServiceMonitor and PrometheusRule, KEDA's ScaledObject.)
CRDS = {
    "ServiceMonitor": "monitoring.coreos.com/",
    "PrometheusRule": "monitoring.coreos.com/",
    "AlertmanagerConfig": "monitoring.coreos.com/",
    "ScaledObject": "keda.sh/",
}
V3 = Settings(engine="cosyvoice3", model_dir="/models/cv3", max_chars=300, drain_timeout=40, instance_concurrency="1")
# Every option of the pod's own: TLS, the pod network, the size, the place, the pull policy.
EVERYTHING = Deployment(
    model_volume="models",
    host="tts.example.org",
    storage_class="nfs",
    tls_secret="tts-tls",
    pod_cidr="10.244.0.0/16",
    cpu_per_instance=1.5,
    node_selector=(("nvidia.com/gpu.product", "NVIDIA-A10"),),
    tolerations=(parse_toleration("nvidia.com/gpu:NoSchedule"), parse_toleration("dedicated=tts")),
    anti_affinity="required",
    image_pull_policy="Always",
)
A_POD = PodSize(instances=2, memory_each=2**30, cpu_each=1.0)


def documents(files: dict[str, str]) -> list[dict]:
    """Every YAML document of every file (the Prometheus Adapter's config is a ConfigMap too)."""
    return [doc for text in files.values() for doc in yaml.safe_load_all(text) if doc]


def validate(doc: dict, version: str) -> None:
    """A core object strictly against Kubernetes' own schema (raises on any unknown or wrong
    field); a custom resource by shape."""
    assert isinstance(doc.get("apiVersion"), str) and isinstance(doc.get("kind"), str), doc
    assert isinstance(doc.get("metadata"), dict) and doc["metadata"].get("name"), doc
    if doc["kind"] in CRDS:
        assert doc["apiVersion"].startswith(CRDS[doc["kind"]]) and isinstance(doc.get("spec"), dict), doc
        return
    kubernetes_validate.validate(doc, version, strict=True)


def one(files: dict[str, str], kind: str, name: str = "") -> dict:
    found = [d for d in documents(files) if d["kind"] == kind and (not name or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


@pytest.fixture(scope="module")
def files():
    return manifests(V3, Deployment(model_volume="models", host="tts.example.org", storage_class="nfs"))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("deployment", [Deployment(model_volume="models", host="tts.example.org"), EVERYTHING])
def test_every_manifest_validates_strictly(deployment, version):
    docs = documents(manifests(V3, deployment))
    for doc in docs:
        validate(doc, version)
    core = sorted(d["kind"] for d in docs if d["kind"] not in CRDS)
    for kind in ("Secret", "PersistentVolumeClaim", "Deployment", "Service", "Ingress", "HorizontalPodAutoscaler"):
        assert kind in core
    assert core.count("Ingress") == 2 and "PodDisruptionBudget" in core and "ConfigMap" in core


@pytest.mark.parametrize("version", VERSIONS)
def test_kubectl_apply_takes_every_file_the_command_writes(tmp_path, version):
    # `kubectl apply -f DIR` reads every file in DIR: each document of each one must be an object
    # (whatever files there are: this reads the dir, not a list).
    written = write_manifests(V3, EVERYTHING, str(tmp_path / "k"))
    assert sorted(written) == sorted(p for p in (tmp_path / "k").iterdir())
    kinds = []
    for path in written:
        docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        assert docs, f"{path.name} holds no object"
        for doc in docs:
            assert isinstance(doc, dict), f"{path.name}: {doc!r} is no Kubernetes object"
            validate(doc, version)
            kinds.append(doc["kind"])
    assert "ConfigMap" in kinds and "Deployment" in kinds


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
    assert c["resources"]["requests"] == c["resources"]["limits"]  # CPU and memory too: QoS Guaranteed
    assert c["imagePullPolicy"] == "IfNotPresent"  # (Kubernetes' own default would be Always for :latest)
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
    own = {name for name in env if name.startswith(ENV_PREFIX)} - set(POD_NAME_VARIABLES)
    assert own <= fields  # every one a real setting (but the pod's name)
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
    names = [e["name"] for e in container(files)["env"]]
    assert names.index("POD_NAME") < names.index(envvar("outputs_dir"))


def test_a_claim_without_a_storage_class_leaves_the_class_out():
    # (absent: the cluster's default class; "" would ask for no class at all)
    claim = volume_claim(Deployment(), "outputs", "50Gi")
    assert "storageClassName" not in claim["spec"] and claim["metadata"]["name"] == "cosyvoice-lb-outputs"
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"


def test_the_model_is_mounted_read_only_at_the_model_dir_only_with_a_model_volume():
    given = Deployment(model_volume="models")
    mounts = {m["name"]: m for m in pod_container(V3, given, A_POD)["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": V3.model_dir, "readOnly": True}
    claims = {v["name"]: v for v in pod_volumes(given)}
    assert claims["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert "model" not in {m["name"] for m in pod_container(V3, Deployment(), A_POD)["volumeMounts"]}
    assert "model" not in {v["name"] for v in pod_volumes(Deployment())}
    without_dir = pod_container(dataclasses.replace(V3, model_dir=""), given, A_POD)
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
    adapter = yaml.safe_load(files["prometheus-adapter-rules.yaml"])
    assert adapter["kind"] == "ConfigMap" and set(adapter["data"]) == {"config.yaml"}  # the chart's key
    (rule,) = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]  # the adapter's own config file
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
    stages = re.findall(r"^FROM \$\{(\w+)\}", dockerfile, re.M)
    assert len(stages) == 2 and len(set(stages)) == 1  # both stages on the one base image
    assert re.search(rf"^ARG {stages[0]}=nvidia/cuda:\S+-runtime-", dockerfile, re.M)  # (a CUDA runtime by default)
    # cosyvoice3 pods find upstream's code where the image keeps it (their default --cosyvoice-root)
    assert f"COPY --from=build {COSYVOICE_ROOT} {COSYVOICE_ROOT}" in dockerfile
    assert re.search(r"^USER 10001:10001$", dockerfile, re.M)  # the Deployment's runAsUser
    assert dockerfile.rstrip().endswith('CMD ["cosyvoice-lb", "up", "--foreground"]')
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests", "api-token", "admin-token"} <= set(ignored)


def test_the_command_writes_the_files_and_refuses_what_cannot_work(tmp_path):
    done = cli("k8s", "render", "--out", str(tmp_path / "m"), "--instances", "1", "--replicas", "3")
    assert done.returncode == 0, done.stderr
    written = {p.name for p in (tmp_path / "m").iterdir()}
    assert {
        "secret.yaml",
        "volumes.yaml",
        "deployment.yaml",
        "service.yaml",
        "ingress.yaml",
        "hpa.yaml",
        "pdb.yaml",
        "servicemonitor.yaml",
        "prometheus-adapter-rules.yaml",
    } <= written
    assert sorted(written) == sorted(line.rsplit("/", 1)[-1] for line in done.stdout.splitlines()[:-1])
    assert "kubectl apply -f" in done.stdout
    bad = cli("k8s", "render", "--out", str(tmp_path / "n"), "--replicas", "9", "--max-replicas", "4")
    assert bad.returncode == 2 and "--replicas 9 is above --max-replicas 4" in bad.stderr
    refused = cli("k8s", "render", "--out", str(tmp_path / "o"), "--engine", "cosyvoice3")
    assert refused.returncode != 0 and "needs --model-dir" in refused.stderr


# --- the pod's size: requests = limits, from the plan --------------------------------------


def header_sums(text: str) -> dict[str, str]:
    """The sizing comment's totals in deployment.yaml: {"memory": "25Gi", "cpu": "8500m"}."""
    return dict(re.findall(r"^#\s+(memory|cpu):\s.*= (\S+)$", text, re.M))


def test_the_pod_is_guaranteed_and_sized_from_the_instances_its_gpu_holds(files):
    # 24 GiB less 1 holds 4 cosyvoice3 instances: 4 x 6 GiB of host memory + 1 GiB beside them,
    # 4 x 2 cores + half a core
    resources = container(files)["resources"]
    assert resources["limits"] == resources["requests"] == {"nvidia.com/gpu": 1, "cpu": "8500m", "memory": "25Gi"}
    assert header_sums(files["deployment.yaml"]) == {"memory": "25Gi", "cpu": "8500m"}
    assert re.search(r"^#\s+memory: 4 x 6Gi \+ 1Gi .* = 25Gi$", files["deployment.yaml"], re.M)
    bigger = container(manifests(V3, Deployment(gpu_memory="48GiB")))["resources"]["limits"]
    assert bigger["memory"] == "55Gi" and bigger["cpu"] == "18500m"  # 9 instances
    one = container(manifests(dataclasses.replace(V3, instances="1"), Deployment()))["resources"]["limits"]
    assert one["memory"] == "7Gi" and one["cpu"] == "2500m"


def test_the_sizes_per_instance_can_be_given_and_reach_the_pod():
    given = dataclasses.replace(V3, host_memory_per_instance="3GiB")
    files = manifests(given, Deployment(cpu_per_instance=1.5))
    assert container(files)["resources"]["limits"] == {"nvidia.com/gpu": 1, "cpu": "6500m", "memory": "13Gi"}
    assert header_sums(files["deployment.yaml"]) == {"memory": "13Gi", "cpu": "6500m"}
    # the pod's launcher checks its limit with the same figure
    env = {e["name"]: e.get("value") for e in container(files)["env"]}
    assert env[envvar("host_memory_per_instance")] == "3GiB"
    espeak = container(manifests(Settings(), Deployment()))["resources"]["limits"]
    assert espeak["memory"] == "3584Mi" and espeak["cpu"] == "4500m"  # 4 x 640 MiB + 1 GiB, 4 x 1 + 0.5


def test_a_pod_sized_here_passes_its_own_memory_check_and_one_instance_more_does_not():
    from cosyvoice_lb.common.sizes import parse_size
    from cosyvoice_lb.launcher.plan.host_memory import limit_problem, per_instance

    for settings in (V3, Settings(), dataclasses.replace(V3, host_memory_per_instance="4500MiB")):
        files = manifests(settings, Deployment())
        limit = parse_size(container(files)["resources"]["limits"]["memory"])
        per_pod = instances_per_pod(settings, Deployment())
        assert limit_problem(per_pod, per_instance(settings), limit) == ""
        assert "--instances" in limit_problem(per_pod + 1, per_instance(settings), limit)


def test_spares_and_surge_slots_count_in_the_pods_size():
    # (they run too: a spare always, a surge slot during a roll-out)
    two = container(manifests(dataclasses.replace(V3, instances="2"), Deployment()))["resources"]["limits"]
    more = dataclasses.replace(V3, instances="2", spares=1, surge=1)
    assert (
        two["memory"] == "13Gi" and container(manifests(more, Deployment()))["resources"]["limits"]["memory"] == "25Gi"
    )


# --- TLS and the client's address -------------------------------------------------------------


def test_tls_serves_both_ingresses_with_the_secret_and_redirects_plain_http():
    files = manifests(V3, EVERYTHING)
    for which in ("ui", "api"):
        ingress = one(files, "Ingress", f"cosyvoice-lb-{which}")
        assert ingress["spec"]["tls"] == [{"hosts": ["tts.example.org"], "secretName": "tts-tls"}]
        annotations = ingress["metadata"]["annotations"]
        assert annotations["nginx.ingress.kubernetes.io/ssl-redirect"] == "true"
        assert annotations["nginx.ingress.kubernetes.io/force-ssl-redirect"] == "true"
    plain = manifests(V3, Deployment(host="tts.example.org"))
    for which in ("ui", "api"):
        ingress = one(plain, "Ingress", f"cosyvoice-lb-{which}")
        assert "tls" not in ingress["spec"]
        assert not any("ssl-redirect" in key for key in ingress["metadata"]["annotations"])


def test_tls_without_a_host_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ClusterError, match="--tls-secret tts-tls needs --ingress-host"):
        write_manifests(V3, Deployment(tls_secret="tts-tls"), str(tmp_path / "k"))
    assert not (tmp_path / "k").exists()  # nothing written
    done = cli_here("k8s", "render", "--out", str(tmp_path / "m"), "--tls-secret", "tts-tls")
    assert done.returncode == 2 and "--tls-secret tts-tls needs --ingress-host" in done.stderr
    done = cli_here(
        "k8s", "render", "--out", str(tmp_path / "m"), "--tls-secret", "tts-tls", "--ingress-host", "a.example"
    )
    assert done.returncode == 0, done.stderr
    assert "secretName: tts-tls" in (tmp_path / "m" / "ingress.yaml").read_text()


def pod_env_of(settings: Settings, deployment: Deployment) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container(manifests(settings, deployment))["env"]}


def test_the_pods_nginx_trusts_the_pod_network_for_client_addresses_unless_told_otherwise(tmp_path):
    assert pod_env_of(V3, Deployment())[envvar("trusted_proxies")] == "10.0.0.0/8"
    assert pod_env_of(V3, Deployment(pod_cidr="10.244.0.0/16"))[envvar("trusted_proxies")] == "10.244.0.0/16"
    given = dataclasses.replace(V3, trusted_proxies="192.168.0.0/16")
    assert pod_env_of(given, Deployment(pod_cidr="10.244.0.0/16"))[envvar("trusted_proxies")] == "192.168.0.0/16"
    assert envvar("trusted_proxies") not in pod_env_of(V3, Deployment(pod_cidr=""))  # none: '' says so
    with pytest.raises(ClusterError, match=r"--pod-cidr: '10\.0\.0\.0/33' is not an address or a network"):
        write_manifests(V3, Deployment(pod_cidr="10.0.0.0/33"), str(tmp_path / "k"))
    done = cli_here("k8s", "render", "--out", str(tmp_path / "m"), "--trusted-proxies", "10.0.0.0/8,proxy.example")
    assert done.returncode == 2 and "--trusted-proxies: 'proxy.example' is not an address" in done.stderr


def test_the_pod_knows_its_name_and_cosyvoice3_finds_upstreams_code_where_the_image_keeps_it():
    env = container(manifests(V3, Deployment()))["env"]
    named = {e["name"]: e for e in env if "valueFrom" in e}
    assert named["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}  # (log_relay reads it)
    assert pod_env_of(V3, Deployment())[envvar("cosyvoice_root")] == COSYVOICE_ROOT == "/opt/cosyvoice"
    given = dataclasses.replace(V3, cosyvoice_root="/srv/CosyVoice")
    assert pod_env_of(given, Deployment())[envvar("cosyvoice_root")] == "/srv/CosyVoice"  # what was given wins
    auto = Settings(model_dir="/models/cv3")  # (auto: cosyvoice3 with a model dir)
    assert pod_env_of(auto, Deployment())[envvar("cosyvoice_root")] == COSYVOICE_ROOT
    assert envvar("cosyvoice_root") not in pod_env_of(Settings(), Deployment())  # espeak needs none


# --- where the pods run ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, toleration",
    [
        ("nvidia.com/gpu:NoSchedule", {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}),
        ("dedicated=tts:noexecute", {"key": "dedicated", "operator": "Equal", "value": "tts", "effect": "NoExecute"}),
        ("dedicated=tts", {"key": "dedicated", "operator": "Equal", "value": "tts"}),
        ("gpu", {"key": "gpu", "operator": "Exists"}),
    ],
)
def test_a_toleration_is_written_compactly(spec, toleration):
    assert parse_toleration(spec) == toleration


@pytest.mark.parametrize(
    "spec, words",
    [
        ("gpu:Sometimes", "the effect 'Sometimes' is none of NoSchedule, PreferNoSchedule, NoExecute"),
        (":NoSchedule", "its key is empty"),
        ("dedicated=:NoSchedule", "has '=' but no value"),
        ("bad key=x", "is not a label name"),
        ("a=b:NoSchedule:x", "the effect 'NoSchedule:x'"),
    ],
)
def test_a_malformed_toleration_is_refused_saying_why(spec, words):
    with pytest.raises(ValueError, match="KEY\\[=VALUE\\]\\[:EFFECT\\]") as refused:
        parse_toleration(spec)
    assert words in str(refused.value) and repr(spec) in str(refused.value)


def test_node_selectors_tolerations_and_anti_affinity_reach_the_pod():
    pod = one(manifests(V3, EVERYTHING), "Deployment")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A10"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "operator": "Equal", "value": "tts"},
    ]
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert (
        term["labelSelector"]["matchLabels"]
        == one(manifests(V3, EVERYTHING), "Deployment")["spec"]["selector"]["matchLabels"]
    )
    assert pod["containers"][0]["imagePullPolicy"] == "Always"
    plain = one(manifests(V3, Deployment()), "Deployment")["spec"]["template"]["spec"]
    assert "nodeSelector" not in plain and "tolerations" not in plain
    assert list(plain["affinity"]["podAntiAffinity"]) == ["preferredDuringSchedulingIgnoredDuringExecution"]


def test_node_selectors_are_labels_given_once():
    assert parse_node_selector(["a=1", "b.example/c=2", "a=1"]) == (("a", "1"), ("b.example/c", "2"))
    with pytest.raises(ValueError, match="has no '='"):
        parse_node_selector(["gpu"])
    with pytest.raises(ValueError, match="given twice"):
        parse_node_selector(["a=1", "a=2"])


def test_the_command_takes_the_scheduling_flags_and_refuses_malformed_ones(tmp_path):
    out = tmp_path / "m"
    done = cli_here(
        "k8s",
        "render",
        "--out",
        str(out),
        "--node-selector",
        "gpu=a10",
        "--toleration",
        "nvidia.com/gpu:NoSchedule",
        "--anti-affinity",
        "required",
        "--image-pull-policy",
        "Never",
        "--cpu-per-instance",
        "3",
        "--host-memory-per-instance",
        "2GiB",
        "--instances",
        "2",
    )
    assert done.returncode == 0, done.stderr
    pod = yaml.safe_load((out / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "a10"} and pod["tolerations"][0]["operator"] == "Exists"
    assert "requiredDuringSchedulingIgnoredDuringExecution" in pod["affinity"]["podAntiAffinity"]
    limits = pod["containers"][0]["resources"]["limits"]
    assert pod["containers"][0]["imagePullPolicy"] == "Never" and limits["cpu"] == "6500m" and limits["memory"] == "5Gi"
    bad = cli_here("k8s", "render", "--out", str(tmp_path / "n"), "--toleration", "gpu:Sometimes")
    assert bad.returncode == 2 and "--toleration 'gpu:Sometimes'" in bad.stderr and "KEY[=VALUE][:EFFECT]" in bad.stderr
    bad = cli_here("k8s", "render", "--out", str(tmp_path / "n"), "--node-selector", "gpu")
    assert bad.returncode == 2 and "--node-selector 'gpu' has no '='" in bad.stderr
    assert not (tmp_path / "n").exists()
