"""Model roll-outs that compare first: ``cosyvoice-lb canary start|status|promote|abort``.

* **start**: the new settings (``--model-dir``, ``--engine``, ``--python``, ``--set``) run on
  parked slots (planned like any instance: where memory has room now, as for a surge), out of
  the serving rotation. nginx mirrors a share of the live synthesis requests to them (the
  client's answer comes from the serving instances; the copy's is checked and dropped), or
  gives them that share for real (what they fail is retried on the serving instances).
* **status**: both sides over the same requests (``compare``), read from each instance.
* **promote**: refused unless the verdict passes (or ``--force``); the canary goes, then every
  instance is replaced by one on the new settings with a surge roll-out (``up`` with them:
  replacements on parked slots serve before the old ones are drained), and the cluster keeps
  the new settings.
* **abort**: the canary's processes stop, its nginx lines go, its slots are parked again.

The orchestration reuses ``up`` (render, supervisord, nginx, the health loop's restart), in
the order that keeps a canary out of the serving pools: ``canary.json`` is written before
its slots run, and removed only after they stopped.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.canary.compare import Comparison, Side, compare
from cosyvoice_lb.launcher.cluster.context import Cluster, Progress, Report, Say
from cosyvoice_lb.launcher.cluster.disk import recorded
from cosyvoice_lb.launcher.cluster.lifecycle import regroup, up
from cosyvoice_lb.launcher.cluster.rollout import Slots, surge_room
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.health.probe import loopback_session
from cosyvoice_lb.launcher.plan.planner import Slot
from cosyvoice_lb.launcher.state import canary as state
from cosyvoice_lb.launcher.state.canary import Canary, CanaryError, Thresholds
from cosyvoice_lb.launcher.state.health_report import read_report
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.supervision import DOWN

Fetch = Callable[[int], dict]


def _cluster(layout: Layout, on_progress: Report) -> tuple[Cluster, tuple[Slot, ...]]:
    found = recorded(layout)
    c = Cluster.of(layout, found[0] if found else Settings(), on_progress)
    if found is None or not c.supervisor.running():
        raise ClusterError(f"no cluster runs in {layout.root}: start it with 'cosyvoice-lb up'")
    return c, found[1]


def _in_progress(layout: Layout) -> Canary:
    found = state.read(layout)
    if found is None:
        raise ClusterError("no canary in progress: 'cosyvoice-lb canary start --model-dir NEW' starts one")
    return found


# --- start ----------------------------------------------------------------------------------


def start(
    layout: Layout,
    changes: dict[str, Any],
    mode: str = "mirror",
    percent: float = 10.0,
    instances: int = 1,
    thresholds: Thresholds | None = None,
    on_progress: Report = lambda p: None,
    say: Say = lambda line: None,
) -> Canary:
    """Start ``instances`` canaries on parked slots with ``changes``; returns the canary once
    each is ready and in its pool. One that cannot start is stopped again (nothing is left)."""
    c, slots = _cluster(layout, on_progress)
    if state.read(layout) is not None:
        raise ClusterError(f"a canary is in progress ({_in_progress(layout).describe()}): promote or abort it first")
    if mode not in state.MODES or not 0 < percent <= 100:
        raise CanaryError(f"traffic: --mirror or --share with a percentage above 0 and at most 100, got {percent:g}")
    if mode == "share" and percent > 50:
        raise CanaryError(
            f"--share {percent:g}: at most 50 (as many requests again are the serving side's half of the comparison)"
        )
    changes = state.checked_changes(c.settings, changes)
    c, free = _room(c, slots, instances, say)
    canary = Canary(
        slots=tuple(s.name for s in free),
        changes=changes,
        mode=mode,
        percent=percent,
        started=time.time(),
        thresholds=thresholds or Thresholds(),
    )
    state.write(layout, canary)  # (first: from here on the canary slots stay out of the serving pools)
    try:
        on_progress(Progress(0, instances, f"rendering the canary on {', '.join(canary.slots)}"))
        up(c.settings, on_progress, say)  # its programs, nginx's mirror or share, the loop restarted
        for name in canary.slots:
            on_progress(Progress(0, instances, f"starting {name} (canary: {canary.describe()})"))
            regroup(c, name)  # (supervisord takes the slot's canary program: no roll-out does, it is no Slots')
            c.supervisor.start(name)
        _wait_ready(c, canary, {s.name: s.port for s in free})
    except BaseException as exc:
        said = str(exc) if isinstance(exc, ClusterError) else f"{type(exc).__name__}: {exc}"
        _remove(c, canary, on_progress, say)
        raise ClusterError(f"the canary did not start, and was removed:\n{said}") from None
    return canary


def _room(c: Cluster, slots: tuple[Slot, ...], instances: int, say: Say) -> tuple[Cluster, list[Slot]]:
    """Parked slots with memory for ``instances`` canaries now; fewer parked slots than that
    are planned first, as ``--surge`` plans them (the cluster keeps it, said). Returns the
    cluster under the settings it has then (what the canary's own render must keep)."""
    now = Slots.read(c.layout, c.supervisor, slots)
    if len(now.parked) < instances and c.settings.surge < instances:
        say(f"planning --surge {instances} for the canary's slot(s) (the cluster keeps it)")
        up(dataclasses.replace(c.settings, surge=instances), c.progress, say)
        found = recorded(c.layout)
        c = c.with_settings(found[0]) if found else c
        now = Slots.read(c.layout, c.supervisor, found[1] if found else slots)
    free = surge_room(c, now, instances, [])
    if len(free) < instances:
        raise ClusterError(
            f"no room for {instances} canary instance(s): {len(free)} parked slot(s) with memory now "
            f"({len(now.parked)} parked). Free memory, or plan more with 'cosyvoice-lb up --surge N'"
        )
    return c, free


def _wait_ready(c: Cluster, canary: Canary, ports: dict[str, int]) -> None:
    """Until each canary is ready and in its pool (the health loop's report), or has failed."""

    def ready() -> bool:
        tracks, procs = read_report(c.layout), c.supervisor.processes()
        for name in canary.slots:
            proc = procs.get(name)
            if proc is None or proc.state in DOWN:
                raise ClusterError(
                    f"{name} (canary) stopped: {proc.state if proc else 'missing'}\n{c.supervisor.tail(name, 1500)}"
                )
            if not tracks.track(name).in_rotation:
                return False
        return True

    if not c.wait_until(ready, c.timeouts.serving, poll=0.25):
        names = ", ".join(f"{n} (port {ports.get(n)})" for n in canary.slots)
        tail = "\n".join(c.supervisor.tail(n, 1500) for n in canary.slots)
        raise ClusterError(f"{names} not ready within {c.timeouts.serving:.0f}s; its log:\n{tail}")


# --- abort, promote ---------------------------------------------------------------------------


def _remove(c: Cluster, canary: Canary, on_progress: Report, say: Say) -> None:
    """Stop the canary's processes (a stop drains what they were doing), then forget it and
    render the cluster without it: its slots parked again, nginx's lines gone."""
    for name in canary.slots:
        on_progress(Progress(0, len(canary.slots), f"stopping {name} (canary)"))
        proc = c.supervisor.processes().get(name)
        if proc is not None and proc.state not in DOWN:
            c.supervisor.stop(name)
    state.remove(c.layout)
    up(c.settings, on_progress, say)


def abort(layout: Layout, on_progress: Report = lambda p: None, say: Say = lambda line: None) -> Canary:
    c, _ = _cluster(layout, on_progress)
    canary = _in_progress(layout)
    _remove(c, canary, on_progress, say)
    return canary


def promote(
    layout: Layout,
    force: bool = False,
    on_progress: Report = lambda p: None,
    say: Say = lambda line: None,
    fetch: Fetch | None = None,
) -> tuple[Canary, Comparison]:
    """Every instance onto the canary's settings, with a surge roll-out; refused (a
    :class:`ClusterError` naming the figures that failed) unless the verdict passes or
    ``force``."""
    c, slots = _cluster(layout, on_progress)
    canary = _in_progress(layout)
    found = comparison(layout, fetch)
    if found.verdict != "pass" and not force:
        failed = "\n".join(f"  {f.name}: {f.said}" for f in found.failed)
        raise ClusterError(
            f"not promoted: the canary's verdict is {found.verdict}\n{failed}\n"
            "'cosyvoice-lb canary status' shows both sides; --force promotes anyway"
        )
    if found.verdict != "pass":
        say(f"promoting with --force over a verdict of {found.verdict}")
    _remove(c, canary, on_progress, say)
    target = dataclasses.replace(
        c.settings, **canary.changes, surge=max(c.settings.surge, len(canary.slots))
    )  # (the canary's slots are the surge's: a roll-out with capacity kept)
    up(target, on_progress, say)
    return canary, found


# --- the comparison ---------------------------------------------------------------------------


def cohort_of(port: int, timeout: float = 5.0, session: requests.Session | None = None) -> dict:
    """An instance's compared requests (its ``GET /cohort``); {} when it does not answer."""
    try:
        answer = (session or loopback_session(1)).get(f"http://127.0.0.1:{port}/cohort", timeout=timeout)
        return answer.json() if answer.status_code == 200 else {}
    except (requests.RequestException, ValueError):
        return {}


def comparison(layout: Layout, fetch: Fetch | None = None) -> Comparison:
    """Both sides since the canary started, from every running instance."""
    canary = _in_progress(layout)
    found = recorded(layout)
    slots = found[1] if found else ()
    session = loopback_session(len(slots))  # (no proxy from the environment: loopback only)
    ask = fetch or (lambda port: cohort_of(port, session=session))
    with ThreadPoolExecutor(max_workers=max(1, len(slots))) as pool:
        answers = list(pool.map(lambda s: ask(s.port), slots))
    sides: dict[str, list[dict]] = {"serving": [], "canary": []}
    for slot, answer in zip(slots, answers):
        role = "canary" if slot.name in canary.slots else "serving"
        if answer.get("role") == role:  # (an instance of the other side, or an old one: not counted)
            sides[role] += [s for s in answer.get("samples", []) if isinstance(s, dict)]
    return compare(
        Side.of(sides["serving"], canary.started), Side.of(sides["canary"], canary.started), canary.thresholds
    )
