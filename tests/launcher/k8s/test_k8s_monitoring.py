"""Prometheus Operator's objects of `k8s render` (cosyvoice_lb/launcher/k8s/monitoring.py): the
ServiceMonitor labels every relayed instance series with its instance's name, so no two
endpoints of a pod yield one series; the PrometheusRule carries the box's alert rules from
the one source (render/prometheus.py's alert_groups), scoped to the deployment's pods, and
Prometheus's own promtool accepts and unit-tests them; --monitor-label labels both objects
and refuses what Kubernetes would.

The real Prometheus scraping the ServiceMonitor's endpoints is
tests/integration/test_k8s_scrape.py."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml
from conftest import cli_here, document

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.k8s.manifests import Deployment, instances_per_pod, manifests
from cosyvoice_lb.launcher.k8s.monitoring import (
    INSTANCE_LABEL,
    label_problem,
    parse_monitor_labels,
    pod_scope,
    prometheus_rule,
    service_monitor,
)
from cosyvoice_lb.launcher.plan.planner import Slot
from cosyvoice_lb.launcher.render.prometheus import alert_groups, alert_rules, scrape_targets

V3 = Settings(engine="cosyvoice3", model_dir="/models/cv3")
TTS = Deployment(name="tts", namespace="audio", monitor_labels=(("team", "audio"), ("example.org/tier", "gpu")))
# What Prometheus Operator puts on every target of a ServiceMonitor's endpoint: the same for
# every endpoint of one pod (none of them is the path).
OPERATOR_LABELS = ("job", "instance", "namespace", "service", "pod", "container", "endpoint")


def by_name(groups: list[dict]) -> dict[str, dict]:
    (group,) = groups
    return {rule["alert"]: rule for rule in group["rules"]}


@pytest.fixture(scope="module")
def files() -> dict[str, str]:
    return manifests(V3, TTS)


# --- the ServiceMonitor ------------------------------------------------------------------------


def test_each_relay_labels_its_series_with_its_instance(files):
    monitor = document(files, "servicemonitor.yaml")
    per_pod = instances_per_pod(V3, TTS)
    assert per_pod >= 2
    endpoints = monitor["spec"]["endpoints"]
    assert [e["path"] for e in endpoints] == ["/metrics"] + [f"/metrics/instance-{i}" for i in range(per_pod)]
    assert "relabelings" not in endpoints[0]  # the cluster's metrics carry name as their own label
    for i, endpoint in enumerate(endpoints[1:]):
        assert endpoint["relabelings"] == [
            {"action": "replace", "targetLabel": INSTANCE_LABEL, "replacement": f"instance-{i}"}
        ]


def target_labels(endpoint: dict) -> dict[str, str]:
    """A target's labels as the operator's Prometheus gives them (one pod), after the
    endpoint's relabelings (a replace with no source labels sets its target label)."""
    found = {label: f"same-for-every-endpoint-{label}" for label in OPERATOR_LABELS}
    for relabel in endpoint.get("relabelings", []):
        assert relabel["action"] == "replace" and "sourceLabels" not in relabel
        found[relabel["targetLabel"]] = relabel["replacement"]
    return found


def test_no_two_endpoints_of_a_pod_yield_the_same_series():
    for per_pod in (1, 2, 5):
        endpoints = service_monitor(TTS, per_pod)["spec"]["endpoints"]
        labelled = [tuple(sorted(target_labels(e).items())) for e in endpoints]
        assert len(set(labelled)) == len(endpoints) == per_pod + 1


def test_the_instance_label_is_the_boxs_and_not_prometheuss_own():
    # On a box an instance's series carry `name` (targets.json); the cluster's metrics too.
    (group,) = json.loads(scrape_targets([Slot(index=3, port=7863, gpu=0, memory=1)]))
    assert group["labels"][INSTANCE_LABEL] == "instance-3"
    # `instance` is the target's address (tells pods apart), `job` the Service: never overwritten.
    assert INSTANCE_LABEL not in ("instance", "job", "pod", "namespace", "service", "endpoint", "container")
    assert not INSTANCE_LABEL.startswith("__")


def test_the_service_monitor_reads_with_the_scrape_token_of_the_secret(files):
    secret = document(files, "secret.yaml")
    for endpoint in document(files, "servicemonitor.yaml")["spec"]["endpoints"]:
        assert endpoint["authorization"]["type"] == "Bearer"
        credentials = endpoint["authorization"]["credentials"]
        assert credentials == {"name": secret["metadata"]["name"], "key": "scrape-token"}
    assert "&id" not in files["servicemonitor.yaml"] and "*id" not in files["servicemonitor.yaml"]  # no YAML aliases


# --- the PrometheusRule: the box's rules, from the one source ------------------------------


def test_the_rule_is_the_one_source_in_the_pods_scope(files):
    rule = document(files, "prometheusrule.yaml")
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert (rule["metadata"]["name"], rule["metadata"]["namespace"]) == ("tts", "audio")
    assert rule["spec"]["groups"] == alert_groups(V3, pod_scope(TTS))
    assert prometheus_rule(V3, TTS) == rule


def unscoped(expr: str) -> str:
    """A pod-scoped expression with the scope taken out again: what the box's would be."""
    expr = expr.replace('namespace="audio",job="tts",', "").replace('{namespace="audio",job="tts"}', "")
    expr = expr.replace(f'up{{{INSTANCE_LABEL}!=""}}', 'up{job="cosyvoice-instances"}')
    expr = expr.replace(f'up{{{INSTANCE_LABEL}=""}}', 'up{job="cosyvoice-lb"}')
    expr = expr.replace("(namespace, pod, name)", "(name)").replace("by (namespace, job, le)", "by (le)")
    expr = expr.replace("by (namespace, pod, name, le)", "by (name, le)")
    return expr.replace("sum by (namespace, job) (", "sum(")


def test_the_rule_carries_the_same_rules_as_alerts_yml(files):
    box = by_name(yaml.safe_load(alert_rules(V3))["groups"])
    pods = by_name(document(files, "prometheusrule.yaml")["spec"]["groups"])
    assert list(pods) == list(box) and len(box) == 11
    for name, rule in box.items():
        assert unscoped(pods[name]["expr"]) == rule["expr"], name
        assert pods[name].get("for") == rule.get("for") and pods[name]["labels"] == rule["labels"], name
        assert set(pods[name]["annotations"]) == set(rule["annotations"]), name


def test_every_series_the_rule_reads_is_the_deployments(files):
    # Prometheus evaluates a PrometheusRule over everything it scrapes: each selector carries
    # the deployment's namespace and job (the Service's name), so two deployments never mix.
    pods = by_name(document(files, "prometheusrule.yaml")["spec"]["groups"])
    for name, rule in pods.items():
        expr = re.sub(r"\[\w+\]", "", rule["expr"])
        selectors = re.findall(r"\b(cosyvoice_\w+|up)\b(\{[^}]*\})?", expr)
        assert selectors, name
        for metric, matchers in selectors:
            assert matchers.startswith('{namespace="audio",job="tts"'), (name, metric, matchers)


def test_per_pod_rules_tell_instances_apart_by_pod(files):
    pods = by_name(document(files, "prometheusrule.yaml")["spec"]["groups"])
    assert " unless on (namespace, pod, name) " in pods["CosyVoiceInstanceDown"]["expr"]
    assert pods["CosyVoiceRestartStorm"]["expr"].startswith("sum by (namespace, pod, name) (")
    assert pods["CosyVoiceNoInstanceInRotation"]["expr"].startswith("sum by (namespace, job) (")
    assert (
        pods["CosyVoiceInstanceScrapeFailing"]["expr"] == f'up{{namespace="audio",job="tts",{INSTANCE_LABEL}!=""}} == 0'
    )
    assert pods["CosyVoiceClusterMetricsDown"]["expr"] == f'up{{namespace="audio",job="tts",{INSTANCE_LABEL}=""}} == 0'
    description = pods["CosyVoiceInstanceDown"]["annotations"]["description"]
    assert "`kubectl exec -n audio {{ $labels.pod }} -- cosyvoice-lb logs {{ $labels.name }}`" in description
    assert "{{ $labels.pod }}" in pods["CosyVoiceInstanceDown"]["annotations"]["summary"]
    first = pods["CosyVoiceFirstPackageSlow"]["annotations"]["description"]
    assert "`kubectl exec -n audio deploy/tts -- cosyvoice-lb status`" in first  # no pod label there


def test_the_stale_threshold_follows_the_pods_probes():
    slow = Settings(probe_interval=30.0, probe_timeout=5.0)
    pods = by_name(prometheus_rule(slow, TTS)["spec"]["groups"])
    assert pods["CosyVoiceHealthLoopStale"]["expr"].endswith("} > 160")


# --- --monitor-label ---------------------------------------------------------------------------


def test_monitor_labels_label_both_objects_and_nothing_else(files):
    for name in ("servicemonitor.yaml", "prometheusrule.yaml"):
        labels = document(files, name)["metadata"]["labels"]
        assert labels["team"] == "audio" and labels["example.org/tier"] == "gpu", name
        assert labels["app.kubernetes.io/name"] == "cosyvoice-lb" and labels["app.kubernetes.io/instance"] == "tts"
    assert "team" not in document(files, "servicemonitor.yaml")["spec"]["selector"]["matchLabels"]
    assert "team" not in document(files, "service.yaml")["metadata"]["labels"]


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (["team=audio"], (("team", "audio"),)),
        (
            ["team=audio", "example.org/tier=gpu", "release="],
            (("team", "audio"), ("example.org/tier", "gpu"), ("release", "")),
        ),
        (["team=audio", "team=audio"], (("team", "audio"),)),
        (["a" * 63 + "=" + "b" * 63], (("a" * 63, "b" * 63),)),
    ],
)
def test_monitor_labels_that_kubernetes_takes(given, expected):
    assert parse_monitor_labels(given) == expected


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("team", "has no '='"),
        ("=audio", "its key is empty"),
        ("/team=audio", "empty prefix"),
        ("Example.org/team=audio", "not a DNS subdomain"),
        ("-team=audio", "not a label name"),
        ("a" * 64 + "=x", "not a label name"),
        ("team=audio team", "not a label value"),
        ("team=" + "b" * 64, "not a label value"),
        ("team=-audio", "not a label value"),
        ("app.kubernetes.io/name=x", "the app's own label"),
    ],
)
def test_monitor_labels_that_kubernetes_refuses(given, says):
    with pytest.raises(ClusterError, match=re.escape(says)):
        parse_monitor_labels([given])


def test_a_key_given_twice_with_two_values_is_refused():
    with pytest.raises(ClusterError, match="team is given twice"):
        parse_monitor_labels(["team=audio", "team=video"])


def test_label_problem_is_empty_for_a_good_label():
    assert label_problem("app.example.org/team_name-1", "v1.2_x") == ""
    assert label_problem("team", "") == ""


def test_the_command_labels_the_objects_and_refuses_a_bad_label(tmp_path):
    done = cli_here(
        "k8s", "render", "--out", str(tmp_path / "m"), "--instances", "2",
        "--monitor-label", "team=audio", "--monitor-label", "prometheus=main",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for name in ("servicemonitor.yaml", "prometheusrule.yaml"):
        labels = yaml.safe_load((tmp_path / "m" / name).read_text())["metadata"]["labels"]
        assert labels["team"] == "audio" and labels["prometheus"] == "main", name
    bad = cli_here("k8s", "render", "--out", str(tmp_path / "n"), "--monitor-label", "team")
    assert bad.returncode == 2 and "--monitor-label 'team' has no '='" in bad.stderr
    assert "e.g. --monitor-label team=audio" in bad.stderr
    assert not (tmp_path / "n").exists()  # refused before anything is written
    bad = cli_here("k8s", "render", "--out", str(tmp_path / "o"), "--monitor-label", "Team/x=y")
    assert bad.returncode == 2 and "not a DNS subdomain" in bad.stderr


# --- promtool: Prometheus's own checks of the PrometheusRule's groups ----------------------


def write_rules(path, files: dict[str, str]) -> None:
    groups = document(files, "prometheusrule.yaml")["spec"]["groups"]
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False), encoding="utf-8")


def test_promtool_accepts_the_prometheus_rules_groups(promtool, files, tmp_path):
    write_rules(tmp_path / "rules.yml", files)
    done = subprocess.run(
        [promtool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "11 rules found" in done.stdout + done.stderr


def series(metric: str, pod: str, namespace: str = "audio", **labels: str) -> str:
    every = {"namespace": namespace, "job": "tts", "pod": pod, "instance": f"{pod}-ip:8080", **labels}
    return metric + "{" + ", ".join(f'{k}="{v}"' for k, v in every.items()) + "}"


def expanded(text: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)


def firing(files, alert: str, labels: dict[str, str]) -> dict:
    """The alert promtool should see: the series' labels and the rule's, its messages filled in."""
    rule = by_name(document(files, "prometheusrule.yaml")["spec"]["groups"])[alert]
    return {
        "exp_labels": {**labels, **rule["labels"]},
        "exp_annotations": {k: expanded(v, labels) for k, v in rule["annotations"].items()},
    }


def test_promtool_unit_tests_of_the_per_pod_rules(promtool, files, tmp_path):
    # Two pods, each with an instance-0, and another namespace's pod: a drained instance-0 in
    # pod a hides no other pod's; a relay that does not answer is an instance's scrape failing,
    # not the cluster's; another deployment's series set off nothing.
    write_rules(tmp_path / "rules.yml", files)
    a0 = {"namespace": "audio", "job": "tts", "pod": "tts-a", "instance": "tts-a-ip:8080", "name": "instance-0"}
    b0 = {**a0, "pod": "tts-b", "instance": "tts-b-ip:8080"}
    inputs = [
        (series("cosyvoice_lb_instance_up", "tts-a", name="instance-0"), "0x10"),
        (series("cosyvoice_lb_instance_ready", "tts-a", name="instance-0"), "0x10"),
        (series("cosyvoice_lb_instance_drained", "tts-a", name="instance-0"), "1x10"),
        (series("cosyvoice_lb_instance_up", "tts-b", name="instance-0"), "0x10"),
        (series("cosyvoice_lb_instance_ready", "tts-b", name="instance-0"), "0x10"),
        (series("cosyvoice_lb_instance_drained", "tts-b", name="instance-0"), "0x10"),
        (series("cosyvoice_lb_instance_up", "x-a", namespace="other", name="instance-0"), "0x10"),
        (series("cosyvoice_lb_instance_ready", "x-a", namespace="other", name="instance-0"), "0x10"),
        (series("cosyvoice_lb_instance_drained", "x-a", namespace="other", name="instance-0"), "0x10"),
        (series("up", "tts-a", endpoint="http", name="instance-1"), "0x10"),
        (series("up", "tts-a", endpoint="http"), "1x10"),
        (series("up", "x-a", namespace="other", endpoint="http"), "0x10"),
        (series("cosyvoice_lb_instance_in_rotation", "tts-a", name="instance-1"), "1x10"),
    ]
    up_a1 = {**a0, "endpoint": "http", "name": "instance-1"}
    tests = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [{"series": s, "values": v} for s, v in inputs],
                "alert_rule_test": [
                    {"eval_time": "2m", "alertname": "CosyVoiceInstanceDown", "exp_alerts": [
                        firing(files, "CosyVoiceInstanceDown", b0)]},
                    {"eval_time": "2m", "alertname": "CosyVoiceInstanceScrapeFailing", "exp_alerts": [
                        firing(files, "CosyVoiceInstanceScrapeFailing", up_a1)]},
                    {"eval_time": "2m", "alertname": "CosyVoiceClusterMetricsDown", "exp_alerts": []},
                    {"eval_time": "2m", "alertname": "CosyVoiceNoInstanceInRotation", "exp_alerts": []},
                ],
            }
        ],
    }  # fmt: skip
    (tmp_path / "rules_test.yml").write_text(yaml.safe_dump(tests, sort_keys=False), encoding="utf-8")
    done = subprocess.run(
        [promtool, "test", "rules", "rules_test.yml"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
