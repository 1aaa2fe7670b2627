"""Which instances serve: nginx's rotation holds as many as are wanted, and the other ready
ones wait beside it as warm spares.

Pure: the health loop passes in who could serve, who did, and how many are wanted (the
plan's number, the elastic target, plus a surge roll-out's extra ones).
"""

from __future__ import annotations

from collections.abc import Iterable

from cosyvoice_lb.launcher.state.supervision import ProgramState

# supervisord states in which a slot is taken: a process runs, or is being brought back
OCCUPIED = frozenset({ProgramState.RUNNING, ProgramState.STARTING, ProgramState.BACKOFF})


def is_parked(state: str, failed: bool) -> bool:
    """A slot stopped on purpose: never started, scaled in, or left by a roll-out (a slot
    given up on after a crash loop is stopped too, but failed, not parked)."""
    return state == ProgramState.STOPPED and not failed


def rotation(eligible: Iterable[str], before: Iterable[str], wanted: int) -> list[str]:
    """Of the instances that could serve (``eligible``, in slot order), the ones nginx gets:
    at most ``wanted``. Those in rotation ``before`` keep their places (a spare fills an
    empty one, never takes a serving one's); when fewer are wanted, the last ones go."""
    was = set(before)
    could = list(eligible)
    kept = [name for name in could if name in was]
    fresh = [name for name in could if name not in was]
    return (kept + fresh)[: max(0, wanted)]


def spares_of(eligible: Iterable[str], serving: Iterable[str]) -> list[str]:
    """The ready instances left out of rotation: the warm spares."""
    chosen = set(serving)
    return [name for name in eligible if name not in chosen]
