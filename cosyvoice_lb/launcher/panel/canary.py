"""The control panel's model roll-out: the comparison of a canary in progress, and its
promote and abort buttons (the ``canary`` commands, run in a thread; one at a time).

The HTTP edge is ``server.py``; this module holds no routes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from cosyvoice_lb.launcher.canary import rollout
from cosyvoice_lb.launcher.canary.compare import rows
from cosyvoice_lb.launcher.cluster.context import Progress
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.panel.control import Action
from cosyvoice_lb.launcher.state import canary as state
from cosyvoice_lb.launcher.state.canary import CanaryError
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.supervision import SupervisionError

ACTIONS = ("promote", "abort")


class CanaryControl:
    """What the panel shows of a canary, and its two buttons. ``promote(layout, force, report)``
    and ``abort(layout, report)`` are the commands' own (tests pass others)."""

    def __init__(
        self,
        layout: Layout,
        promote: Callable[..., Any] = rollout.promote,
        abort: Callable[..., Any] = rollout.abort,
        compare: Callable[[Layout], Any] = rollout.comparison,
    ):
        self.layout, self._promote, self._abort, self._compare = layout, promote, abort, compare
        self.lock = threading.Lock()
        self.last: Action | None = None

    def view(self) -> dict[str, Any]:
        """The canary in progress (``rollout``; None when there is none), both sides
        (``serving``, ``canary``) with the findings and the verdict, and the last button pressed."""
        canary = state.read(self.layout)
        step = asdict(self.last) if self.last else None
        if canary is None:
            return {"rollout": None, "action": step}
        found = self._compare(self.layout)
        return {
            "rollout": {**canary.as_dict(), "summary": canary.describe()},
            "rows": [list(r) for r in rows(found)],
            **found.as_dict(),
            "action": step,
        }

    def start(self, action: str, force: bool = False) -> Action:
        """Press a button: ValueError for an unknown one or none to act on, RuntimeError
        while the last one still runs."""
        if action not in ACTIONS:
            raise ValueError(f"no canary action {action!r}: use promote or abort")
        if state.read(self.layout) is None:
            raise ValueError("no canary in progress: start one with 'cosyvoice-lb canary start --model-dir NEW'")
        with self.lock:
            if self.last is not None and self.last.state == "running":
                raise RuntimeError(f"the canary's {self.last.action} is still running ({self.last.detail})")
            current = self.last = Action("canary", action)
        threading.Thread(target=self._run, args=(current, force), name=f"canary-{action}", daemon=True).start()
        return current

    def _run(self, current: Action, force: bool) -> None:
        def report(step: Progress) -> None:
            current.detail = step.detail

        try:
            if current.action == "promote":
                self._promote(self.layout, force, report)
                detail = "promoted: every instance runs the canary's settings"
            else:
                self._abort(self.layout, report)
                detail = "aborted: the canary stopped, the serving instances unchanged"
        except (ClusterError, SupervisionError, CanaryError) as exc:
            current.state, current.detail = "failed", str(exc)
        except Exception as exc:  # (a button never takes the panel down; it says what happened)
            current.state, current.detail = "failed", f"{type(exc).__name__}: {exc}"
        else:
            current.state, current.detail = "done", detail
        current.ended = time.time()
