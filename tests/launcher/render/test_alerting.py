"""Alert delivery (common/alert_settings.py, launcher/render/alertmanager.py, the AlertmanagerConfig
of k8s/monitoring.py): the settings refuse what cannot deliver, `up --alertmanager` renders an
Alertmanager program on loopback with its config in the state dir and points prometheus.yml at
it, and Alertmanager's own amtool and Prometheus's promtool accept what is rendered.

The alert reaching a real webhook through a real Prometheus and Alertmanager is
tests/integration/test_alert_delivery.py."""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import cli_here, document, installed
from test_render import gpu_plan, supervisor_sections

from cosyvoice_lb.common.setting_errors import setting_errors
from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.cluster.diagnosis import ClusterStatus, service_findings
from cosyvoice_lb.launcher.k8s.manifests import Deployment, manifests
from cosyvoice_lb.launcher.k8s.monitoring import ALERT_MATCHERS, alertmanager_config
from cosyvoice_lb.launcher.render.alertmanager import CONFIG_DIGEST, alertmanager_command
from cosyvoice_lb.launcher.render.cluster import Programs, RenderError, render
from cosyvoice_lb.launcher.render.prometheus import alert_groups
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.processes import is_cluster_program
from cosyvoice_lb.launcher.state.supervision import ProcessInfo

ROOT = Path("/tmp/cvlb-alert-t")  # never created: pure renders only
PROGRAMS = Programs(
    app="/x/app.py",
    launcher_python=sys.executable,
    nginx="/usr/sbin/nginx",
    alertmanager="/usr/bin/prometheus-alertmanager",
)
HOOK = "http://127.0.0.1:9000/alerts"
WITH_HOOK = Settings(alertmanager=True, alert_webhook=HOOK)


def two_instances():
    return gpu_plan(2)


def rendered(settings: Settings, root: Path = ROOT) -> dict[str, str]:
    return render(settings, two_instances(), Layout(root), PROGRAMS)


# --- the settings -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, says",
    [
        (dict(alertmanager=True), "--alertmanager needs somewhere to send alerts: add --alert-webhook URL"),
        (dict(alert_webhook="ftp://x/a"), "--alert-webhook 'ftp://x/a' is not an http(s) URL"),
        (dict(alert_webhook="http:///a"), "--alert-webhook 'http:///a' is not an http(s) URL"),
        (dict(alert_email_to="ops"), "--alert-email-to 'ops' is not an email address"),
        (
            dict(alert_email_to="ops@example.org"),
            "--alert-email-to needs --alert-smtp HOST:PORT and --alert-email-from",
        ),
        (dict(alert_smtp="smtp.example.org"), "--alert-smtp 'smtp.example.org' is not HOST:PORT"),
        (dict(alert_smtp_password_file="/nonexistent/pw"), "--alert-smtp-password-file /nonexistent/pw:"),
    ],
)
def test_alert_settings_that_cannot_deliver_are_refused(given, says):
    found = setting_errors(Settings(**given))
    assert any(says in message for message in found), found


def test_a_password_file_others_can_read_is_refused(tmp_path):
    secret = tmp_path / "smtp-password"
    secret.write_text("s3cret\n")
    secret.chmod(0o644)
    given = Settings(alert_smtp_user="ops", alert_smtp_password_file=str(secret))
    assert any("readable by others (mode 0644): run chmod 600" in m for m in setting_errors(given))
    secret.chmod(0o600)
    assert setting_errors(given) == []
    assert setting_errors(Settings(alert_smtp_password_file=str(secret))) == [
        "--alert-smtp-password-file needs --alert-smtp-user: the user the password is for"
    ]


def test_receivers_that_can_deliver_pass():
    assert setting_errors(WITH_HOOK) == []
    email = Settings(
        alertmanager=True,
        alert_email_to="ops@example.org, oncall@example.org",
        alert_email_from="tts@example.org",
        alert_smtp="smtp.example.org:587",
    )
    assert setting_errors(email) == []


def test_the_cli_refuses_alertmanager_without_a_receiver(tmp_path):
    done = cli_here("render", "--state-dir", str(tmp_path / "s"), "--alertmanager")
    assert done.returncode != 0
    assert "--alertmanager needs somewhere to send alerts" in done.stdout + done.stderr
    assert not (tmp_path / "s" / "run" / "supervisord.conf").exists()


# --- the box: supervisord's program, its config, prometheus.yml --------------------------------


def test_off_by_default_nothing_of_alertmanager_is_rendered():
    files = rendered(Settings())
    assert "alertmanager" not in supervisor_sections(files["run/supervisord.conf"]).sections()
    assert "monitoring/alertmanager.yml" not in files
    assert "alerting" not in yaml.safe_load(files["monitoring/prometheus.yml"])


def test_alertmanager_runs_under_supervisord_on_loopback_with_its_data_in_the_state_dir():
    files = rendered(dataclass_replace(WITH_HOOK, alertmanager_port=19093))
    program = supervisor_sections(files["run/supervisord.conf"])["program:alertmanager"]
    argv = shlex.split(program["command"])
    assert argv[0] == "/usr/bin/prometheus-alertmanager"
    assert f"--config.file={ROOT}/monitoring/alertmanager.yml" in argv
    assert f"--storage.path={ROOT}/alertmanager" in argv
    assert "--web.listen-address=127.0.0.1:19093" in argv
    assert "--cluster.listen-address=" in argv  # no gossip port on every address
    assert program["autorestart"] == "true" and program["stdout_logfile"] == f"{ROOT}/logs/alertmanager.log"
    alerting = yaml.safe_load(files["monitoring/prometheus.yml"])["alerting"]
    assert alerting == {"alertmanagers": [{"static_configs": [{"targets": ["127.0.0.1:19093"]}]}]}
    assert is_cluster_program(argv, Layout(ROOT))  # (`down` finds it if it outlives supervisord)


def dataclass_replace(settings: Settings, **changes) -> Settings:
    return dataclasses.replace(settings, **changes)


def test_a_changed_receiver_is_a_changed_program_so_up_restarts_it():
    def digest(settings: Settings) -> str:
        program = supervisor_sections(rendered(settings)["run/supervisord.conf"])["program:alertmanager"]
        return program["environment"]

    assert CONFIG_DIGEST in digest(WITH_HOOK)
    assert digest(WITH_HOOK) == digest(WITH_HOOK)
    assert digest(WITH_HOOK) != digest(dataclass_replace(WITH_HOOK, alert_webhook=HOOK + "/other"))


def test_every_webhook_and_the_email_receive_firing_and_resolved_and_no_secret_is_written(tmp_path):
    secret = tmp_path / "smtp-password"
    secret.write_text("s3cret-never-rendered\n")
    secret.chmod(0o600)
    settings = Settings(
        alertmanager=True,
        alert_webhook=f"{HOOK} https://hooks.example.org/tts",
        alert_email_to="ops@example.org,oncall@example.org",
        alert_email_from="tts@example.org",
        alert_smtp="smtp.example.org:587",
        alert_smtp_user="ops",
        alert_smtp_password_file=str(secret),
    )
    files = rendered(settings)
    config = yaml.safe_load(files["monitoring/alertmanager.yml"])
    (receiver,) = config["receivers"]
    assert config["route"]["receiver"] == receiver["name"]
    assert [(w["url"], w["send_resolved"]) for w in receiver["webhook_configs"]] == [
        (HOOK, True),
        ("https://hooks.example.org/tts", True),
    ]
    assert receiver["email_configs"] == [{"to": "ops@example.org, oncall@example.org", "send_resolved": True}]
    assert config["global"]["smtp_auth_password_file"] == str(secret)
    assert all("s3cret" not in text for text in files.values())


def test_the_alertmanager_port_may_not_take_the_public_or_an_instance_port():
    with pytest.raises(RenderError, match="--alertmanager-port 8080 collides"):
        rendered(dataclass_replace(WITH_HOOK, alertmanager_port=8080))


def test_the_command_keeps_every_path_one_argument():
    layout = Layout(Path("/srv/my state"))
    argv = alertmanager_command("/usr/bin/prometheus-alertmanager", WITH_HOOK, layout)
    assert "--config.file=/srv/my state/monitoring/alertmanager.yml" in argv


# --- Alertmanager's and Prometheus's own checks ------------------------------------------------


@pytest.fixture
def amtool() -> str:
    return installed("amtool", "prometheus-alertmanager")


def write(root: Path, files: dict[str, str]) -> Layout:
    layout = Layout(root)
    for relative, text in files.items():
        if relative.startswith("monitoring/"):
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / relative).write_text(text, encoding="utf-8")
    layout.scrape_token.write_text("metrics-only-token\n", encoding="utf-8")
    return layout


@pytest.mark.parametrize("email", [False, True])
def test_amtool_accepts_the_rendered_config(amtool, tmp_path, email):
    secret = tmp_path / "smtp-password"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    mail = dict(
        alert_email_to="ops@example.org",
        alert_email_from="tts@example.org",
        alert_smtp="smtp.example.org:587",
        alert_smtp_user="ops",
        alert_smtp_password_file=str(secret),
    )
    settings = dataclass_replace(WITH_HOOK, **(mail if email else {}))
    layout = write(tmp_path / "state", rendered(settings, tmp_path / "state"))
    done = subprocess.run([amtool, "check-config", str(layout.alertmanager_yml)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout and " - 1 receivers" in done.stdout


def test_promtool_accepts_prometheus_yml_with_the_alerting_block(promtool, tmp_path):
    layout = write(tmp_path / "state", rendered(WITH_HOOK, tmp_path / "state"))
    done = subprocess.run([promtool, "check", "config", str(layout.prometheus_yml)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# --- Kubernetes: the AlertmanagerConfig --------------------------------------------------------

TTS = Deployment(name="tts", namespace="audio", monitor_labels=(("alertmanager", "main"),))


def test_k8s_render_routes_the_rules_alerts_to_the_webhook():
    files = manifests(dataclass_replace(WITH_HOOK, alertmanager=False), TTS)
    config = document(files, "alertmanagerconfig.yaml")
    assert config["apiVersion"] == "monitoring.coreos.com/v1alpha1" and config["kind"] == "AlertmanagerConfig"
    assert config["metadata"]["namespace"] == "audio" and config["metadata"]["labels"]["alertmanager"] == "main"
    route, (receiver,) = config["spec"]["route"], config["spec"]["receivers"]
    assert route["receiver"] == receiver["name"]
    assert receiver["webhookConfigs"] == [{"url": HOOK, "sendResolved": True}]
    # every alert of the PrometheusRule matches every matcher (its name, its severity)
    rule = document(files, "prometheusrule.yaml")
    alerts = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    assert alerts and len(alerts) == len(alert_groups()[0]["rules"])
    for alert in alerts:
        labels = {"alertname": alert["alert"], **alert["labels"]}
        for matcher in route["matchers"]:
            assert matcher["matchType"] == "=~" and re.fullmatch(matcher["value"], labels[matcher["name"]]), alert
    assert route["matchers"] == [dict(m) for m in ALERT_MATCHERS]
    test_k8s = pytest.importorskip("test_k8s")  # (it needs kubernetes_validate)
    for name, text in files.items():  # every object, the AlertmanagerConfig among them, as test_k8s checks them
        for doc in (d for d in yaml.safe_load_all(text) if d):
            test_k8s.validate(doc, test_k8s.VERSIONS[0])


def test_k8s_render_writes_no_alertmanager_config_without_a_webhook(tmp_path):
    assert alertmanager_config(Settings(), TTS) is None
    assert "alertmanagerconfig.yaml" not in manifests(Settings(), TTS)
    done = cli_here("k8s", "render", "--out", str(tmp_path / "m"), "--instances", "2", "--alert-webhook", HOOK)
    assert done.returncode == 0, done.stderr
    written = yaml.safe_load((tmp_path / "m" / "alertmanagerconfig.yaml").read_text())
    assert written["spec"]["receivers"][0]["webhookConfigs"][0]["url"] == HOOK


# --- status ------------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["RUNNING", "FATAL"])
def test_status_shows_the_alertmanager_and_calls_it_a_problem_when_it_does_not_run(state):
    programs = {
        name: ProcessInfo(name, "RUNNING", 100 + i, 1.0, 2.0, "", 0)
        for i, name in enumerate(("nginx", "health", "admin", "jobs"))
    }
    programs["alertmanager"] = ProcessInfo("alertmanager", state, 0 if state == "FATAL" else 200, 1.0, 2.0, "", 1)
    result = ClusterStatus(running=True)
    service_findings(result, programs)
    assert result.daemons["alertmanager"]["state"] == state
    said = [p for p in result.problems if "alertmanager" in p]
    if state == "RUNNING":
        assert said == []
    else:
        assert said == ["alertmanager (alerts reach nobody) is fatal: see 'cosyvoice-lb logs alertmanager'"]
