"""The Grafana dashboard of a cluster (``grafana-dashboard.json``): a dashboard to import,
whose panels pick their Prometheus from the dashboard's ``DS_PROMETHEUS`` variable.

Pure, like ``render``: every function returns text and writes nothing. Every metric name
charted here is one the instances and the control panel expose (the metrics contract); the
tests hold the two together.
"""

from __future__ import annotations

import json
import re
from typing import Any

# How every panel names its data source: the dashboard's datasource variable.
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
DASHBOARD_UID = "cosyvoice-lb"

_GRID_WIDTH = 24


def _quantile(q: float, metric: str, by: str = "le") -> str:
    return f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket[$__rate_interval])))"


def _target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}


def _panel(
    kind: str, title: str, description: str, targets: list[tuple[str, str]], unit: str = "short", **extra: Any
) -> dict[str, Any]:
    """A panel without id and position (the layout gives those): ``targets`` as (expr, legend)."""
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [_target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit, **extra.pop("defaults", {})}, "overrides": []},
        **extra,
    }


def _stat(title: str, description: str, expr: str, unit: str = "short", **defaults: Any) -> dict[str, Any]:
    return _panel(
        "stat",
        title,
        description,
        [(expr, "")],
        unit,
        defaults=defaults,
        options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "colorMode": "value"},
    )


def _series(title: str, description: str, targets: list[tuple[str, str]], unit: str = "short") -> dict[str, Any]:
    return _panel(
        "timeseries",
        title,
        description,
        targets,
        unit,
        options={"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
    )


def _row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def _thresholds(*steps: tuple[float | None, str]) -> dict[str, Any]:
    return {"thresholds": {"mode": "absolute", "steps": [{"value": v, "color": c} for v, c in steps]}}


def _sections() -> list[tuple[str, int, list[dict[str, Any]]]]:
    """(row title, panel height, panels) from top to bottom; widths split each row evenly."""
    rate = "$__rate_interval"
    first = "cosyvoice_first_package_seconds"
    return [
        (
            "Overview",
            4,
            [
                _stat(
                    "Instances ready",
                    "Instances whose last health probe said ready.",
                    "sum(cosyvoice_lb_instance_ready)",
                ),
                _stat("Instances planned", "Instances the cluster runs.", "max(cosyvoice_lb_instances)"),
                _stat(
                    "Requests / s",
                    "Requests finished per second, every instance, route and outcome.",
                    f"sum(rate(cosyvoice_requests_total[{rate}]))",
                    "reqps",
                ),
                _stat(
                    "First package p99",
                    "99th percentile of request arrival to first audio chunk (alert: over 1.5 s).",
                    _quantile(0.99, first),
                    "s",
                    **_thresholds((None, "green"), (1.5, "red")),
                ),
                _stat(
                    "Health report age",
                    "Seconds since the health loop last reported (alert: over 30 s).",
                    "max(cosyvoice_lb_health_report_age_seconds)",
                    "s",
                    **_thresholds((None, "green"), (30, "red")),
                ),
                _stat("nginx up", "1 when nginx's stub_status answered.", "min(cosyvoice_lb_nginx_up)"),
            ],
        ),
        (
            "Latency and load",
            8,
            [
                _series(
                    "First package latency",
                    "Request arrival at an instance to the engine's first audio chunk, every route.",
                    [(_quantile(q, first), f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)],
                    "s",
                ),
                _series(
                    "Requests by route and outcome",
                    "Requests finished per second.",
                    [(f"sum by (route, outcome) (rate(cosyvoice_requests_total[{rate}]))", "{{route}} {{outcome}}")],
                    "reqps",
                ),
                _series(
                    "In flight and queued",
                    "Syntheses holding an engine slot, requests waiting for one, long texts coordinated.",
                    [
                        ("sum by (name) (cosyvoice_syntheses_in_flight)", "{{name}} in flight"),
                        ("sum by (name) (cosyvoice_queue_depth)", "{{name}} queued"),
                        ("sum by (name) (cosyvoice_long_texts_in_flight)", "{{name}} long texts"),
                    ],
                ),
                _series(
                    "Queue wait p99",
                    "Time waiting for an engine slot, by route.",
                    [(_quantile(0.99, "cosyvoice_queue_wait_seconds", "le, route"), "{{route}}")],
                    "s",
                ),
                _series(
                    "Real-time factor",
                    "Synthesis seconds per second of audio: below 1 is faster than real time.",
                    [(_quantile(q, "cosyvoice_real_time_factor"), f"p{round(q * 100)}") for q in (0.5, 0.99)],
                ),
                _series(
                    "Synthesis time",
                    "Engine time of one synthesis, slot taken to last chunk.",
                    [(_quantile(q, "cosyvoice_synthesis_seconds"), f"p{round(q * 100)}") for q in (0.5, 0.99)],
                    "s",
                ),
                _series(
                    "Audio seconds per second",
                    "Seconds of audio made per second of wall time, by route.",
                    [(f"sum by (route) (rate(cosyvoice_audio_duration_seconds_sum[{rate}]))", "{{route}}")],
                ),
                _series(
                    "Voice cache hit ratio",
                    "Saved-voice speaker cache: hits / (hits + misses).",
                    [
                        (
                            f"sum(rate(cosyvoice_voice_cache_hits_total[{rate}])) / "
                            f"(sum(rate(cosyvoice_voice_cache_hits_total[{rate}])) "
                            f"+ sum(rate(cosyvoice_voice_cache_misses_total[{rate}])))",
                            "hit ratio",
                        )
                    ],
                    "percentunit",
                ),
            ],
        ),
        (
            "Instances",
            8,
            [
                _series(
                    "Up, ready, in rotation",
                    "Per instance, 1/0: supervisord RUNNING, last probe ready, in nginx's rotation, drained by hand.",
                    [
                        ("cosyvoice_lb_instance_up", "{{name}} up"),
                        ("cosyvoice_lb_instance_ready", "{{name}} ready"),
                        ("cosyvoice_lb_instance_in_rotation", "{{name}} in rotation"),
                        ("cosyvoice_lb_instance_drained", "{{name}} drained"),
                    ],
                ),
                _series(
                    "Restarts by reason (15 min)",
                    "Restarts in the last 15 minutes (alert: over 3 for one instance).",
                    [
                        (
                            "sum by (name, reason) (increase(cosyvoice_lb_instance_restarts_total[15m]))",
                            "{{name}} {{reason}}",
                        )
                    ],
                ),
                _series(
                    "Health probe latency",
                    "The last health probe's latency, per instance.",
                    [("cosyvoice_lb_probe_duration_seconds", "{{name}}")],
                    "s",
                ),
                _series(
                    "Uptime",
                    "Seconds since each instance last started.",
                    [("cosyvoice_lb_instance_uptime_seconds", "{{name}}")],
                    "s",
                ),
                _series(
                    "Instance memory (RSS)",
                    "Resident memory of each instance's process.",
                    [("cosyvoice_lb_instance_memory_bytes", "{{name}}")],
                    "bytes",
                ),
                _series(
                    "Scrape targets up",
                    "Prometheus's own view: 1 when a /metrics answered its last scrape.",
                    [('up{job=~"cosyvoice-instances|cosyvoice-lb"}', "{{job}} {{name}}")],
                ),
            ],
        ),
        (
            "Speech",
            8,
            [
                _series(
                    "Speech check error",
                    "What the recogniser heard against the text (WER; CER for Chinese and Japanese), per instance: "
                    "sampled live answers, warm-ups and canaries (alert: p90 over --asr-max-error for 10 minutes).",
                    [
                        (
                            "histogram_quantile(0.5, sum by (name, le) (rate(cosyvoice_speech_error_ratio_bucket[30m])))",
                            "{{name}} p50",
                        ),
                        (
                            "histogram_quantile(0.9, sum by (name, le) (rate(cosyvoice_speech_error_ratio_bucket[30m])))",
                            "{{name}} p90",
                        ),
                    ],
                ),
                _series(
                    "Speaker similarity",
                    "Cosine of each checked answer's speaker embedding to its prompt's (upstream's campplus.onnx "
                    "in the model dir; answers spoken with a prompt), per instance: a drop is a voice drifting.",
                    [
                        (
                            "histogram_quantile(0.1, sum by (name, le) (rate(cosyvoice_speaker_similarity_bucket[30m])))",
                            "{{name}} p10",
                        ),
                        (
                            "histogram_quantile(0.5, sum by (name, le) (rate(cosyvoice_speaker_similarity_bucket[30m])))",
                            "{{name}} p50",
                        ),
                    ],
                ),
                _series(
                    "Speech checks",
                    "Checks per second by kind and outcome (failed: above --asr-max-error; unchecked: no recogniser).",
                    [(f"sum by (kind, outcome) (rate(cosyvoice_speech_checks_total[{rate}]))", "{{kind}} {{outcome}}")],
                ),
                _stat(
                    "Speech unchecked",
                    "Instances whose last warm-up or canary no recogniser could judge: not a pass.",
                    "sum(cosyvoice_speech_unchecked)",
                ),
            ],
        ),
        (
            "GPUs",
            8,
            [
                _series(
                    "GPU memory",
                    "Used and total memory per card (alert: over 90 % used for 5 minutes).",
                    [
                        ("cosyvoice_lb_gpu_memory_used_bytes", "gpu {{gpu}} used"),
                        ("cosyvoice_lb_gpu_memory_total_bytes", "gpu {{gpu}} total"),
                    ],
                    "bytes",
                ),
                _series(
                    "GPU memory per instance",
                    "Memory each instance holds on its card.",
                    [("cosyvoice_lb_instance_gpu_memory_bytes", "{{name}} (gpu {{gpu}})")],
                    "bytes",
                ),
                _series(
                    "GPU utilisation",
                    "Share of time a kernel ran, per card.",
                    [("cosyvoice_lb_gpu_utilization_ratio", "gpu {{gpu}}")],
                    "percentunit",
                ),
                _series(
                    "GPU temperature",
                    "Per card.",
                    [("cosyvoice_lb_gpu_temperature_celsius", "gpu {{gpu}}")],
                    "celsius",
                ),
                _series("GPU power", "Per card.", [("cosyvoice_lb_gpu_power_watts", "gpu {{gpu}}")], "watt"),
            ],
        ),
        (
            "nginx",
            8,
            [
                _series(
                    "nginx connections",
                    "Open connections by state (stub_status).",
                    [("sum by (state) (cosyvoice_lb_nginx_connections)", "{{state}}")],
                ),
                _series(
                    "nginx requests and connections / s",
                    "Requests, and connections accepted and handled, per second (accepted above handled: "
                    "nginx dropped connections at a limit).",
                    [
                        (f"rate(cosyvoice_lb_nginx_requests_total[{rate}])", "requests"),
                        (f"rate(cosyvoice_lb_nginx_connections_accepted_total[{rate}])", "accepted"),
                        (f"rate(cosyvoice_lb_nginx_connections_handled_total[{rate}])", "handled"),
                    ],
                    "reqps",
                ),
            ],
        ),
    ]


def _panels() -> list[dict[str, Any]]:
    """Rows and panels with ids and grid positions: each section a row, its panels side by
    side (at most 3 a line for charts, all in one line for stats)."""
    panels: list[dict[str, Any]] = []
    y = 0
    for title, height, section in _sections():
        panels.append({**_row(title), "gridPos": {"h": 1, "w": _GRID_WIDTH, "x": 0, "y": y}})
        y += 1
        per_line = len(section) if height < 8 else min(3, len(section))
        width = _GRID_WIDTH // per_line
        for i, panel in enumerate(section):
            x = (i % per_line) * width
            if i and x == 0:
                y += height
            panels.append({**panel, "gridPos": {"h": height, "w": width, "x": x, "y": y}})
        y += height
    for number, panel in enumerate(panels, start=1):
        panel["id"] = number
    return panels


def grafana_dashboard() -> str:
    """The Grafana dashboard JSON (import it, or provision it from the file): every panel
    queries the Prometheus picked in its ``DS_PROMETHEUS`` variable."""
    dashboard = {
        "uid": DASHBOARD_UID,
        "title": "cosyvoice-lb",
        "description": "CosyVoice TTS behind cosyvoice-lb: latency, load, instances, GPUs, nginx.",
        "tags": ["cosyvoice", "tts"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,  # shared crosshair: the same moment on every chart
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "templating": {
            "list": [
                {
                    "name": "DS_PROMETHEUS",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                    "options": [],
                }
            ]
        },
        "annotations": {"list": []},
        "panels": _panels(),
    }
    return json.dumps(dashboard, indent=2) + "\n"


def dashboard_exprs(text: str, rate_interval: str = "1m") -> list[str]:
    """Every PromQL expression of the dashboard ``text``, in panel order, with Grafana's
    ``$__rate_interval`` replaced by ``rate_interval`` so Prometheus runs them as they are."""
    exprs = []
    for panel in json.loads(text)["panels"]:
        for target in panel.get("targets", []):
            exprs.append(re.sub(r"\$__rate_interval\b", rate_interval, target["expr"]))
    return exprs
