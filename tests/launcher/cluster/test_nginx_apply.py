"""Applying nginx's config (cosyvoice_lb/launcher/cluster/nginx_apply.py) against a scripted
supervisord, scripted nginx processes and error log (``Watch``), and a scripted clock and
sleep: every wait is asked of the fake sleep, which moves the clock on; nothing sleeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from cosyvoice_lb.launcher.cluster import nginx_apply
from cosyvoice_lb.launcher.cluster.listeners import wanted
from cosyvoice_lb.launcher.cluster.nginx_apply import POLL, RELOAD_WAIT, RESTART_WAIT, SETTLE, Watch, apply
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.state.supervision import ProcessInfo

LOG = Path("/nonexistent/nginx-error.log")
WANT = wanted("127.0.0.1", 8080)
OLD = wanted("127.0.0.1", 9090)


class Time:
    """A clock that only the sleep moves, and the sleeps asked for."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class Supervisord:
    """nginx under supervisord: ``pid`` 0 when it is not running; a start gives it ``next_pid``."""

    def __init__(self, pid: int = 50, next_pid: int = 60) -> None:
        self.pid, self.next_pid = pid, next_pid
        self.calls: list[tuple[str, ...]] = []

    def processes(self) -> dict[str, ProcessInfo]:
        state = "RUNNING" if self.pid else "STOPPED"
        return {"nginx": ProcessInfo("nginx", state, self.pid, 0.0, 1.0, "", 0)}

    def start(self, name: str, wait: bool = False) -> None:
        self.calls.append(("start", name))
        self.pid = self.next_pid

    def stop(self, name: str, wait: bool = True) -> None:
        self.calls.append(("stop", name))
        self.pid = 0

    def signal(self, name: str, signal: str) -> None:
        self.calls.append(("signal", name, signal))


def watch(t: Time, new_workers_at: float | None, listening=lambda master: WANT, errors=()) -> Watch:
    """New workers (a reload that took) from ``new_workers_at`` on (None: never)."""

    def workers(master: int) -> set[int]:
        return {2} if new_workers_at is not None and t.now >= new_workers_at else {1}

    return Watch(
        workers=workers,
        listening=listening,
        log_size=lambda log: 0,
        new_errors=lambda log, offset: list(errors),
        tail=lambda log, length: "one\ntwo\nbind() to 127.0.0.1:8080 failed (98: Address already in use)\n",
    )


def run(sup: Supervisord, t: Time, w: Watch, said: list[str] | None = None) -> str:
    say = said.append if said is not None else (lambda line: None)
    return apply(sup, LOG, "127.0.0.1", 8080, say, clock=t.clock, sleep=t.sleep, watch=w)


def test_a_reload_polls_through_the_sleep_until_new_workers_come():
    t, sup = Time(), Supervisord()
    assert run(sup, t, watch(t, new_workers_at=3 * POLL - 1e-9)) == "reloaded"
    assert t.slept == [POLL] * 3
    assert sup.calls == [("signal", "nginx", "HUP")]


def test_an_emerg_line_in_the_log_ends_the_wait_at_once():
    t, sup = Time(), Supervisord()
    line = "2026/01/01 [emerg] 1#1: unknown directive"
    with pytest.raises(ClusterError, match="unknown directive"):
        run(sup, t, watch(t, new_workers_at=None, errors=[line]))
    assert t.slept == []


def test_a_reload_that_never_takes_waits_its_bound_then_says_so():
    t, sup = Time(), Supervisord()
    with pytest.raises(ClusterError, match="no new worker within 10s"):
        run(sup, t, watch(t, new_workers_at=None))
    assert set(t.slept) == {POLL} and RELOAD_WAIT <= sum(t.slept) < RELOAD_WAIT + 2 * POLL


def test_a_busy_bind_is_waited_on_until_nginx_gives_up():
    t, sup = Time(), Supervisord()
    busy = ["[emerg] bind() to 127.0.0.1:8080 failed (98: Address already in use)"]
    with pytest.raises(ClusterError, match="Address already in use"):
        run(sup, t, watch(t, new_workers_at=None, errors=busy))
    assert RELOAD_WAIT <= sum(t.slept) < RELOAD_WAIT + 2 * POLL  # (retried: its last word may still come)


def test_a_listener_a_reload_cannot_move_is_restarted_after_the_settle_wait():
    t, sup, said = Time(), Supervisord(pid=50, next_pid=60), []
    moved = watch(t, new_workers_at=POLL / 2, listening=lambda master: OLD if master == 50 else WANT)
    assert run(sup, t, moved, said) == "restarted"
    # one poll until the new workers, then the old ones' SETTLE: they never let go
    assert set(t.slept) == {POLL} and POLL + SETTLE <= sum(t.slept) < POLL + SETTLE + 2 * POLL
    assert sup.calls == [("signal", "nginx", "HUP"), ("stop", "nginx"), ("start", "nginx")]
    assert len(said) == 1 and "restarting it" in said[0]


def test_nginx_not_running_is_started_and_waited_for():
    t, sup = Time(), Supervisord(pid=0, next_pid=60)
    listens_late = watch(t, new_workers_at=None, listening=lambda master: WANT if t.now >= 2 * POLL - 1e-9 else set())
    assert run(sup, t, listens_late) == "started"
    assert sup.calls == [("start", "nginx")] and t.slept == [POLL, POLL]


def test_a_restarted_nginx_that_never_listens_fails_with_its_log():
    t, sup = Time(), Supervisord(pid=60)
    with pytest.raises(ClusterError, match="Address already in use"):
        nginx_apply.wait_listening(
            sup, LOG, WANT, t.clock, t.sleep, watch(t, new_workers_at=None, listening=lambda m: OLD)
        )
    assert RESTART_WAIT <= sum(t.slept) < RESTART_WAIT + 2 * POLL
