"""Monitoring files (cosyvoice_lb/launcher/render/prometheus.py: Prometheus targets and config,
alert rules; render/grafana.py: the Grafana dashboard; render/monitoring.py: all of them).

Pure tests render on a made-up state dir (nothing is written); the promtool tests write the
files into tmp_path laid out as a state dir and let Prometheus's own tool judge them:
``check config``, ``check rules`` and ``test rules`` with tests/monitoring/alerts_test.yml,
which shows each alert firing when it should and silent just below its threshold.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import TESTS

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.sizes import GiB, MiB
from cosyvoice_lb.launcher.plan.planner import Budget, Gpu, Inventory, Slot, plan
from cosyvoice_lb.launcher.render.addresses import balancer_url
from cosyvoice_lb.launcher.render.grafana import DATASOURCE, dashboard_exprs, grafana_dashboard
from cosyvoice_lb.launcher.render.monitoring import monitoring_files
from cosyvoice_lb.launcher.render.prometheus import (
    BOX,
    RuleScope,
    alert_groups,
    alert_rules,
    balancer_target,
    prometheus_config,
    scrape_targets,
)
from cosyvoice_lb.launcher.state.layout import Layout

HERE = TESTS
ALERTS_TEST = HERE / "monitoring" / "alerts_test.yml"
SHORT = Path("/tmp/cvlb-mon-t")  # never created: pure renders only

# The metrics contract (step 8): every name the instances and the control panel expose.
HISTOGRAMS = {
    "cosyvoice_first_package_seconds",
    "cosyvoice_audio_duration_seconds",
    "cosyvoice_queue_wait_seconds",
    "cosyvoice_synthesis_seconds",
    "cosyvoice_real_time_factor",
    "cosyvoice_speech_error_ratio",
    "cosyvoice_speaker_similarity",
}
CONTRACT = HISTOGRAMS | {
    "cosyvoice_requests_total",
    "cosyvoice_syntheses_in_flight",
    "cosyvoice_queue_depth",
    "cosyvoice_long_texts_in_flight",
    "cosyvoice_voice_cache_hits_total",
    "cosyvoice_voice_cache_misses_total",
    "cosyvoice_instance_ready",
    "cosyvoice_instance_info",
    "cosyvoice_outputs_failing",
    "cosyvoice_results_not_kept_total",
    "cosyvoice_speech_checks_total",
    "cosyvoice_speech_unchecked",
    "cosyvoice_lb_instances",
    "cosyvoice_lb_instance_up",
    "cosyvoice_lb_instance_ready",
    "cosyvoice_lb_instance_in_rotation",
    "cosyvoice_lb_instance_drained",
    "cosyvoice_lb_instance_restarts_total",
    "cosyvoice_lb_instance_uptime_seconds",
    "cosyvoice_lb_probe_duration_seconds",
    "cosyvoice_lb_instance_memory_bytes",
    "cosyvoice_lb_instance_gpu_memory_bytes",
    "cosyvoice_lb_gpu_memory_used_bytes",
    "cosyvoice_lb_gpu_memory_total_bytes",
    "cosyvoice_lb_gpu_utilization_ratio",
    "cosyvoice_lb_gpu_temperature_celsius",
    "cosyvoice_lb_gpu_power_watts",
    "cosyvoice_lb_gpu_info",
    "cosyvoice_lb_health_report_age_seconds",
    "cosyvoice_lb_nginx_up",
    "cosyvoice_lb_nginx_connections",
    "cosyvoice_lb_nginx_connections_accepted_total",
    "cosyvoice_lb_nginx_connections_handled_total",
    "cosyvoice_lb_nginx_requests_total",
    "up",  # Prometheus's own, per scrape target
}
# Not charted: info gauges (their labels are for joins) and the instance's own ready gauge
# (the dashboard charts the cluster's view, cosyvoice_lb_instance_ready).
NOT_CHARTED = {"cosyvoice_instance_info", "cosyvoice_lb_gpu_info", "cosyvoice_instance_ready"}
# (and the outputs dir's state: an alert, not a chart)
NOT_CHARTED |= {"cosyvoice_outputs_failing", "cosyvoice_results_not_kept_total"}

ALERTS = {  # name: (expr, for, severity)
    "CosyVoiceFirstPackageSlow": (
        'histogram_quantile(0.99, sum by (le) (rate(cosyvoice_first_package_seconds_bucket{route!="segment"}[5m]))) '
        "> 1.5",
        "2m",
        "warning",
    ),
    "CosyVoiceGpuMemoryHigh": (
        "cosyvoice_lb_gpu_memory_used_bytes / cosyvoice_lb_gpu_memory_total_bytes > 0.9",
        "5m",
        "warning",
    ),
    "CosyVoiceInstanceDown": (
        "(cosyvoice_lb_instance_up == 0 or cosyvoice_lb_instance_ready == 0)"
        " unless on (name) cosyvoice_lb_instance_drained == 1",
        "2m",
        "warning",
    ),
    "CosyVoiceInstanceScrapeFailing": ('up{job="cosyvoice-instances"} == 0', "2m", "warning"),
    "CosyVoiceRestartStorm": (
        "sum by (name) (increase(cosyvoice_lb_instance_restarts_total[15m])) > 3",
        None,  # the 15-minute window is the duration
        "critical",
    ),
    "CosyVoiceNoInstanceInRotation": ("sum(cosyvoice_lb_instance_in_rotation) == 0", "1m", "critical"),
    "CosyVoiceResultsNotKept": ("cosyvoice_outputs_failing == 1", "1m", "critical"),
    "CosyVoiceClusterMetricsDown": ('up{job="cosyvoice-lb"} == 0', "2m", "critical"),
    "CosyVoiceHealthLoopStale": ("cosyvoice_lb_health_report_age_seconds > 30", "1m", "critical"),
    "CosyVoiceSpeechErrorHigh": (
        "histogram_quantile(0.9, sum by (name, le) (rate(cosyvoice_speech_error_ratio_bucket[30m]))) > 0.6",
        "10m",
        "warning",
    ),
    "CosyVoiceSpeechUnchecked": ("sum(cosyvoice_speech_unchecked) > 0", "30m", "info"),
}


def slots(*gpus: int | None, base_port: int = 7860) -> tuple[Slot, ...]:
    return tuple(Slot(index=i, port=base_port + i, gpu=gpu, memory=5 * GiB) for i, gpu in enumerate(gpus))


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: histogram series back to their family's name."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # label values are not names
    names = set(re.findall(r"\bcosyvoice_\w+|\bup\b", expr))
    family = {}
    for name in names:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        family[name] = base if base in HISTOGRAMS else name
    return set(family.values())


def rules(text: str | None = None) -> dict[str, dict]:
    data = yaml.safe_load(text or alert_rules())
    assert [g["name"] for g in data["groups"]] == ["cosyvoice-lb"]
    found = {rule["alert"]: rule for rule in data["groups"][0]["rules"]}
    assert len(found) == len(data["groups"][0]["rules"]), "alert names repeat"
    return found


# --- targets.json ------------------------------------------------------------------------------


def test_targets_one_group_per_instance_with_name_and_gpu():
    groups = json.loads(scrape_targets(slots(0, 1, None, base_port=9100)))
    assert groups == [
        {"targets": ["127.0.0.1:9100"], "labels": {"name": "instance-0", "gpu": "0"}},
        {"targets": ["127.0.0.1:9101"], "labels": {"name": "instance-1", "gpu": "1"}},
        {"targets": ["127.0.0.1:9102"], "labels": {"name": "instance-2", "gpu": "cpu"}},
    ]


@pytest.mark.parametrize("instances", [1, 2, 4])
def test_targets_follow_the_plan_when_the_count_changes(instances):
    inventory = Inventory(
        gpus=(Gpu(0, 24 * GiB, 24 * GiB), Gpu(1, 24 * GiB, 24 * GiB)),
        cpu_cores=8,
        ram_total=64 * GiB,
        ram_available=64 * GiB,
    )
    the_plan = plan(inventory, Budget(5 * GiB, 512 * MiB), instances=instances, base_port=7000)
    groups = json.loads(scrape_targets(the_plan.slots))
    assert len(groups) == instances
    assert [g["targets"] for g in groups] == [[f"127.0.0.1:{7000 + i}"] for i in range(instances)]
    assert [g["labels"] for g in groups] == [{"name": s.name, "gpu": str(s.gpu)} for s in the_plan.slots]


def test_targets_of_no_instances_is_an_empty_list():
    assert json.loads(scrape_targets(())) == []


# --- prometheus.yml ----------------------------------------------------------------------------


def jobs(text: str) -> dict[str, dict]:
    config = yaml.safe_load(text)
    return {job["job_name"]: job for job in config["scrape_configs"]}


def test_prometheus_config_has_both_jobs_and_the_rules_by_absolute_path():
    layout = Layout(SHORT)
    config = yaml.safe_load(prometheus_config(Settings(), layout))
    assert config["global"] == {"scrape_interval": "15s", "evaluation_interval": "15s"}
    assert config["rule_files"] == [str(layout.alert_rules)]
    found = jobs(prometheus_config(Settings(), layout))
    assert set(found) == {"cosyvoice-instances", "cosyvoice-lb"}

    instances = found["cosyvoice-instances"]
    assert instances["metrics_path"] == "/metrics"
    assert instances["file_sd_configs"] == [{"files": [str(layout.scrape_targets)], "refresh_interval": "30s"}]
    assert "authorization" not in instances  # loopback, no credentials

    cluster = found["cosyvoice-lb"]
    assert cluster["metrics_path"] == "/metrics"
    assert cluster["authorization"] == {"type": "Bearer", "credentials_file": str(layout.scrape_token)}
    assert cluster["static_configs"] == [{"targets": ["127.0.0.1:8080"]}]
    assert all(Path(p).is_absolute() for p in (*config["rule_files"], cluster["authorization"]["credentials_file"]))
    assert not SHORT.exists()


@pytest.mark.parametrize(
    ("settings", "target"),
    [
        (Settings(port=9090), "127.0.0.1:9090"),
        (Settings(host="0.0.0.0", port=8081), "127.0.0.1:8081"),  # every address: reach it on loopback
        (Settings(host="::", port=8082), "[::1]:8082"),
        (Settings(host="10.1.2.3", port=8083), "10.1.2.3:8083"),
        (Settings(public=True), "127.0.0.1:8080"),
    ],
)
def test_cluster_target_is_where_this_box_reaches_nginx(settings, target):
    assert balancer_target(settings) == target
    assert balancer_url(settings) == f"http://{target}"
    cluster = jobs(prometheus_config(settings, Layout(SHORT)))["cosyvoice-lb"]
    assert cluster["static_configs"] == [{"targets": [target]}]


@pytest.mark.parametrize("root", ["/srv/tts state/a: b", "/tmp/x #y/'q' \"dq\"\\z", "/tmp/- [not a list]"])
def test_paths_with_spaces_colons_and_quotes_stay_strings(root):
    layout = Layout(Path(root))
    text = prometheus_config(Settings(), layout)
    config = yaml.safe_load(text)
    assert config["rule_files"] == [str(layout.alert_rules)]
    found = jobs(text)
    assert found["cosyvoice-instances"]["file_sd_configs"][0]["files"] == [str(layout.scrape_targets)]
    assert found["cosyvoice-lb"]["authorization"]["credentials_file"] == str(layout.scrape_token)


def test_prometheus_config_says_what_each_job_is_and_what_the_token_may_do():
    text = prometheus_config(Settings(), Layout(SHORT))
    comments = " ".join(line.strip("# ") for line in text.splitlines() if line.lstrip().startswith("#"))
    assert "--config.file=" in comments
    assert "only reads metrics" in comments
    assert "targets.json" in comments and "rewrites" in comments


# --- alerts.yml --------------------------------------------------------------------------------


def test_every_alert_with_its_expression_duration_and_severity():
    found = rules()
    assert set(found) == set(ALERTS)
    for name, (expr, duration, severity) in ALERTS.items():
        rule = found[name]
        assert " ".join(rule["expr"].split()) == expr, name
        assert rule.get("for") == duration, name
        assert rule["labels"] == {"severity": severity}, name


def test_every_alert_says_what_to_look_at():
    for name, rule in rules().items():
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description"}, name
        assert annotations["summary"].strip() and annotations["description"].strip(), name
        assert "cosyvoice-lb " in annotations["description"], f"{name}: no command to run"
    for name in ("CosyVoiceInstanceDown", "CosyVoiceInstanceScrapeFailing", "CosyVoiceRestartStorm"):
        assert "cosyvoice-lb logs {{ $labels.name }}" in rules()[name]["annotations"]["description"]


def test_alerts_use_only_contract_metrics():
    for name, rule in rules().items():
        used = metric_names(rule["expr"])
        assert used, name
        assert used <= CONTRACT, f"{name}: {used - CONTRACT}"


# --- grafana-dashboard.json --------------------------------------------------------------------


def dashboard() -> dict:
    return json.loads(grafana_dashboard())


def charts() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def test_dashboard_settings_and_datasource_variable():
    board = dashboard()
    assert board["uid"] == "cosyvoice-lb" and board["title"] == "cosyvoice-lb"
    assert 36 <= board["schemaVersion"] <= 41
    assert board["refresh"] == "10s"
    assert board["time"] == {"from": "now-1h", "to": "now"}
    (variable,) = board["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == ("DS_PROMETHEUS", "datasource", "prometheus")


def test_every_panel_and_query_uses_the_datasource_variable():
    assert DATASOURCE == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    panels = charts()
    assert len(panels) >= 20
    for panel in panels:
        assert panel["type"] in ("timeseries", "stat"), panel["title"]
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]


def test_panel_ids_are_unique_and_panels_do_not_overlap():
    panels = dashboard()["panels"]
    ids = [p["id"] for p in panels]
    assert len(set(ids)) == len(ids)
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_dashboard_uses_only_contract_metrics_and_shows_all_but_the_info_ones():
    used: set[str] = set()
    for expr in dashboard_exprs(grafana_dashboard()):
        names = metric_names(expr)
        assert names, expr
        assert names <= CONTRACT, f"{expr}: {names - CONTRACT}"
        used |= names
    assert CONTRACT - NOT_CHARTED - used == set()


def test_dashboard_shows_first_package_quantiles_and_the_asked_for_panels():
    exprs = dashboard_exprs(grafana_dashboard())
    for q in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(cosyvoice_first_package_seconds_bucket[1m])))" in exprs
    assert "sum by (route, outcome) (rate(cosyvoice_requests_total[1m]))" in exprs
    assert "sum by (name, reason) (increase(cosyvoice_lb_instance_restarts_total[15m]))" in exprs
    assert "sum by (route) (rate(cosyvoice_audio_duration_seconds_sum[1m]))" in exprs
    assert any("cosyvoice_voice_cache_hits_total" in e and "cosyvoice_voice_cache_misses_total" in e for e in exprs)


def test_dashboard_exprs_lists_every_target_ready_for_prometheus():
    text = grafana_dashboard()
    raw = [t["expr"] for p in json.loads(text)["panels"] for t in p.get("targets", [])]
    assert any("$__rate_interval" in e for e in raw)  # Grafana's own interval in the file
    exprs = dashboard_exprs(text, rate_interval="2m")
    assert len(exprs) == len(raw)
    assert exprs == [e.replace("$__rate_interval", "2m") for e in raw]
    assert not any("$" in e for e in exprs)


# --- monitoring_files --------------------------------------------------------------------------


def test_monitoring_files_are_the_four_files_and_not_the_token():
    layout = Layout(SHORT)
    settings = Settings(port=9000)
    the_slots = slots(0, None)
    files = monitoring_files(settings, layout, the_slots)
    assert files == {
        "monitoring/prometheus.yml": prometheus_config(settings, layout),
        "monitoring/targets.json": scrape_targets(the_slots),
        "monitoring/alerts.yml": alert_rules(),
        "monitoring/grafana-dashboard.json": grafana_dashboard(),
    }
    assert layout.relative(layout.scrape_token) not in files
    assert all(text.endswith("\n") for text in files.values())
    assert not SHORT.exists()  # pure: nothing written


# --- promtool: Prometheus's own checks ---------------------------------------------------------


def write_state(root: Path) -> Layout:
    """The monitoring files as `up` leaves them: rendered files, the token, the targets."""
    layout = Layout(root)
    for relative, text in monitoring_files(Settings(), layout, slots(0, 1, None)).items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text, encoding="utf-8")
    layout.scrape_token.write_text("metrics-only-token\n", encoding="utf-8")
    layout.scrape_token.chmod(0o600)
    return layout


def run_promtool(promtool: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, cwd=cwd)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.parametrize("state", ["state", "state dir: with spaces"])
def test_promtool_accepts_the_config(promtool, tmp_path, state):
    layout = write_state(tmp_path / state)
    done = run_promtool(promtool, "check", "config", str(layout.prometheus_yml))
    assert "1 rule files found" in done.stdout + done.stderr
    assert "does not exist" not in done.stdout + done.stderr  # targets.json and the token were found


def test_promtool_refuses_the_config_without_the_token(promtool, tmp_path):
    # The token file is checked for: the config really points Prometheus at it.
    layout = write_state(tmp_path / "state")
    layout.scrape_token.unlink()
    done = subprocess.run(
        [promtool, "check", "config", str(layout.prometheus_yml)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "scrape-token" in done.stdout + done.stderr


def test_promtool_accepts_the_rules(promtool, tmp_path):
    layout = write_state(tmp_path / "state")
    done = run_promtool(promtool, "check", "rules", str(layout.alert_rules))
    assert f"{len(ALERTS)} rules found" in done.stdout + done.stderr


def test_promtool_unit_tests_of_the_alerts(promtool, tmp_path):
    (tmp_path / "alerts.yml").write_text(alert_rules(), encoding="utf-8")
    shutil.copy(ALERTS_TEST, tmp_path / "alerts_test.yml")
    done = run_promtool(promtool, "test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert "SUCCESS" in done.stdout


def test_the_alert_unit_tests_cover_every_alert_firing_and_silent():
    # A test per alert both ways: firing (an expected alert) and silent (exp_alerts empty).
    cases = [case for group in yaml.safe_load(ALERTS_TEST.read_text())["tests"] for case in group["alert_rule_test"]]
    firing = {c["alertname"] for c in cases if c.get("exp_alerts")}
    silent = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert firing == set(ALERTS)
    assert silent == set(ALERTS)


def test_promtool_unit_tests_fail_on_a_broken_rule(promtool, tmp_path):
    # The unit tests can tell: without the drained-by-hand exception an alert fires too many.
    broken = alert_rules().replace(" unless on (name) cosyvoice_lb_instance_drained == 1", "")
    assert broken != alert_rules()
    (tmp_path / "alerts.yml").write_text(broken, encoding="utf-8")
    shutil.copy(ALERTS_TEST, tmp_path / "alerts_test.yml")
    done = subprocess.run(
        [promtool, "test", "rules", "alerts_test.yml"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode != 0
    assert "instance-3" in done.stdout + done.stderr


def test_promtool_parses_every_dashboard_query(promtool, tmp_path):
    # Each query as a recording rule: `check rules` parses its PromQL as Prometheus would.
    exprs = dashboard_exprs(grafana_dashboard())
    recorded = [{"record": f"cvlb:dashboard:{i}", "expr": expr} for i, expr in enumerate(exprs)]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recorded}]}), encoding="utf-8")
    done = run_promtool(promtool, "check", "rules", str(path))
    assert f"{len(exprs)} rules found" in done.stdout + done.stderr


def test_the_stale_health_loop_alert_follows_slow_probes():
    assert "cosyvoice_lb_health_report_age_seconds > 30\n" in alert_rules(Settings())
    slow = alert_rules(Settings(probe_interval=30.0, probe_timeout=5.0))  # status allows 5 x 30 + 2 x 5 s
    assert "cosyvoice_lb_health_report_age_seconds > 160\n" in slow
    stale = rules(slow)["CosyVoiceHealthLoopStale"]
    assert stale["expr"] == "cosyvoice_lb_health_report_age_seconds > 160"
    assert "over 160 s" in stale["annotations"]["description"]


# --- one source: alert_groups() --------------------------------------------------------------


@pytest.mark.parametrize("settings", [None, Settings(probe_interval=30.0, probe_timeout=5.0)])
def test_alerts_yml_is_the_groups_of_the_one_source_exactly(settings):
    # alerts.yml is written by hand-laid YAML (comments, folded descriptions): it must load
    # back to exactly the data a PrometheusRule carries.
    assert yaml.safe_load(alert_rules(settings)) == {"groups": alert_groups(settings)}
    assert alert_groups(settings) == alert_groups(settings, BOX) == alert_groups(settings, RuleScope())


def test_alerts_yml_says_why_each_rule_is_as_it_is():
    text = alert_rules()
    comments = " ".join(line.strip().lstrip("# ") for line in text.splitlines() if line.lstrip().startswith("#"))
    assert "An instance drained by hand is out on purpose: never alert on it." in comments
    assert "No traffic gives no quantile (NaN), which never fires." in comments
    assert "promtool check rules alerts.yml" in comments
    # each reason sits right above its rule
    lines = text.splitlines()
    at = lines.index("      - alert: CosyVoiceRestartStorm")
    assert lines[at - 1].strip().startswith("#") and "15-minute window" in " ".join(lines[at - 3 : at])


def test_a_scope_changes_only_which_series_the_rules_read_and_what_they_say():
    scoped = RuleScope(
        select='namespace="ns"',
        instance_targets='kind="instance"',
        cluster_target='kind="cluster"',
        instance=("pod", "name"),
        cluster=("namespace",),
        run_here="ssh box -- ",
    )
    box, other = ({r["alert"]: r for r in alert_groups(scope=scope)[0]["rules"]} for scope in (BOX, scoped))
    assert list(box) == list(other)
    for name in box:
        assert {k: v for k, v in box[name].items() if k not in ("expr", "annotations")} == {
            k: v for k, v in other[name].items() if k not in ("expr", "annotations")
        }, name
    assert other["CosyVoiceInstanceScrapeFailing"]["expr"] == 'up{namespace="ns",kind="instance"} == 0'
    assert other["CosyVoiceClusterMetricsDown"]["expr"] == 'up{namespace="ns",kind="cluster"} == 0'
    assert " unless on (pod, name) " in other["CosyVoiceInstanceDown"]["expr"]
    assert other["CosyVoiceNoInstanceInRotation"]["expr"] == (
        'sum by (namespace) (cosyvoice_lb_instance_in_rotation{namespace="ns"}) == 0'
    )
    assert (
        "`ssh box -- cosyvoice-lb logs {{ $labels.name }}`"
        in other["CosyVoiceInstanceDown"]["annotations"]["description"]
    )
