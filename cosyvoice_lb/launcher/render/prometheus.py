"""Prometheus files of a cluster: the scrape config, its targets and the alert rules.

Pure, like ``render``: every function returns text and writes nothing.

- ``targets.json``: Prometheus file service discovery, one target group per instance (its
  loopback /metrics). Rewritten at every render, so a Prometheus using it follows ``up``
  when the number of instances changes, without a reload.
- ``prometheus.yml``: a complete config (``prometheus --config.file=...`` runs it as it is),
  or two jobs to copy into an existing Prometheus: the instances, and the cluster's own
  metrics behind nginx, read with the scrape token (a secret: written elsewhere, not here).
- ``alerts.yml``: the alert rules ``prometheus.yml`` loads.

Every metric name the alerts use is one the instances and the control panel expose (the
metrics contract); the tests hold the two together.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.timeouts import Timeouts
from cosyvoice_lb.launcher.cluster.layout import Layout
from cosyvoice_lb.launcher.plan.planner import Slot
from cosyvoice_lb.launcher.render.addresses import balancer_url
from cosyvoice_lb.launcher.render.templates import template_environment


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
    (nginx's /metrics with the scrape token's file) and the alert rules, by absolute path."""
    return _from_template("prometheus.yml.j2", layout=layout, balancer=balancer_target(settings))


def alert_rules(settings: Settings | None = None) -> str:
    """alerts.yml: the cluster's alert rules (one group, ``cosyvoice-lb``). The health loop
    counts as stale after 30 s, or after what `status` allows when its probes are slower."""

    stale = max(30, math.ceil(Timeouts(settings or Settings()).health_stale))
    return _from_template("alerts.yml.j2", stale=stale)
