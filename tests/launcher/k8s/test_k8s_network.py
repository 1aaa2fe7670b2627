"""Who may reach the pods (cosyvoice_lb/launcher/k8s/network.py, `k8s render --network-policy`):
the NetworkPolicy validates strictly, lets in the pod's one port (the Service's target, the
ServiceMonitor's and the probes') from the ingress controller's and the monitoring namespaces
only, picked by the namespace-name label, and lets out DNS and the jobs' Redis; --pod-label
labels the pod template and nothing else, and a label Kubernetes would refuse is refused."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from conftest import cli_here
from test_k8s import VERSIONS, documents, one, validate

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.k8s.manifests import Deployment, manifests
from cosyvoice_lb.launcher.k8s.network import NAMESPACE_LABEL, network_fields, parse_pod_labels

pytest.importorskip("kubernetes_validate")
ESPEAK = Settings(engine="espeak", instances="2")
POLICY = Deployment(name="tts", namespace="audio", network_policy=True)
REDIS = "redis://:pw@redis.jobs.svc:6380/0"


def policy(settings: Settings = ESPEAK, deployment: Deployment = POLICY) -> dict:
    return one(manifests(settings, deployment), "NetworkPolicy")


def sources(found: dict) -> list[str]:
    (rule,) = found["spec"]["ingress"]
    return [peer["namespaceSelector"]["matchLabels"][NAMESPACE_LABEL] for peer in rule["from"]]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    "settings, deployment",
    [
        (ESPEAK, POLICY),
        (Settings(engine="espeak", jobs_redis=REDIS), dataclasses.replace(POLICY, monitoring_namespace="")),
        (ESPEAK, dataclasses.replace(POLICY, jobs_redis_secret=("redis", "url"), pod_labels=(("team", "audio"),))),
    ],
)
def test_the_policy_and_every_other_object_validate_strictly(settings, deployment, version):
    docs = documents(manifests(settings, deployment))
    for doc in docs:
        validate(doc, version)
    assert [d["kind"] for d in docs].count("NetworkPolicy") == 1


def test_no_policy_unless_asked():
    assert "networkpolicy.yaml" not in manifests(ESPEAK, Deployment())
    assert "NetworkPolicy" not in {d["kind"] for d in documents(manifests(ESPEAK, Deployment()))}


def test_only_the_ingress_and_monitoring_namespaces_reach_the_pods_port():
    files = manifests(ESPEAK, POLICY)
    found = one(files, "NetworkPolicy")
    pod = one(files, "Deployment")["spec"]["template"]
    # it picks this deployment's pods, as the Deployment's selector does
    assert found["spec"]["podSelector"]["matchLabels"] == one(files, "Deployment")["spec"]["selector"]["matchLabels"]
    assert found["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert found["metadata"]["namespace"] == "audio" and set(found["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert sources(found) == ["ingress-nginx", "monitoring"]
    (rule,) = found["spec"]["ingress"]
    assert all(set(peer) == {"namespaceSelector"} for peer in rule["from"])  # every pod of those namespaces
    # the one port it lets in is the port the Service sends to and Prometheus scrapes (named http)
    (http,) = [p for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "http"]
    assert rule["ports"] == [{"protocol": "TCP", "port": http["containerPort"]}]
    assert one(files, "Service")["spec"]["ports"][0]["targetPort"] == "http"
    assert {e["port"] for e in one(files, "ServiceMonitor")["spec"]["endpoints"]} == {"http"}


def test_other_namespaces_and_none_for_monitoring():
    found = policy(deployment=dataclasses.replace(POLICY, ingress_namespace="traefik", monitoring_namespace="obs"))
    assert sources(found) == ["traefik", "obs"]
    assert sources(policy(deployment=dataclasses.replace(POLICY, monitoring_namespace=""))) == ["ingress-nginx"]


def egress_ports(found: dict) -> set[tuple[str, int]]:
    return {(p["protocol"], p["port"]) for rule in found["spec"]["egress"] for p in rule["ports"]}


def test_out_dns_only_and_the_jobs_redis_when_the_pods_share_one():
    assert egress_ports(policy()) == {("UDP", 53), ("TCP", 53)}
    assert all("to" not in rule for rule in policy()["spec"]["egress"])  # (the cluster's DNS, wherever it is)
    shared = policy(Settings(engine="espeak", jobs_redis=REDIS))
    assert egress_ports(shared) == {("UDP", 53), ("TCP", 53), ("TCP", 6380)}  # the URL's port
    default_port = policy(Settings(engine="espeak", jobs_redis="redis://redis.jobs.svc/0"))
    assert ("TCP", 6379) in egress_ports(default_port)
    by_secret = policy(deployment=dataclasses.replace(POLICY, jobs_redis_secret=("redis", "url")))
    assert ("TCP", 6379) in egress_ports(by_secret)  # (the URL is not known here: Redis's own port)


def test_the_header_says_what_gets_in_and_out():
    text = manifests(Settings(engine="espeak", jobs_redis=REDIS), POLICY)["networkpolicy.yaml"]
    header = text.split("apiVersion")[0]
    assert "namespace ingress-nginx" in header and "namespace monitoring" in header and "8080" in header
    assert "DNS" in header and "Redis (port 6380" in header and "pw" not in text


def test_pod_labels_go_on_the_pod_template_and_nowhere_else():
    files = manifests(
        ESPEAK, dataclasses.replace(POLICY, pod_labels=(("cost-center", "tts"), ("example.org/team", "")))
    )
    deployment = one(files, "Deployment")
    assert deployment["spec"]["template"]["metadata"]["labels"] == {
        "app.kubernetes.io/name": "cosyvoice-lb",
        "app.kubernetes.io/instance": "tts",
        "cost-center": "tts",
        "example.org/team": "",
    }
    for doc in documents(files):
        assert "cost-center" not in doc["metadata"].get("labels", {}), doc["kind"]
    assert "cost-center" not in yaml.safe_dump(deployment["spec"]["selector"])
    assert "cost-center" not in yaml.safe_dump(one(files, "NetworkPolicy")["spec"]["podSelector"])
    assert "cost-center" not in yaml.safe_dump(one(files, "Service")["spec"]["selector"])


@pytest.mark.parametrize(
    "given, says",
    [
        ("team", "has no '='"),
        ("=x", "its key is empty"),
        ("Team/x=y", "not a DNS subdomain"),
        ("team=a b", "not a label value"),
        ("-team=x", "not a label name"),
        ("t" * 64 + "=x", "not a label name"),
        ("team=" + "v" * 64, "not a label value"),
        ("app.kubernetes.io/instance=other", "the app's own label"),
    ],
)
def test_pod_labels_that_kubernetes_refuses(given, says):
    with pytest.raises(ClusterError, match=says):
        parse_pod_labels([given])


def test_a_pod_label_given_twice_with_two_values_is_refused_and_once_more_is_fine():
    with pytest.raises(ClusterError, match="given twice"):
        parse_pod_labels(["team=a", "team=b"])
    assert parse_pod_labels(["team=a", " team = a ", "tier="]) == (("team", "a"), ("tier", ""))


@pytest.mark.parametrize(
    "values, says",
    [
        ({"ingress_namespace": ""}, "would let no client reach the pods"),
        ({"ingress_namespace": "Ingress"}, "--ingress-namespace 'Ingress' is not a namespace's name"),
        ({"monitoring_namespace": "a" * 64}, "--monitoring-namespace"),
        ({"monitoring_namespace": "obs.svc"}, "not a namespace's name"),
    ],
)
def test_namespaces_kubernetes_refuses(values, says):
    with pytest.raises(ClusterError, match=says):
        network_fields(dict(values))


def test_the_command_writes_the_policy_and_a_render_without_it_takes_it_away(tmp_path):
    out = tmp_path / "k"
    done = cli_here(
        "k8s", "render", "--out", str(out), "--engine", "espeak", "--network-policy",
        "--ingress-namespace", "traefik", "--monitoring-namespace", "", "--pod-label", "cost-center=tts",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    written = yaml.safe_load((out / "networkpolicy.yaml").read_text())
    assert sources(written) == ["traefik"]
    labels = yaml.safe_load((out / "deployment.yaml").read_text().split("\n", 1)[1])
    assert labels["spec"]["template"]["metadata"]["labels"]["cost-center"] == "tts"
    again = cli_here("k8s", "render", "--out", str(out), "--engine", "espeak")
    assert again.returncode == 0, again.stderr
    assert not (out / "networkpolicy.yaml").exists()  # (`kubectl apply -f` would apply it again)
    bad = cli_here("k8s", "render", "--out", str(tmp_path / "n"), "--pod-label", "cost center=tts")
    assert bad.returncode == 2 and "--pod-label 'cost center=tts'" in bad.stderr and "e.g. --pod-label" in bad.stderr
    assert not (tmp_path / "n").exists()  # refused before anything is written
