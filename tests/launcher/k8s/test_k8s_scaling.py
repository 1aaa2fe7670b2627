"""`k8s render --schedule`: KEDA's ScaledObject instead of the HPA
(cosyvoice_lb/launcher/k8s/scaling.py), checked by shape as the ServiceMonitor is, and its cron
windows checked against KEDA's own rule for a cron trigger (active while the next end comes
before the next start) minute by minute over a week: the pods' floor is the box's floor."""

from __future__ import annotations

import bisect
import dataclasses
from datetime import datetime, timedelta

import pytest
import yaml
from conftest import cli_here
from test_k8s import V3, container, documents, validate

from cosyvoice_lb.common.schedule import parse_cron, parse_schedule, scheduled_floor
from cosyvoice_lb.common.settings import envvar
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.k8s.manifests import Deployment, manifests, write_manifests
from cosyvoice_lb.launcher.k8s.scaling import cron_triggers, scaled_object

WORKDAY = "0 9 * * 1-5=3;0 22 * * *=1"
SCHEDULED = dataclasses.replace(V3, schedule=WORKDAY)
SUNDAY = datetime(2024, 6, 2)  # the week checked: Sunday 2 to Saturday 8 June 2024


def test_the_scaled_object_has_keda_s_shape_and_names_the_deployment():
    deployment = Deployment(name="tts", namespace="speech", replicas=2, max_replicas=6, timezone="Europe/Berlin")
    found = scaled_object(deployment, parse_schedule(WORKDAY))
    assert found["apiVersion"] == "keda.sh/v1alpha1" and found["kind"] == "ScaledObject"
    assert found["metadata"]["name"] == "tts" and found["metadata"]["namespace"] == "speech"
    assert found["metadata"]["labels"]["app.kubernetes.io/instance"] == "tts"
    spec = found["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tts"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 6)
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 600
    }
    kinds = [t["type"] for t in spec["triggers"]]
    assert kinds == ["cron", "cron", "prometheus", "cpu"]
    crons = [t["metadata"] for t in spec["triggers"] if t["type"] == "cron"]
    assert all(set(c) == {"timezone", "start", "end", "desiredReplicas"} for c in crons)
    assert all(isinstance(c["desiredReplicas"], str) and c["timezone"] == "Europe/Berlin" for c in crons)
    assert crons == [
        {"timezone": "Europe/Berlin", "start": "0 9 * * 1-5", "end": "0 22 * * 1-5", "desiredReplicas": "3"},
        {"timezone": "Europe/Berlin", "start": "0 22 * * 1-5", "end": "0 9 * * 1-5", "desiredReplicas": "1"},
    ]
    (prometheus,) = (t for t in spec["triggers"] if t["type"] == "prometheus")
    assert set(prometheus["metadata"]) == {"serverAddress", "query", "threshold"}
    assert prometheus["metadata"]["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
    assert prometheus["metadata"]["query"] == (
        'sum(cosyvoice_lb_instance_queue_depth{namespace="speech",service="tts"})'
    )  # the Service the ServiceMonitor scrapes through, and the series the HPA's adapter rule reads
    assert prometheus["metadata"]["threshold"] == "1.0" and prometheus["metricType"] == "AverageValue"
    (cpu,) = (t for t in spec["triggers"] if t["type"] == "cpu")
    assert cpu == {"type": "cpu", "metricType": "Utilization", "metadata": {"value": "70"}}


def test_with_a_schedule_the_render_writes_a_scaled_object_instead_of_the_hpa():
    files = manifests(SCHEDULED, Deployment(model_volume="models", host="tts.example.org"))
    assert "scaledobject.yaml" in files and "hpa.yaml" not in files
    kinds = [d["kind"] for d in documents(files)]
    assert "ScaledObject" in kinds and "HorizontalPodAutoscaler" not in kinds
    for doc in documents(files):
        validate(doc, "1.30.0")  # (the core objects strictly, the ScaledObject by shape)
    text = files["scaledobject.yaml"]
    assert "#   Fri 22:00 to Mon 09:00: at least 1 pod(s)" in text and "#   Mon 09:00 to Mon 22:00" in text
    # A pod serves its own plan: the pods' count is KEDA's, so the schedule does not reach the pod.
    assert envvar("schedule") not in {e["name"] for e in container(files)["env"]}
    assert "hpa.yaml" in manifests(V3, Deployment()) and "scaledobject.yaml" not in manifests(V3, Deployment())


def keda_desired(triggers: list[dict], now: datetime, firings: dict[str, list[datetime]]) -> int | None:
    """What KEDA's cron scaler gives at ``now``: each trigger active while its next end comes
    before its next start; the HPA KEDA makes takes the highest of the active ones."""
    active = []
    for trigger in triggers:
        meta = trigger["metadata"]
        starts, ends = firings[meta["start"]], firings[meta["end"]]
        next_start, next_end = starts[bisect.bisect_right(starts, now)], ends[bisect.bisect_right(ends, now)]
        if not (next_start < next_end):
            active.append(int(meta["desiredReplicas"]))
    return max(active) if active else None


@pytest.mark.parametrize(
    "schedule",
    [
        WORKDAY,
        "*/30 9-11 * * 1-5=3;0 12 * * 1,3=5;0 18 * * *=1;0 8 * * 6=2",
        "0 9 * * 1=2",  # one floor all week
        "0 9 1-31 * 5=4;30 20 * * *=1",  # both day fields restricted: every day (cron's either-rule)
        "0 0 * * 7=3;0 6 * * 0=1",  # Sunday as 7 and as 0
    ],
)
def test_keda_s_cron_windows_give_the_box_s_floor_all_week(schedule):
    entries = parse_schedule(schedule)
    triggers = cron_triggers(entries, "UTC")
    minutes = [SUNDAY + timedelta(minutes=m) for m in range(3 * 7 * 24 * 60)]  # three weeks of firings
    crons = {t["metadata"][key] for t in triggers for key in ("start", "end")}
    parsed = {text: parse_cron(text) for text in crons}
    firings = {text: [t for t in minutes if parsed[text].matches(t)] for text in crons}
    week = SUNDAY + timedelta(days=7)  # (a week whose floor has a week of history behind it)
    for minute in range(0, 7 * 24 * 60, 5):
        now = week + timedelta(minutes=minute, seconds=30)
        assert keda_desired(triggers, now, firings) == scheduled_floor(entries, now), (now, triggers)


def test_a_schedule_keda_cannot_hold_is_refused_saying_why(tmp_path):
    with pytest.raises(ClusterError, match=r"'0 9 1 \* \*=3': KEDA's cron windows are rendered from a weekly"):
        manifests(dataclasses.replace(V3, schedule="0 9 1 * *=3"), Deployment())
    with pytest.raises(ClusterError, match=r"--timezone 'Mars/Olympus' is not an IANA time zone"):
        manifests(SCHEDULED, Deployment(timezone="Mars/Olympus"))
    with pytest.raises(ClusterError, match=r"--prometheus-url 'prometheus:9090' is not an http\(s\) URL"):
        manifests(SCHEDULED, Deployment(prometheus_url="prometheus:9090"))
    with pytest.raises(ClusterError, match=r"--schedule '0 9 \* \* 1-5' is not CRON=N"):
        write_manifests(dataclasses.replace(V3, schedule="0 9 * * 1-5"), Deployment(), str(tmp_path / "k"))


def test_the_command_takes_the_schedule_and_swaps_the_autoscaler_file(tmp_path):
    out = tmp_path / "m"
    done = cli_here(
        "k8s",
        "render",
        "--out",
        str(out),
        "--instances",
        "1",
        "--schedule",
        "0 9 * * 1-5=3",
        "--schedule",
        "0 22 * * *=1",
        "--timezone",
        "Europe/Berlin",
        "--prometheus-url",
        "http://prometheus.monitoring:9090",
    )
    assert done.returncode == 0, done.stderr
    assert (out / "scaledobject.yaml").exists() and not (out / "hpa.yaml").exists()
    found = yaml.safe_load((out / "scaledobject.yaml").read_text())
    triggers = found["spec"]["triggers"]
    assert {t["metadata"].get("timezone") for t in triggers if t["type"] == "cron"} == {"Europe/Berlin"}
    assert triggers[2]["metadata"]["serverAddress"] == "http://prometheus.monitoring:9090"
    again = cli_here("k8s", "render", "--out", str(out), "--instances", "1")  # without: the HPA, and no stale KEDA file
    assert again.returncode == 0, again.stderr
    assert (out / "hpa.yaml").exists() and not (out / "scaledobject.yaml").exists()
    bad = cli_here("k8s", "render", "--out", str(tmp_path / "n"), "--schedule", "0 9 * * MON=3")
    assert bad.returncode != 0 and "day of week 'MON' is not understood" in bad.stderr
    env = cli_here("k8s", "render", "--out", str(tmp_path / "e"), "--instances", "1", env=with_schedule_env(WORKDAY))
    assert env.returncode == 0, env.stderr
    assert len(yaml.safe_load((tmp_path / "e" / "scaledobject.yaml").read_text())["spec"]["triggers"]) == 4


def with_schedule_env(value: str) -> dict[str, str]:
    from conftest import clean_env

    return {**clean_env(), envvar("schedule"): value}
