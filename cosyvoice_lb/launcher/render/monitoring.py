"""Monitoring files of a cluster: Prometheus scrape config, its targets, alerts, a dashboard.

Only assembles: :mod:`~cosyvoice_lb.launcher.render.prometheus` renders ``prometheus.yml``,
``targets.json`` and ``alerts.yml``, :mod:`~cosyvoice_lb.launcher.render.grafana` the
dashboard. Pure, like ``render``: the launcher writes :func:`monitoring_files` into the state
dir's ``monitoring/`` folder at every render.
"""

from __future__ import annotations

from collections.abc import Iterable

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.plan.planner import Slot
from cosyvoice_lb.launcher.render.alertmanager import alertmanager_config
from cosyvoice_lb.launcher.render.grafana import grafana_dashboard
from cosyvoice_lb.launcher.render.prometheus import alert_rules, prometheus_config, scrape_targets
from cosyvoice_lb.launcher.state.layout import Layout


def monitoring_files(settings: Settings, layout: Layout, slots: Iterable[Slot]) -> dict[str, str]:
    """The monitoring files, keyed by their path relative to the state dir (as ``render``
    keys its files), and with --alertmanager its config. Not the scrape token: a secret,
    written with 0600 elsewhere."""
    return {
        layout.relative(layout.prometheus_yml): prometheus_config(settings, layout),
        layout.relative(layout.scrape_targets): scrape_targets(slots),
        layout.relative(layout.alert_rules): alert_rules(settings),
        layout.relative(layout.grafana_dashboard): grafana_dashboard(),
        **({layout.relative(layout.alertmanager_yml): alertmanager_config(settings)} if settings.alertmanager else {}),
    }
