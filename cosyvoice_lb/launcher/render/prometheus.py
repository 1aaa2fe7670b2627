"""Prometheus files of a cluster: the scrape config, its targets and the alert rules.

Pure, like ``render``: every function returns text and writes nothing.

- ``targets.json``: Prometheus file service discovery, one target group per instance (its
  loopback /metrics). Rewritten at every render, so a Prometheus using it follows ``up``
  when the number of instances changes, without a reload.
- ``prometheus.yml``: a complete config (``prometheus --config.file=...`` runs it as it is),
  or two jobs to copy into an existing Prometheus: the instances, and the cluster's own
  metrics behind nginx, read with the scrape token (a secret: written elsewhere, not here).
- ``alerts.yml``: the alert rules ``prometheus.yml`` loads.

The alert rules are defined once, as data (:func:`alert_groups`): ``alerts.yml`` is them
written with their reasons as comments, and `k8s render`'s PrometheusRule carries the same
groups in a pod's :class:`RuleScope` (its namespace and job, the pod among the instance's
labels). Every metric name the alerts use is one the instances and the control panel expose
(the metrics contract); the tests hold the two together.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import yaml

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.timeouts import Timeouts
from cosyvoice_lb.launcher.plan.planner import Slot
from cosyvoice_lb.launcher.render.addresses import balancer_url
from cosyvoice_lb.launcher.render.alertmanager import alertmanager_target
from cosyvoice_lb.launcher.render.templates import template_environment
from cosyvoice_lb.launcher.state.layout import Layout


def _yaml_string(value: object) -> str:
    # A JSON string is a valid YAML double-quoted scalar: spaces, colons, '#' and quotes in a
    # path stay part of the string.
    return json.dumps(str(value))


def _from_template(template: str, **context: Any) -> str:
    env = template_environment()  # the house Jinja settings: StrictUndefined, trim_blocks, ...
    env.filters["yq"] = _yaml_string
    return env.get_template(template).render(**context)


def scrape_targets(slots: Iterable[Slot]) -> str:
    """Prometheus file-SD JSON: one target group per instance, labelled with its name and
    GPU index (``cpu`` for a CPU slot)."""
    groups = [
        {
            "targets": [f"127.0.0.1:{slot.port}"],
            "labels": {"name": slot.name, "gpu": "cpu" if slot.gpu is None else str(slot.gpu)},
        }
        for slot in slots
    ]
    return json.dumps(groups, indent=2) + "\n"


def balancer_target(settings: Settings) -> str:
    """``host:port`` at which Prometheus on this box reaches nginx (the cluster's /metrics)."""
    return balancer_url(settings).removeprefix("http://")


def prometheus_config(settings: Settings, layout: Layout) -> str:
    """prometheus.yml: the instances' job (file SD from ``targets.json``), the cluster's job
    (nginx's /metrics with the scrape token's file) and the alert rules, by absolute path;
    with --alertmanager, the cluster's Alertmanager to send the alerts to."""
    alerting = alertmanager_target(settings) if settings.alertmanager else ""
    return _from_template("prometheus.yml.j2", layout=layout, balancer=balancer_target(settings), alertmanager=alerting)


@dataclass(frozen=True)
class RuleScope:
    """Where the alert rules run, the one thing that differs between the box's ``alerts.yml``
    and a Kubernetes PrometheusRule. The defaults are the box's: its Prometheus
    (``prometheus.yml``) scrapes the instances as job ``cosyvoice-instances`` and the cluster
    as ``cosyvoice-lb``, and one label, ``name``, tells an instance from every other. A pod's
    scope (``k8s/monitoring.py``) picks its deployment's series by namespace and job and tells
    an instance by its pod and name (instance-0 is in every pod)."""

    select: str = ""  # matchers every series the rules read must carry ("" = all of them)
    instance_targets: str = 'job="cosyvoice-instances"'  # the instances' scrape targets, in `up`
    cluster_target: str = 'job="cosyvoice-lb"'  # the cluster's /metrics target, in `up`
    instance: tuple[str, ...] = ("name",)  # the labels that tell one instance from every other
    cluster: tuple[str, ...] = ()  # the labels that tell one cluster from another (() = one)
    of: str = ""  # after an instance's name in a message: where it runs (" of POD")
    target: str = "{{ $labels.instance }}"  # a scrape target, in a message
    run_here: str = ""  # before a command run where the alert's series come from (kubectl exec POD --)
    run_anywhere: str = ""  # before a command about the cluster as a whole
    token: str = "the scrape token in the state dir's monitoring/ folder"


BOX = RuleScope()

# Why each rule is as it is: comments above the rule in alerts.yml.
_NOTES = {
    "CosyVoiceFirstPackageSlow": "The latency users feel: request arrival -> first audio chunk, every instance and "
    "route together but long texts' segments (those after the first queue behind each other on purpose). No "
    "traffic gives no quantile (NaN), which never fires.",
    "CosyVoiceInstanceDown": "From the cluster's view: supervisord says the process is not RUNNING, or the last "
    "health probe said not ready. An instance drained by hand is out on purpose: never alert on it. (`or` and "
    "`unless` match on labels, metric name aside: one series per instance, whichever of the two says it is down.)",
    "CosyVoiceInstanceScrapeFailing": "A separate alert, not folded into CosyVoiceInstanceDown: it is Prometheus's "
    "own view of the instance (its /metrics), so it still fires when the cluster's metrics are gone, and it "
    "catches a process supervisord calls RUNNING that no longer answers HTTP.",
    "CosyVoiceRestartStorm": "Restarts of every reason together (crash, hang, probe failures, ...): an instance "
    "that keeps coming back and falling over again. The 15-minute window is the duration.",
    "CosyVoiceNoInstanceInRotation": "Nothing left to serve: every instance out of rotation (down, loading, "
    "drained by hand, or replaced at once), so every request gets 503.",
    "CosyVoiceResultsNotKept": "A full or unwritable outputs dir: the instance still speaks, but its results are "
    "not kept (non-streamed requests get 507). The gauge stays 1 until a write succeeds again.",
    "CosyVoiceHealthLoopStale": "The health loop ejects failed instances and restarts hung ones: when it stops "
    "reporting, nobody does.",
    "CosyVoiceSpeechErrorHigh": "What listeners hear: the recogniser's error on a share of live answers, warm-ups "
    "and canaries (--asr-sample). A canary above --asr-max-error takes its instance out at once; this catches "
    "what drifts under it for a while (a model that mumbles, skips or repeats, on every instance at once after "
    "a roll-out). No checks give no quantile (NaN), which never fires.",
    "CosyVoiceSpeechUnchecked": "Could not check is never a pass: an instance whose warm-up or canary speech no "
    "recogniser could judge (none installed, none named for the engine, a language it does not know).",
}


def _rule(alert: str, expr: str, duration: str | None, severity: str, summary: str, description: str) -> dict:
    rule: dict[str, Any] = {"alert": alert, "expr": expr}
    if duration:
        rule["for"] = duration
    rule["labels"] = {"severity": severity}
    rule["annotations"] = {"summary": summary, "description": description}
    return rule


def alert_groups(settings: Settings | None = None, scope: RuleScope = BOX) -> list[dict[str, Any]]:
    """The cluster's alert rules, one group (``cosyvoice-lb``), as Prometheus's ``groups:``
    value: what ``alerts.yml`` holds (:data:`BOX`) and a PrometheusRule's ``spec.groups`` (a
    pod's scope). The health loop counts as stale after 30 s, or after what `status` allows
    when its probes are slower."""
    stale = max(30, math.ceil(Timeouts(settings or Settings()).health_stale))
    max_error = (settings or Settings()).asr_max_error
    s = scope

    def series(metric: str, *matchers: str) -> str:
        inside = ",".join(m for m in (s.select, *matchers) if m)
        return f"{metric}{{{inside}}}" if inside else metric

    def total(*labels: str) -> str:  # summed over each cluster
        return f"sum by ({', '.join((*s.cluster, *labels))}) " if s.cluster or labels else "sum"

    def here(command: str) -> str:
        return f"`{s.run_here}cosyvoice-lb {command}`"

    def anywhere(command: str) -> str:
        return f"`{s.run_anywhere}cosyvoice-lb {command}`"

    one = ", ".join(s.instance)
    name = "{{ $labels.name }}" + s.of
    first_package = series("cosyvoice_first_package_seconds_bucket", 'route!="segment"')
    speech_error = series("cosyvoice_speech_error_ratio_bucket")
    up, ready = series("cosyvoice_lb_instance_up"), series("cosyvoice_lb_instance_ready")
    rules = [
        _rule(
            "CosyVoiceFirstPackageSlow",
            f"histogram_quantile(0.99, {total('le')}(rate({first_package}[5m]))) > 1.5",
            "2m",
            "warning",
            "p99 first-package latency is {{ $value | humanizeDuration }} (over 1.5 s)",
            "For 2 minutes the slowest 1 % of syntheses waited over 1.5 s for their first audio. Look at the "
            "queue depth and queue wait (too few instances for the load?), GPU utilisation, and "
            f"{anywhere('status')} for instances out of rotation.",
        ),
        _rule(
            "CosyVoiceGpuMemoryHigh",
            f"{series('cosyvoice_lb_gpu_memory_used_bytes')} / {series('cosyvoice_lb_gpu_memory_total_bytes')} > 0.9",
            "5m",
            "warning",
            "GPU {{ $labels.gpu }}" + s.of + " memory is {{ $value | humanizePercentage }} full",
            "GPU {{ $labels.gpu }} has used over 90 % of its memory for 5 minutes: the next load or a long "
            f"synthesis may run out. See each instance's GPU memory ({here('status')}), other processes in "
            f"nvidia-smi, and {here('plan')} for fewer instances per card.",
        ),
        _rule(
            "CosyVoiceInstanceDown",
            f"({up} == 0 or {ready} == 0) unless on ({one}) {series('cosyvoice_lb_instance_drained')} == 1",
            "2m",
            "warning",
            f"{name} has been down or not ready for 2 minutes",
            "{{ $labels.name }} is not running or its health probe says not ready, and it was not drained by "
            f"hand. See {here('status')} and {here('logs {{ $labels.name }}')}.",
        ),
        _rule(
            "CosyVoiceInstanceScrapeFailing",
            f"{series('up', s.instance_targets)} == 0",
            "2m",
            "warning",
            "{{ $labels.name }}'s /metrics (" + s.target + ") has not answered for 2 minutes",
            "Prometheus cannot scrape {{ $labels.name }} at " + s.target + ": the process is down, hung or still "
            f"loading. See {here('status')} and {here('logs {{ $labels.name }}')}.",
        ),
        _rule(
            "CosyVoiceRestartStorm",
            f"sum by ({one}) (increase({series('cosyvoice_lb_instance_restarts_total')}[15m])) > 3",
            None,  # the 15-minute window is the duration
            "critical",
            name + ' restarted {{ $value | printf "%.0f" }} times in 15 minutes',
            "{{ $labels.name }} restarted over 3 times in 15 minutes. The reason label of "
            "cosyvoice_lb_instance_restarts_total says why (crash, hang, probe_failures, ...); see "
            f"{here('logs {{ $labels.name }}')} and {here('status')}.",
        ),
        _rule(
            "CosyVoiceNoInstanceInRotation",
            f"{total()}({series('cosyvoice_lb_instance_in_rotation')}) == 0",
            "1m",
            "critical",
            "No instance has been in rotation for a minute: every request gets 503",
            f"Every instance is out of nginx's rotation. See {anywhere('status')} for why (loading, failed, "
            f"drained by hand) and {anywhere('undrain NAME')} or {anywhere('restart NAME')}.",
        ),
        _rule(
            "CosyVoiceResultsNotKept",
            f"{series('cosyvoice_outputs_failing')} == 1",
            "1m",
            "critical",
            f"{name} cannot keep its results: its outputs dir is full or unwritable",
            "{{ $labels.name }}'s last write to its outputs dir failed (disk full, or not writable): requests "
            "that are not streamed get 507, streamed ones are sent but not kept (cosyvoice_results_not_kept_total "
            "counts them). Free space there or move --outputs-dir to a writable disk; see "
            f"{here('status')} and {here('logs {{ $labels.name }}')}.",
        ),
        _rule(
            "CosyVoiceClusterMetricsDown",
            f"{series('up', s.cluster_target)} == 0",
            "2m",
            "critical",
            "The cluster's /metrics at " + s.target + " has not answered for 2 minutes",
            "nginx or the control panel behind it is not answering (or the scrape token was refused). See "
            f"{here('status')}, {here('logs nginx-error')} and {s.token}.",
        ),
        _rule(
            "CosyVoiceHealthLoopStale",
            f"{series('cosyvoice_lb_health_report_age_seconds')} > {stale}",
            "1m",
            "critical",
            "The health loop last reported {{ $value | humanizeDuration }} ago",
            f"The health loop has not reported for over {stale} s, so failed instances are neither taken out of "
            f"rotation nor restarted. See {here('status')} and {here('logs health')}.",
        ),
    ]
    rules += [
        _rule(
            "CosyVoiceSpeechErrorHigh",
            f"histogram_quantile(0.9, sum by ({one}, le) (rate({speech_error}[30m]))) > {max_error:g}",
            "10m",
            "warning",
            f"{name}'s speech: p90 error {{{{ $value | humanizePercentage }}}} (over {max_error:g})",
            "For 10 minutes the speech check heard 1 in 10 of {{ $labels.name }}'s checked answers miss the text "
            f"by more than --asr-max-error {max_error:g} (WER, or CER for Chinese and Japanese). See the panel's "
            f"speech checks (what was heard), {here('logs {{ $labels.name }}')}, and whether a new model or code "
            "rolled out.",
        ),
        _rule(
            "CosyVoiceSpeechUnchecked",
            f"{total()}({series('cosyvoice_speech_unchecked')}) > 0",
            "30m",
            "info",
            '{{ $value | printf "%.0f" }} instance(s) serve with their speech unchecked',
            "No recogniser judged these instances' warm-up or canary speech: their audio passed the audio check, "
            "but nobody heard it. Give --asr-model DIR (sherpa-onnx: SenseVoice, Paraformer, Whisper) or --asr "
            f"pocketsphinx (English); see {anywhere('status')} for why each is unchecked.",
        ),
    ]
    return [{"name": "cosyvoice-lb", "rules": rules}]


_HEADER = """\
# Rendered by cosyvoice-lb from alert_groups() in cosyvoice_lb/launcher/render/prometheus.py --
# `cosyvoice-lb render` rewrites it. (`k8s render`'s prometheusrule.yaml holds the same rules.)
# Alert rules for the cluster's metrics; prometheus.yml beside this file loads them.
# Check them with `promtool check rules alerts.yml`. Instance metrics (job
# cosyvoice-instances) carry the target labels name and gpu; the cluster's metrics (job
# cosyvoice-lb) carry name/gpu as their own labels.
"""


class _Prose(str):
    """A description: written folded (``>-``), wrapped at the file's width."""


class _RulesDumper(yaml.SafeDumper):
    """Only prose wraps: an expression or a summary stays on its one line."""

    def write_plain(self, text: str, split: bool = True) -> None:
        super().write_plain(text, False)

    def write_single_quoted(self, text: str, split: bool = True) -> None:
        super().write_single_quoted(text, False)

    def write_double_quoted(self, text: str, split: bool = True) -> None:
        super().write_double_quoted(text, False)


_RulesDumper.add_representer(_Prose, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", str(v), style=">"))


def _comment(text: str, indent: str) -> str:
    return "".join(f"{indent}# {line}\n" for line in textwrap.wrap(text, 92 - len(indent)))


def alert_rules(settings: Settings | None = None) -> str:
    """alerts.yml: :func:`alert_groups` on this box, each rule below the reason it is as it
    is. YAML that loads back to exactly those groups."""
    out = [_HEADER, "groups:\n"]
    for group in alert_groups(settings):
        out.append(f"  - name: {_yaml_string(group['name'])}\n    rules:\n")
        for rule in group["rules"]:
            out.append(_comment(_NOTES[rule["alert"]], "      ") if rule["alert"] in _NOTES else "")
            prose = {**rule, "annotations": {**rule["annotations"]}}
            prose["annotations"]["description"] = _Prose(rule["annotations"]["description"])
            dumped = yaml.dump([prose], Dumper=_RulesDumper, sort_keys=False, width=86, allow_unicode=True)
            out.append(textwrap.indent(dumped, "      ") + "\n")
    return "".join(out).rstrip("\n") + "\n"
