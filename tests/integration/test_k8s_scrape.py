"""The ServiceMonitor `k8s render` writes, scraped by a real Prometheus (Debian's) on loopback.

No Kubernetes: two "pods" are small HTTP servers on 127.0.0.1, each serving what a pod's
nginx does at the ServiceMonitor's paths, behind the scrape token: the cluster's ``/metrics``
and each instance's relay ``/metrics/instance-N``, the relays all with a real instance's
metrics text (cosyvoice_lb.instance.metrics), the same but for the queue depth, N. The
Prometheus config is made FROM the rendered ServiceMonitor as Prometheus Operator makes it:
a scrape job per endpoint, with its path, its bearer token (read from the rendered Secret),
the operator's own target labels (namespace, service, pod, job = the Service, endpoint =
the port; ``instance`` = the address, one per pod) and then the endpoint's relabelings. Every
endpoint of a pod has one address: only the relabelings tell the relays' series apart, so the
test fails when the ServiceMonitor loses them.
"""

from __future__ import annotations

import base64
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
import yaml
from conftest import real_prometheus, wait_for

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.instance.metrics import Metrics
from cosyvoice_lb.launcher.k8s.manifests import Deployment, instances_per_pod, manifests
from cosyvoice_lb.launcher.k8s.monitoring import INSTANCE_LABEL

pytestmark = pytest.mark.integration
SETTINGS = Settings(instances="2")
DEPLOYMENT = Deployment(name="tts", namespace="audio", scrape_token="scrape-" + "s" * 32)
PODS = ("tts-a", "tts-b")
CLUSTER_TEXT = (
    "# HELP cosyvoice_lb_instance_up 1 while supervisord runs the instance.\n"
    "# TYPE cosyvoice_lb_instance_up gauge\n"
    'cosyvoice_lb_instance_up{name="instance-0",gpu="0"} 1.0\n'
    'cosyvoice_lb_instance_up{name="instance-1",gpu="0"} 1.0\n'
)


def documents(files: dict[str, str], name: str) -> dict:
    (doc,) = [d for d in yaml.safe_load_all(files[name]) if d]
    return doc


def snake(key: str) -> str:
    return re.sub(r"[A-Z]", lambda m: "_" + m.group(0).lower(), key)


def operator_scrape_configs(files: dict[str, str], pods: dict[str, str]) -> list[dict]:
    """The scrape jobs Prometheus Operator makes of the rendered ServiceMonitor, for ``pods``
    ({pod name: address}) behind its Service: the operator's relabelings, then the endpoint's
    own (camelCase keys to Prometheus's snake_case)."""
    monitor = documents(files, "servicemonitor.yaml")
    secret = documents(files, "secret.yaml")
    service = documents(files, "service.yaml")["metadata"]["name"]
    namespace, name = monitor["metadata"]["namespace"], monitor["metadata"]["name"]
    jobs = []
    for i, endpoint in enumerate(monitor["spec"]["endpoints"]):
        credentials = endpoint["authorization"]["credentials"]
        assert credentials["name"] == secret["metadata"]["name"]
        token = base64.b64decode(secret["data"][credentials["key"]]).decode().strip()
        own = [
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job", "replacement": "${1}"},
            {"target_label": "endpoint", "replacement": endpoint["port"]},
        ]
        theirs = [{snake(k): v for k, v in relabel.items()} for relabel in endpoint.get("relabelings", [])]
        jobs.append(
            {
                "job_name": f"serviceMonitor/{namespace}/{name}/{i}",
                "honor_labels": endpoint.get("honorLabels", False),
                "scrape_interval": "1s",  # (15 s in the ServiceMonitor: the test waits seconds)
                "scrape_timeout": "1s",
                "metrics_path": endpoint["path"],
                "authorization": {"type": endpoint["authorization"]["type"], "credentials": token},
                "static_configs": [
                    {
                        "targets": [address],
                        "labels": {
                            "__meta_kubernetes_namespace": namespace,
                            "__meta_kubernetes_service_name": service,
                            "__meta_kubernetes_pod_name": pod,
                        },
                    }
                    for pod, address in pods.items()
                ],
                "relabel_configs": own + theirs,
            }
        )
    return jobs


class Pod:
    """A pod's nginx as Prometheus sees it: /metrics and /metrics/instance-N with the token."""

    def __init__(self, token: str, per_pod: int):
        relays = {}
        for n in range(per_pod):
            metrics = Metrics(engine="espeak", version="test")
            metrics.watch(lambda n=n: {"ready": 1, "waiting": n})
            relays[f"/metrics/instance-{n}"] = metrics

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.headers.get("authorization") != f"Bearer {token}":
                    self.send_response(401)
                    self.end_headers()
                    return
                if self.path == "/metrics":
                    body, kind = CLUSTER_TEXT.encode(), "text/plain; version=0.0.4"
                elif self.path in relays:
                    body, kind = relays[self.path].exposition(self.headers.get("accept", ""))
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scraped(tmp_path: Path):
    """A real Prometheus scraping two pods with the jobs of the rendered ServiceMonitor."""
    files = manifests(SETTINGS, DEPLOYMENT)
    per_pod = instances_per_pod(SETTINGS, DEPLOYMENT)
    assert per_pod == 2
    token = base64.b64decode(documents(files, "secret.yaml")["data"]["scrape-token"]).decode().strip()
    pods = {name: Pod(token, per_pod) for name in PODS}
    config = tmp_path / "prometheus.yml"
    jobs = operator_scrape_configs(files, {name: pod.address for name, pod in pods.items()})
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": jobs}, sort_keys=False))
    try:
        with real_prometheus(config, tmp_path) as api:
            yield {"api": api, "pods": pods, "per_pod": per_pod, "log": tmp_path / "prometheus.log"}
    finally:
        for pod in pods.values():
            pod.close()


def active_targets(api: str) -> list[dict]:
    return requests.get(api + "/targets", timeout=5).json()["data"]["activeTargets"]


def result(api: str, expr: str) -> list[dict]:
    answer = requests.get(api + "/query", params={"query": expr}, timeout=5).json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def test_every_relay_of_every_pod_is_its_own_series_with_its_instances_label(scraped):
    api, per_pod = scraped["api"], scraped["per_pod"]
    endpoints = len(PODS) * (1 + per_pod)
    assert wait_for(lambda: [t["health"] for t in active_targets(api)].count("up") == endpoints, 30, 0.5), (
        active_targets(api)
    )

    # Each target: the relay's path gives its instance's label; the pod's /metrics has none.
    for target in active_targets(api):
        path = target["scrapeUrl"].split(target["labels"]["instance"], 1)[1]
        labels = target["labels"]
        assert labels["job"] == "tts" and labels["namespace"] == "audio" and labels["pod"] in PODS
        assert labels["instance"] == scraped["pods"][labels["pod"]].address  # one address per pod
        if path == "/metrics":
            assert INSTANCE_LABEL not in labels, target
        else:
            assert labels[INSTANCE_LABEL] == path.removeprefix("/metrics/"), target

    # The same text from every relay: one series per pod and instance, each labelled.
    wanted = {(pod, f"instance-{n}") for pod in PODS for n in range(per_pod)}
    found = wait_for(lambda: len(result(api, "cosyvoice_instance_ready")) == len(wanted), 20, 0.5)
    assert found, result(api, "cosyvoice_instance_ready")
    ready_series = result(api, "cosyvoice_instance_ready")
    assert {(s["metric"]["pod"], s["metric"].get(INSTANCE_LABEL)) for s in ready_series} == wanted
    assert len({frozenset(s["metric"].items()) for s in ready_series}) == len(wanted)
    # ... and the series of instance-N is instance-N's (its queue depth is N).
    for sample in result(api, "cosyvoice_queue_depth"):
        assert float(sample["value"][1]) == float(sample["metric"][INSTANCE_LABEL].removeprefix("instance-"))
    assert len(result(api, "cosyvoice_queue_depth")) == len(wanted)

    # The cluster's metrics keep their own name label (nothing renamed it exported_name).
    cluster = result(api, "cosyvoice_lb_instance_up")
    assert {(s["metric"]["pod"], s["metric"]["name"]) for s in cluster} == wanted
    assert not any("exported_name" in s["metric"] for s in cluster)

    # No two endpoints wrote into one series: Prometheus's own counters saw no sample twice.
    own = requests.get(api.replace("/api/v1", "/metrics"), timeout=5).text
    for counter in ("duplicate_timestamp", "out_of_order"):
        (line,) = [x for x in own.splitlines() if x.startswith(f"prometheus_target_scrapes_sample_{counter}_total ")]
        assert float(line.split()[1]) == 0, line
