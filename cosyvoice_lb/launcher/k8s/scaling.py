"""KEDA's ScaledObject, which `k8s render --schedule` writes instead of the HPA: the pods'
count follows the schedule's floor (cron triggers) and, above it, the requests waiting per
pod (a prometheus trigger) and CPU, as the HPA does.

How an entry becomes KEDA's cron triggers. KEDA's cron trigger holds ``desiredReplicas``
between ``start`` and ``end``; it counts as active while the next ``end`` comes before the
next ``start``, so every start must be followed by exactly one end before the next start.
``CRON=N`` entries give a floor that steps at each entry's time: N of the entry that fired
last. That step function is laid out over one week (minute by minute, in ``--timezone``),
consecutive firings with the same N are merged into one window, and each window runs from
its entry's time to the time the next entry with another N fires. Windows alike (same N,
same start and end time of day) share one trigger, whose start and end list their days of
the week. ``0 9 * * 1-5=3`` and ``0 22 * * *=1`` become two triggers: 3 from 9:00 to 22:00
Monday to Friday, 1 from 22:00 Monday to Friday to 9:00 the next weekday (the weekend
included: Saturday's and Sunday's 22:00 change nothing). Hence entries must repeat weekly:
day of month and month ``*``.

Pure: the object is a dict dumped to YAML by :mod:`cosyvoice_lb.launcher.k8s.manifests`.
"""

from __future__ import annotations

import zoneinfo
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cosyvoice_lb.common.schedule import Cron, Entry
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.k8s.objects import Deployment, autoscaler, labels

DEFAULT_PROMETHEUS = Deployment().prometheus_url  # Prometheus Operator's Service, in monitoring
QUEUE_METRIC = "cosyvoice_lb_instance_queue_depth"  # requests waiting for an engine (each pod's /metrics)
DAY = 24 * 60
WEEK = 7 * DAY
MAX_CRON_TRIGGERS = 64  # past this the schedule changes too often to be windows
HEADER_WINDOWS = 21  # the windows scaledobject.yaml's comment lists (three a day)


@dataclass(frozen=True)
class Window:
    """From ``start`` to ``end`` (minutes of the week, Sunday 00:00 is 0; an end below its
    start wraps past Saturday night), at least ``count`` pods."""

    start: int
    end: int
    count: int


def _week_days(cron: Cron) -> frozenset[int]:
    """The days of the week (Sunday 0) a weekly cron time fires on (cron's rule for two day
    fields: with neither starting with *, either one matching counts, and every day of the
    month is allowed)."""
    return cron.weekdays if cron.days_star or cron.weekdays_star else frozenset(range(7))


def firings(entries: Sequence[Entry]) -> dict[int, int]:
    """{minute of the week: N} of every entry's firing; of entries firing in the same minute,
    the one given last (as on a box)."""
    found: dict[int, int] = {}
    for entry in entries:
        cron = entry.cron
        if not cron.weekly:
            raise ClusterError(
                f"--schedule {entry.text!r}: KEDA's cron windows are rendered from a weekly schedule, so on "
                "Kubernetes the day of month and the month must be * (restrict the days with day of week)"
            )
        for day in _week_days(cron):
            for hour in cron.hours:
                for minute in cron.minutes:
                    found[day * DAY + hour * 60 + minute] = entry.count
    return found


def windows(entries: Sequence[Entry]) -> list[Window]:
    """The schedule's floor over a week, as windows of one N each (see the module's doc).
    A floor that never changes is split in two half-week windows (KEDA refuses a start equal
    to its end)."""
    fired = sorted(firings(entries).items())
    if not fired:
        return []
    changes = [(at, count) for i, (at, count) in enumerate(fired) if count != fired[i - 1][1]]
    if not changes:
        at, count = fired[0]
        half = (at + WEEK // 2) % WEEK
        return [Window(at, half, count), Window(half, at, count)]
    return [Window(at, changes[(i + 1) % len(changes)][0], count) for i, (at, count) in enumerate(changes)]


def _days(days: Sequence[int]) -> str:
    """Days of the week as cron writes them: ``*``, ``1-5``, ``0,6``."""
    days = sorted(set(days))
    if len(days) == 7:
        return "*"
    runs: list[list[int]] = []
    for day in days:
        if runs and day == runs[-1][-1] + 1:
            runs[-1].append(day)
        else:
            runs.append([day])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)


def _cron(minute_of_day: int, days: Sequence[int]) -> str:
    return f"{minute_of_day % 60} {minute_of_day // 60} * * {_days(days)}"


def cron_triggers(entries: Sequence[Entry], timezone: str) -> list[dict[str, Any]]:
    """KEDA's cron triggers for the schedule: one per set of alike windows."""
    groups: dict[tuple[int, int, int], tuple[list[int], list[int]]] = {}
    for window in windows(entries):
        starts, ends = groups.setdefault((window.count, window.start % DAY, window.end % DAY), ([], []))
        starts.append(window.start // DAY)
        ends.append(window.end // DAY)
    if len(groups) > MAX_CRON_TRIGGERS:
        raise ClusterError(
            f"--schedule changes the floor too often for KEDA's cron windows ({len(groups)} triggers, at most "
            f"{MAX_CRON_TRIGGERS}): use fewer entries, or entries with one minute and hour each"
        )
    return [
        {
            "type": "cron",
            "metadata": {
                "timezone": timezone,
                "start": _cron(start, starts),
                "end": _cron(end, ends),
                "desiredReplicas": str(count),
            },
        }
        for (count, start, end), (starts, ends) in groups.items()
    ]


def queue_query(deployment: Deployment) -> str:
    """PromQL: the requests waiting for an engine in every pod of the deployment (the
    ServiceMonitor labels each pod's series with its namespace and Service)."""
    return f'sum({QUEUE_METRIC}{{namespace="{deployment.namespace}",service="{deployment.name}"}})'


def scaling_problem(deployment: Deployment) -> str:
    """What is wrong with --timezone or --prometheus-url ("" when nothing)."""
    if not deployment.prometheus_url.startswith(("http://", "https://")):
        return f"--prometheus-url {deployment.prometheus_url!r} is not an http(s) URL, e.g. {DEFAULT_PROMETHEUS}"
    try:
        zoneinfo.ZoneInfo(deployment.timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        if zoneinfo.available_timezones():  # (without a time zone database here, KEDA's is the judge)
            return f"--timezone {deployment.timezone!r} is not an IANA time zone: write e.g. UTC or Europe/Berlin"
    return ""


def scaled_object(deployment: Deployment, entries: Sequence[Entry]) -> dict[str, Any]:
    """KEDA's ScaledObject on the Deployment: --replicas to --max-replicas pods; the schedule's
    floor (:func:`cron_triggers`), the requests waiting per pod (--target-queue: KEDA divides
    the deployment's sum by it) and CPU; the HPA's behaviour (up fast, down slowly)."""
    problem = scaling_problem(deployment)
    if problem:
        raise ClusterError(problem)
    hpa = autoscaler(deployment)["spec"]  # (the HPA it replaces: the same behaviour and targets)
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": deployment.name, "namespace": deployment.namespace, "labels": labels(deployment)},
        "spec": {
            "scaleTargetRef": hpa["scaleTargetRef"],
            "minReplicaCount": deployment.replicas,
            "maxReplicaCount": deployment.max_replicas,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": hpa["behavior"]}},
            "triggers": [
                *cron_triggers(entries, deployment.timezone),
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": deployment.prometheus_url,
                        "query": queue_query(deployment),
                        "threshold": str(deployment.target_queue),
                    },
                },
                {"type": "cpu", "metricType": "Utilization", "metadata": {"value": str(deployment.target_cpu)}},
            ],
        },
    }


def header(entries: Sequence[Entry], deployment: Deployment) -> str:
    """scaledobject.yaml's comment: what each cron trigger is, in words."""
    lines = [
        "# KEDA (keda.sh) scales the pods instead of an HPA (it makes one of its own): --replicas to --max-replicas,",
        f"# at least the schedule's N ({deployment.timezone}), above it on the requests waiting per pod",
        f"# ({QUEUE_METRIC}, from {deployment.prometheus_url}) and CPU. The schedule's windows:",
    ]
    laid_out = windows(entries)
    for window in laid_out[:HEADER_WINDOWS]:
        lines.append(f"#   {_when(window.start)} to {_when(window.end)}: at least {window.count} pod(s)")
    if len(laid_out) > HEADER_WINDOWS:
        lines.append(f"#   ... and {len(laid_out) - HEADER_WINDOWS} more")
    return "\n".join(lines)


def _when(minute_of_week: int) -> str:
    name = ("Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat")[minute_of_week // DAY]
    minute = minute_of_week % DAY
    return f"{name} {minute // 60:02d}:{minute % 60:02d}"
