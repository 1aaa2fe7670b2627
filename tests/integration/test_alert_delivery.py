"""Alerts reach a person: a real cluster of two espeak instances started with `up --alertmanager
--alert-webhook`, its Alertmanager run by supervisord, a real Prometheus on the prometheus.yml
`up` wrote (its alerting block pointing at that Alertmanager) and the cluster's alert rules,
and a small webhook receiver on loopback.

Every instance stopped: the receiver gets CosyVoiceNoInstanceInRotation, firing; `up` again:
it gets it resolved. `up` with another receiver restarts the Alertmanager on it, and `down`
leaves no Alertmanager behind (the tests run in this order, on one cluster).

Only the waits are shortened, in copies or in place, as an operator could: the scrape and
evaluation intervals (15 s -> 1 s), the rule's `for` (1m -> 3s) and Alertmanager's grouping
(30s/5m -> 1s/2s, then a reload). At the rendered defaults the alert arrives within the
rule's 1 m, plus a scrape and an evaluation interval (15 s each) and the group wait (30 s);
its resolution within an evaluation interval plus the group interval (5 m).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
import requests
import yaml
from conftest import cli, free_port_block, real_prometheus, wait_for

pytestmark = pytest.mark.integration
ALERT = "CosyVoiceNoInstanceInRotation"
INSTANCES = ("instance-0", "instance-1")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


class Receiver:
    """A webhook on loopback: keeps every notification Alertmanager POSTs (its JSON)."""

    def __init__(self) -> None:
        received: list[dict] = []
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append(json.loads(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def statuses(self, alert: str) -> list[str]:
        """The status of each notification that carried ``alert``, in order."""
        return [
            one["status"]
            for note in list(self.received)
            for one in note["alerts"]
            if one["labels"].get("alertname") == alert
        ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def alertmanagers(state_dir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        args = proc.info["cmdline"] or []
        if any("alertmanager" in part for part in args[:1]) and any(str(state_dir) in part for part in args):
            found.append(proc)
    return found


def supervisorctl(state_dir: Path, *args: str) -> str:
    done = subprocess.run(
        [str(Path(sys.executable).with_name("supervisorctl")), "-c", str(state_dir / "run/supervisord.conf"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.stdout + done.stderr


def shortened_rules(alerts_yml: Path, out: Path) -> Path:
    """The cluster's alert rules, the one under test waiting 3 s instead of its `for`."""
    rules = yaml.safe_load(alerts_yml.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule["alert"] == ALERT:
                assert rule["for"] == "1m"
                rule["for"] = "3s"
    out.write_text(yaml.safe_dump(rules, sort_keys=False))
    return out


@pytest.fixture(scope="module")
def cluster():
    if ALERTMANAGER is None:
        pytest.skip("Alertmanager is not installed (./run.sh test installs Debian's prometheus-alertmanager)")
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    receiver = Receiver()
    port, base, alertmanager = free_port_block(1), free_port_block(2), free_port_block(1)
    args = (
        "--instances", "2", "--port", str(port), "--base-port", str(base), "--state-dir", str(state_dir),
        "--alertmanager", "--alertmanager-port", str(alertmanager), "--alert-webhook", receiver.url,
    )  # fmt: skip
    done = cli("up", *args, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    yield {"state": state_dir, "args": args, "receiver": receiver, "alertmanager": f"http://127.0.0.1:{alertmanager}"}
    cli("down", "--state-dir", str(state_dir), timeout=120)
    receiver.close()
    shutil.rmtree(state_dir, ignore_errors=True)


def test_the_alert_reaches_the_webhook_firing_and_then_resolved(cluster, tmp_path):
    state, receiver, am = cluster["state"], cluster["receiver"], cluster["alertmanager"]
    monitoring = state / "monitoring"
    assert "RUNNING" in supervisorctl(state, "status", "alertmanager")
    assert wait_for(lambda: requests.get(am + "/-/ready", timeout=2).status_code == 200, 20)
    # Alertmanager's waits shortened in the config `up` wrote, and reloaded
    config = monitoring / "alertmanager.yml"
    text = config.read_text()
    for old, new in (("group_wait: 30s", "group_wait: 1s"), ("group_interval: 5m", "group_interval: 2s")):
        assert old in text
        text = text.replace(old, new)
    config.write_text(text)
    assert requests.post(am + "/-/reload", timeout=10).status_code == 200
    # a real Prometheus on the rendered prometheus.yml (alerting block included), intervals shortened
    rendered = (monitoring / "prometheus.yml").read_text()
    assert f"- {json.dumps(am.removeprefix('http://'))}" in rendered  # (the rendered alerting block)
    rules = shortened_rules(monitoring / "alerts.yml", tmp_path / "alerts.yml")
    prometheus_yml = tmp_path / "prometheus.yml"
    prometheus_yml.write_text(
        rendered.replace("_interval: 15s", "_interval: 1s").replace(
            json.dumps(str(monitoring / "alerts.yml")), json.dumps(str(rules))
        )
    )
    with real_prometheus(prometheus_yml, tmp_path) as api:

        def in_rotation() -> float | None:
            found = requests.get(
                api + "/query", params={"query": "sum(cosyvoice_lb_instance_in_rotation)"}, timeout=5
            ).json()["data"]["result"]
            return float(found[0]["value"][1]) if found else None

        def notifiers() -> int:
            return len(requests.get(api + "/alertmanagers", timeout=5).json()["data"]["activeAlertmanagers"])

        assert wait_for(lambda: in_rotation() == 2, 60), in_rotation()
        assert notifiers() == 1
        assert receiver.statuses(ALERT) == []

        stopped = time.monotonic()
        out = supervisorctl(state, "stop", *INSTANCES)
        assert all(f"{name}: stopped" in out for name in INSTANCES), out
        assert wait_for(lambda: "firing" in receiver.statuses(ALERT), 60), receiver.received
        fired = time.monotonic() - stopped
        print(f"firing reached the webhook {fired:.1f} s after every instance stopped")

        started = time.monotonic()
        done = cli("up", *cluster["args"], timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        assert wait_for(lambda: receiver.statuses(ALERT)[-1:] == ["resolved"], 60), receiver.received
        print(f"resolved reached the webhook {time.monotonic() - started:.1f} s after `up` began")
    (note,) = [n for n in receiver.received if n["status"] == "resolved" and n["groupLabels"].get("alertname") == ALERT]
    assert note["receiver"] == "cosyvoice-lb" and note["alerts"][0]["labels"]["severity"] == "critical"
    assert "every request gets 503" in note["alerts"][0]["annotations"]["summary"]


def test_a_changed_receiver_restarts_the_alertmanager_with_it(cluster):
    state, am = cluster["state"], cluster["alertmanager"]
    (before,) = alertmanagers(state)
    second = cluster["receiver"].url + "/second"
    args = list(cluster["args"])
    args[args.index("--alert-webhook") + 1] = second
    done = cli("up", *args, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "changing: --alert-webhook" in done.stdout + done.stderr
    assert wait_for(lambda: [p.pid for p in alertmanagers(state)] not in ([], [before.pid]), 20)
    assert wait_for(lambda: second in alertmanager_config(am), 20), alertmanager_config(am)
    status = json.loads(cli("status", "--json", "--state-dir", str(state)).stdout)
    assert status["daemons"]["alertmanager"]["state"] == "RUNNING", status["daemons"]
    assert not [p for p in status["problems"] if "alertmanager" in p], status["problems"]


def alertmanager_config(am: str) -> str:
    try:
        return requests.get(am + "/api/v2/status", timeout=5).json()["config"]["original"]
    except (requests.RequestException, ValueError, KeyError):
        return ""


def test_down_leaves_no_alertmanager_behind(cluster):
    state = cluster["state"]
    running = alertmanagers(state)
    assert len(running) == 1, running
    done = cli("down", "--state-dir", str(state), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert wait_for(lambda: not alertmanagers(state), 20), alertmanagers(state)
    assert not running[0].is_running()
