"""Observability end to end: a real cluster of two espeak instances behind nginx, scraped
directly and through nginx, and by a real Prometheus running the config `up` wrote.

- each synthesis is observed once, whatever its route (API, OpenAI, UI, a long text's
  segments), while the health loop probes all along;
- one request id in the answer, nginx's access log and the instance's log line;
- the cluster's /metrics behind the admin or scrape token; stub_status for this box only;
- drain by hand and undrain with the CLI;
- Prometheus scrapes every target with the generated config, loads the alert rules, runs
  every dashboard query, and its file service discovery follows `up --instances 3`.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import requests
from conftest import cli, free_port_block, instance_samples, real_prometheus, unexpected_tracebacks, wait_for
from prometheus_client.parser import text_string_to_metric_families

from cosyvoice_lb.instance.metrics import OUTCOMES, ROUTES
from cosyvoice_lb.launcher.render.grafana import dashboard_exprs

pytestmark = pytest.mark.integration
LONG = "".join(f"This is sentence number {i} of a long text that the cluster splits. " for i in range(6))


@pytest.fixture(scope="module")
def cluster():
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(3)
    done = cli(
        "up",
        "--instances",
        "2",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        "--max-chars",
        "80",
        "--segment-chars",
        "80",
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"control panel: http://127.0.0.1:{port}/admin" in done.stdout
    session = requests.Session()
    session.trust_env = False
    yield {
        "url": f"http://127.0.0.1:{port}",
        "http": session,
        "state": state_dir,
        "port": port,
        "base": base,
        "admin": (state_dir / "admin-token").read_text().splitlines()[-1],
        "scrape": (state_dir / "monitoring" / "scrape-token").read_text().strip(),
    }
    cli("down", "--state-dir", str(state_dir), timeout=120)
    shutil.rmtree(state_dir, ignore_errors=True)


def totals(cluster) -> dict[tuple[str, tuple], float]:
    """The two instances' samples, summed."""
    summed: dict[tuple[str, tuple], float] = {}
    for index in (0, 1):
        for key, value in instance_samples(cluster, index).items():
            summed[key] = summed.get(key, 0.0) + value
    return summed


def by_route(samples, name: str) -> dict[str, float]:
    return {route: samples.get((name, (("route", route),)), 0.0) for route in ROUTES}


def requests_by(samples) -> dict[tuple[str, str], float]:
    return {
        (r, o): samples.get(("cosyvoice_requests_total", (("outcome", o), ("route", r))), 0.0)
        for r in ROUTES
        for o in OUTCOMES
    }


def test_each_synthesis_is_observed_once_wherever_it_came_from(cluster):
    from gradio_client import Client

    http, url = cluster["http"], cluster["url"]
    before = totals(cluster)
    for i in range(3):
        assert http.post(url + "/v1/tts", json={"text": f"Plain request {i}."}, timeout=60).status_code == 200
    for i in range(2):
        assert (
            http.post(
                url + "/v1/audio/speech", json={"model": "tts-1", "input": f"OpenAI {i}.", "voice": "alloy"}, timeout=60
            ).status_code
            == 200
        )
    assert http.post(url + "/v1/tts", json={"text": ""}, timeout=60).status_code == 400
    long = http.post(url + "/v1/tts", json={"text": LONG}, timeout=120)
    assert long.status_code == 200
    Client(url + "/", verbose=False).predict("Hello from the UI.", 1.0, api_name="/generate")
    from websockets.sync.client import connect

    with connect(url.replace("http://", "ws://") + "/v1/audio/speech/stream") as ws:  # a session: 2 sentences
        ws.send(json.dumps({"type": "session.config"}))
        ws.send(json.dumps({"type": "input.text.delta", "delta": "A session. Two sentences."}))
        ws.send(json.dumps({"type": "input.text.done"}))
        while not (isinstance(frame := ws.recv(timeout=60), str) and json.loads(frame)["type"] in ("done", "error")):
            pass
        assert json.loads(frame)["type"] == "done" and json.loads(frame)["sentences"] == 2
    time.sleep(3)  # the health loop probes all along: never counted
    after = totals(cluster)
    grew = {k: requests_by(after)[k] - requests_by(before)[k] for k in requests_by(after)}
    counted = {k: v for k, v in grew.items() if v}
    segments = counted.get(("segment", "ok"), 0)
    assert segments >= 4  # ~430 characters in segments of at most 80
    assert counted == {
        ("api", "ok"): 4,
        ("api", "invalid"): 1,
        ("openai", "ok"): 2,
        ("ui", "ok"): 1,
        ("segment", "ok"): segments,
        ("stream", "ok"): 1,  # a session, once
    }
    # one first package, one audio duration per synthesis: the long text's are its segments'
    for name in (
        "cosyvoice_first_package_seconds_count",
        "cosyvoice_audio_duration_seconds_count",
        "cosyvoice_queue_wait_seconds_count",
        "cosyvoice_real_time_factor_count",
    ):
        grown = {r: by_route(after, name)[r] - by_route(before, name)[r] for r in ROUTES}
        assert grown == {"api": 3, "openai": 2, "ui": 1, "segment": segments, "stream": 2}, name  # (its sentences)
    audio = sum(by_route(after, "cosyvoice_audio_duration_seconds_sum").values()) - sum(
        by_route(before, "cosyvoice_audio_duration_seconds_sum").values()
    )
    assert audio > 10  # seconds of speech made, the long text most of them
    for index in (0, 1):
        log = (cluster["state"] / "logs" / f"instance-{index}.log").read_text()
        assert not unexpected_tracebacks(log)


def test_one_request_id_in_the_answer_the_access_log_and_the_instance_log(cluster):
    http, url, state = cluster["http"], cluster["url"], cluster["state"]
    answer = http.post(url + "/v1/tts", json={"text": "Trace me."}, timeout=60)
    rid = answer.headers["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid)
    port = answer.headers["X-Instance-Port"]
    index = int(port) - cluster["base"]
    access = wait_for(
        lambda: [x for x in (state / "logs/nginx-access.log").read_text().splitlines() if f"rid={rid}" in x], 5, 0.1
    )
    assert len(access) == 1 and f"upstream=127.0.0.1:{port}" in access[0] and " 200 " in access[0]
    # (written after the answer went out, through supervisord's log: waited for, as the access log)
    instance = wait_for(
        lambda: [x for x in (state / f"logs/instance-{index}.log").read_text().splitlines() if f"rid={rid}" in x],
        5,
        0.1,
    )
    assert len(instance) == 1 and "api /v1/tts 200 ok" in instance[0]
    # a caller's own id is kept; a long text's segments carry it with their number
    mine = http.post(url + "/v1/tts", json={"text": LONG}, headers={"X-Request-Id": "caller-trace-0001"}, timeout=120)
    assert mine.headers["X-Request-Id"] == "caller-trace-0001"
    wanted = {"caller-trace-0001", "caller-trace-0001-1", "caller-trace-0001-2"}

    def logged() -> set[str]:
        return set(re.findall(r"rid=(caller-trace-0001\S*)", (state / "logs/nginx-access.log").read_text()))

    assert wait_for(lambda: wanted <= logged(), 5, 0.1), logged()
    # errors and nginx's own answers carry it too
    bad = http.post(url + "/v1/tts", json={"text": ""}, timeout=30)
    assert bad.status_code == 400 and re.fullmatch(r"[0-9a-f]{32}", bad.headers["X-Request-Id"])
    odd = http.post(url + "/v1/tts", json={"text": "x"}, headers={"X-Request-Id": "no spaces allowed here"}, timeout=30)
    assert odd.headers["X-Request-Id"] != "no spaces allowed here"


def test_the_clusters_metrics_need_a_token_and_the_scrape_token_reads_nothing_else(cluster):
    http, url = cluster["http"], cluster["url"]
    for path in ("/metrics", "/metrics/instance-0", "/admin/api/status"):
        assert http.get(url + path, timeout=10).status_code == 401, path
    scrape = {"Authorization": f"Bearer {cluster['scrape']}"}
    text = http.get(url + "/metrics", headers=scrape, timeout=10).text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {
        "cosyvoice_lb_instance_up",
        "cosyvoice_lb_instance_restarts",
        "cosyvoice_lb_nginx_requests",
        "cosyvoice_lb_probe_duration_seconds",
        "cosyvoice_lb_health_report_age_seconds",
    } <= names
    assert "cosyvoice_lb_nginx_up 1.0" in text and 'cosyvoice_lb_instance_ready{name="instance-1"} 1.0' in text
    relayed = http.get(url + "/metrics/instance-1", headers=scrape, timeout=10)
    assert relayed.status_code == 200 and "cosyvoice_first_package_seconds_bucket" in relayed.text
    assert http.get(url + "/admin/api/status", headers=scrape, timeout=10).status_code == 401
    assert http.post(url + "/admin/api/instances/instance-0/restart", headers=scrape, timeout=10).status_code == 401
    admin = {"Authorization": f"Bearer {cluster['admin']}"}
    assert http.get(url + "/admin/api/status", headers=admin, timeout=10).json()["running"] is True
    # nginx never hands /metrics to an instance; the instance's own stays on loopback
    assert http.get(url + "/metrics?x=1", timeout=10).status_code == 401
    direct = http.get(f"http://127.0.0.1:{cluster['base']}/metrics", headers={"X-Request-Start": "1"}, timeout=10)
    assert direct.status_code == 404


def test_stub_status_answers_this_box(cluster):
    answer = cluster["http"].get(cluster["url"] + "/nginx_status", timeout=10)
    assert answer.status_code == 200 and answer.text.startswith("Active connections:")


def test_drain_and_undrain_by_hand(cluster):
    http, url, state = cluster["http"], cluster["url"], str(cluster["state"])
    done = cli("drain", "instance-1", "--state-dir", state)
    assert done.returncode == 0 and "instance-1: drained" in done.stdout
    status = wait_for(
        lambda: (
            (s := json.loads(cli("status", "--json", "--state-dir", state).stdout))["instances"][1]["in_rotation"]
            is False
            and s
        ),
        10,
    )
    assert status and status["ok"] and status["instances"][1]["drained"] and status["instances"][1]["ready"]
    assert any("instance-1 is drained by hand" in w for w in status["warnings"])
    time.sleep(1)  # (nginx's reload: connections it had kept end)
    ports = {
        http.post(url + "/v1/tts", json={"text": f"Where {i}?"}, timeout=60).headers["X-Instance-Port"]
        for i in range(6)
    }
    assert ports == {str(cluster["base"])}
    assert "was drained already" in cli("drain", "instance-1", "--state-dir", state).stdout
    unknown = cli("drain", "instance-9", "--state-dir", state)
    assert unknown.returncode == 2 and "no instance named instance-9" in unknown.stderr
    assert cli("undrain", "instance-1", "--state-dir", state).returncode == 0
    assert wait_for(
        lambda: json.loads(cli("status", "--json", "--state-dir", state).stdout)["instances"][1]["in_rotation"], 10
    )


@pytest.fixture
def prometheus(cluster, tmp_path):
    """A real Prometheus (Debian's) on loopback, on the config `up` wrote; only the scrape
    and evaluation intervals shortened from 15 s, so the test waits seconds, not minutes."""
    monitoring = cluster["state"] / "monitoring"
    config = tmp_path / "prometheus.yml"
    config.write_text((monitoring / "prometheus.yml").read_text().replace("_interval: 15s", "_interval: 1s"))
    with real_prometheus(config, tmp_path) as api:
        yield api


def targets(api: str) -> dict[str, str]:
    """job/instance-label -> health of each active target."""
    found = requests.get(api + "/targets", timeout=5).json()["data"]["activeTargets"]
    return {f"{t['labels']['job']}/{t['labels'].get('name', t['labels']['instance'])}": t["health"] for t in found}


def test_prometheus_scrapes_everything_with_the_config_up_wrote(cluster, prometheus):
    api = prometheus
    expected = {
        "cosyvoice-instances/instance-0": "up",
        "cosyvoice-instances/instance-1": "up",
        "cosyvoice-lb/" + f"127.0.0.1:{cluster['port']}": "up",
    }
    assert wait_for(lambda: targets(api) == expected, 30, 0.5), targets(api)
    cluster["http"].post(cluster["url"] + "/v1/tts", json={"text": "Scrape me."}, timeout=60)
    rules = wait_for(lambda: requests.get(api + "/rules", timeout=5).json()["data"]["groups"], 20, 0.5)
    loaded = {rule["name"]: rule["health"] for group in rules for rule in group["rules"]}
    assert {
        "CosyVoiceFirstPackageSlow",
        "CosyVoiceGpuMemoryHigh",
        "CosyVoiceInstanceDown",
        "CosyVoiceRestartStorm",
    } <= set(loaded)
    assert wait_for(
        lambda: all(
            h == "ok"
            for h in (
                r["health"]
                for g in requests.get(api + "/rules", timeout=5).json()["data"]["groups"]
                for r in g["rules"]
            )
        ),
        20,
        0.5,
    )
    # every panel of the dashboard is a query Prometheus runs; those of this CPU box have data
    dashboard = (cluster["state"] / "monitoring" / "grafana-dashboard.json").read_text()
    empty = []
    # (a rate needs two scrapes in its window, and traffic between them)
    assert wait_for(lambda: query(api, "min(count_over_time(up[1m]))") >= 3, 20, 0.5)
    for _ in range(3):
        cluster["http"].post(cluster["url"] + "/v1/tts", json={"text": "Scrape me again."}, timeout=60)
        time.sleep(1)
    for expr in dashboard_exprs(dashboard, rate_interval="1m"):
        answer = requests.get(api + "/query", params={"query": expr}, timeout=10).json()
        assert answer["status"] == "success", (expr, answer)
        if not answer["data"]["result"]:
            empty.append(expr)
    assert all("gpu" in expr for expr in empty), empty  # only the GPU panels are empty without a GPU
    assert query(api, 'sum(cosyvoice_lb_instance_up{job="cosyvoice-lb"})') == 2


def query(api: str, expr: str) -> float:
    result = requests.get(api + "/query", params={"query": expr}, timeout=10).json()["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def test_file_discovery_follows_up_when_it_adds_an_instance(cluster, prometheus):
    api = prometheus
    assert wait_for(lambda: len([t for t in targets(api) if t.startswith("cosyvoice-instances/")]) == 2, 30, 0.5)
    done = cli(
        "up",
        "--instances",
        "3",
        "--port",
        str(cluster["port"]),
        "--base-port",
        str(cluster["base"]),
        "--state-dir",
        str(cluster["state"]),
        "--max-chars",
        "80",
        "--segment-chars",
        "80",
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    grown = wait_for(lambda: targets(api).get("cosyvoice-instances/instance-2") == "up", 60, 0.5)
    assert grown, targets(api)
    scrape = {"Authorization": f"Bearer {cluster['scrape']}"}
    assert wait_for(
        lambda: (
            "cosyvoice_lb_instances 3.0"
            in cluster["http"].get(cluster["url"] + "/metrics", headers=scrape, timeout=10).text
        ),
        10,
    )
