"""The small files through which the launcher, the health loop and the instances tell each
other things in the state dir (the health report has its own module, ``health_report``).

- **Drain requests** (launcher → loop): ``run/NAME.restart`` holds a :class:`DrainAction`.
  The loop takes the instance out of rotation, waits until its requests are done, then
  acts; it answers by removing the file, only after ``health.json`` records the drain
  (so a launcher that sees the file gone can read the outcome there).
- **A surge roll-out under way** (launcher → loop): ``run/rollout.json``, its surge and the
  launcher's pid (a marker whose launcher is gone is removed).
- **Drained by hand** (launcher or panel → loop): ``run/NAME.drained`` keeps the instance
  out of rotation, its process running, until the file goes.
- **Starts** (instance → both): each instance appends a line to ``run/NAME.starts`` at
  every start; restarts and crash loops are counted from it.

Every file is written atomically; a reader never sees half of one.
"""

from __future__ import annotations

import enum
import json
import os
import time

from cosyvoice_lb.common import pids
from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.launcher.state.layout import Layout


class DrainAction(str, enum.Enum):
    """What the loop does once a drained instance's requests are done."""

    TERM = "TERM"  # it drains itself too, exits, and supervisord starts it again
    KILL = "KILL"  # hung: nothing of it is still making progress; supervisord starts it again
    HOLD = "HOLD"  # nothing: the launcher replaces it (its config changed, or a surge roll-out)
    STOP = "STOP"  # stop it, and supervisord leaves it stopped (scaled in: its memory is freed)


# --- drain requests -------------------------------------------------------------------------


# The format of the files below; 0.1 wrote a drain request as the bare action (launcher.compat).
VERSION = 1


def ask_drain(layout: Layout, name: str, action: DrainAction) -> None:
    write_atomic(layout.drain_request(name), json.dumps({"version": VERSION, "action": action.value}) + "\n")


def drain_pending(layout: Layout, name: str) -> bool:
    """Asked, and not yet answered by the loop."""
    return layout.drain_request(name).exists()


def read_drain(layout: Layout, name: str) -> DrainAction | None:
    """The action asked for ``name`` (None: nothing asked). An unreadable or unknown one
    is a plain drained restart."""
    path = layout.drain_request(name)
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError:
        return DrainAction.TERM
    try:
        asked = json.loads(text)["action"] if text.startswith("{") else text  # (a bare word: 0.1's)
        return DrainAction(asked or "TERM")
    except (ValueError, KeyError, TypeError):
        return DrainAction.TERM


def answer_drain(layout: Layout, name: str) -> None:
    """The loop took the request (or there was nothing to do): the launcher stops waiting."""
    layout.drain_request(name).unlink(missing_ok=True)


def clear_drains(layout: Layout) -> None:
    for stale in layout.run.glob("*.restart"):
        stale.unlink(missing_ok=True)


# --- surge roll-outs ------------------------------------------------------------------------


def start_rollout(layout: Layout, surge: int) -> None:
    """A surge roll-out begins: ``surge`` more instances may serve until it ends (or the
    launcher process running it is gone)."""
    write_atomic(
        layout.rollout,
        json.dumps({"version": VERSION, "surge": surge, "since": time.time(), "pid": os.getpid()}) + "\n",
    )


def rollout_surge(layout: Layout) -> int:
    """The surge of the roll-out under way (0: none). The marker of a launcher that is gone
    (killed, its terminal closed) is removed: it would hold scaling and keep spares serving."""
    try:
        marker = json.loads(layout.rollout.read_text())
        surge, pid = max(0, int(marker["surge"])), int(marker.get("pid", 0))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0
    if pid and not pids.alive(pid):
        end_rollout(layout)
        return 0
    return surge


def end_rollout(layout: Layout) -> None:
    layout.rollout.unlink(missing_ok=True)


# --- drained by hand -----------------------------------------------------------------------


def drain_by_hand(layout: Layout, name: str) -> None:
    """Out of rotation until :func:`undrain`: requests in flight finish, the process stays
    (to look at it, or to keep it warm). The health loop honours it at its next step."""
    write_atomic(layout.drained(name), json.dumps({"version": VERSION, "since": round(time.time(), 3)}) + "\n")


def undrain(layout: Layout, name: str) -> bool:
    """Back in rotation at the health loop's next good probes; False when it was not drained."""
    try:
        layout.drained(name).unlink()
    except FileNotFoundError:
        return False
    return True


def drained_by_hand(layout: Layout, name: str) -> bool:
    return layout.drained(name).exists()


def clear_drained(layout: Layout, name: str | None = None) -> None:
    paths = [layout.drained(name)] if name else list(layout.run.glob("*.drained"))
    for path in paths:
        path.unlink(missing_ok=True)


# --- starts -------------------------------------------------------------------------------


def starts_count(layout: Layout, name: str) -> int:
    try:
        return sum(1 for line in layout.starts(name).read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def clear_starts(layout: Layout, name: str | None = None) -> None:
    """Restarts are counted from here on (one instance, or all)."""
    paths = [layout.starts(name)] if name else list(layout.run.glob("*.starts"))
    for path in paths:
        path.unlink(missing_ok=True)
