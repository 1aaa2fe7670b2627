"""Jobs that yield (cosyvoice_lb/jobs/yielding.py): the jobs' share of segments out falls to its
floor the moment an interactive request comes and grows back while none does; what the
instances' admissions count, published on a real routing board and read by the jobs side; and
the runner sending no more than the share while every segment is still made exactly once, its
rounds reading a scripted board and waiting through a scripted sleep; an instance that a
segment alone holds sends an interactive request on to a free peer. The rule runs on a
scripted clock: nothing here sleeps for it."""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import soundfile

from cosyvoice_lb.instance.routing.board import Board
from cosyvoice_lb.instance.speech.admission import Admission
from cosyvoice_lb.jobs import model
from cosyvoice_lb.jobs.results import Results
from cosyvoice_lb.jobs.runner import IDLE, POLL, Runner, segments_of
from cosyvoice_lb.jobs.sqlite_store import SqliteStore
from cosyvoice_lb.jobs.yielding import QUIET, STEP, BoardDemand, Demand, Share, Yielding, share_for

SEGMENT_CHARS = 40
OWNER = "shared"


def text_of(count: int) -> str:
    """``count`` sentences: one segment each at SEGMENT_CHARS."""
    return " ".join(f"This is sentence {i} of the text." for i in range(1, count + 1))


def wav(seconds: float = 0.05) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, np.full(int(24000 * seconds), 0.1, dtype=np.float32), 24000, format="WAV")
    return out.getvalue()


def quiet(taken: int = 5) -> Demand:
    return Demand(taken, 0)


def test_the_share_falls_to_its_floor_the_moment_an_interactive_request_comes():
    share = Share(floor=1, ceiling=4, fallback=3)
    share.limit = 4
    assert share.update(0.0, quiet()) == 4  # (the first look: the count it starts from is no arrival)
    assert share.update(0.01, quiet(6)) == 1  # one came since the last look
    assert share.yields == 1
    assert share.update(0.02, Demand(6, asking=1)) == 1  # one in flight, none new: still the floor
    assert share.yields == 1  # (already there: no second yield)


def test_it_grows_back_doubling_only_after_a_quiet_spell():
    share = Share(floor=1, ceiling=8, fallback=6)
    share.update(0.0, quiet(1))
    assert share.update(0.1, quiet(2)) == 1  # a request came at 0.1
    for now in (0.2, 0.5, 0.1 + QUIET - 0.01):
        assert share.update(now, quiet(2)) == 1  # not quiet long enough
    grown = [share.update(0.1 + QUIET + i * STEP, quiet(2)) for i in range(5)]
    assert grown == [2, 4, 8, 8, 8]
    assert share.update(0.1 + QUIET + 5 * STEP + 0.01, quiet(2)) == 8
    # quiet since ever: it grows from the first look, a whole step between two doublings
    other = Share(floor=2, ceiling=8, fallback=6)
    assert other.update(0.0, quiet()) == 4
    assert other.update(STEP / 2, quiet()) == 4
    assert other.update(STEP, quiet()) == 8


def test_a_request_in_flight_keeps_the_share_down_however_long_it_runs():
    share = Share(floor=1, ceiling=4, fallback=3)
    share.update(0.0, quiet())
    for now in range(1, 30):  # a streaming session of half a minute
        assert share.update(float(now), Demand(5, asking=1)) == 1
    assert share.update(30.0 + QUIET, quiet()) == 2  # it ended: quiet since its last sighting


def test_a_restarted_instance_resetting_its_count_is_read_as_a_change():
    share = Share(floor=1, ceiling=4, fallback=3)
    share.limit = 4
    share.update(0.0, quiet(100))
    assert share.update(0.1, quiet(3)) == 1  # (a lower sum: the safe side is to yield)


def test_without_a_board_the_share_is_the_fixed_fallback():
    share = Share(floor=1, ceiling=4, fallback=3)
    assert share.update(0.0, None) == 3
    assert share.update(0.1, quiet()) == 4  # the board appeared: its first count is no arrival
    assert share.update(0.2, quiet(6)) == 1
    assert share.update(0.3, None) == 3


def test_the_auto_share_of_a_cluster_and_what_it_refuses():
    assert (lambda s: (s.floor, s.ceiling, s.fallback))(share_for(4, 1)) == (1, 4, 3)
    assert (lambda s: (s.floor, s.ceiling, s.fallback))(share_for(16, 4)) == (4, 16, 12)
    assert (lambda s: (s.floor, s.ceiling, s.fallback))(share_for(1, 1)) == (1, 1, 1)
    assert share_for(0, 1).ceiling == 1
    with pytest.raises(ValueError, match="floor"):
        Share(floor=0, ceiling=4, fallback=3)
    with pytest.raises(ValueError, match="floor"):
        Share(floor=5, ceiling=4, fallback=3)
    with pytest.raises(ValueError, match="seconds"):
        Share(floor=1, ceiling=4, fallback=3, quiet=-1)


def test_admission_counts_interactive_requests_and_leaves_background_work_out():
    admission = Admission(concurrency=2)
    admission.become_ready()
    warm = admission.load()
    background = admission.admit(background=True)
    assert (admission.load().interactive, admission.load().asking) == (warm.interactive, 0)
    first = admission.admit()
    assert (admission.load().interactive, admission.load().asking) == (warm.interactive + 1, 1)
    waiter = threading.Thread(target=lambda: admission.admit().release(True))
    waiter.start()
    for _ in range(400):  # (queued: counted while it waits)
        if admission.snapshot().waiting:
            break
        time.sleep(0.005)
    assert (admission.load().interactive, admission.load().asking) == (warm.interactive + 2, 2)
    first.release(True)
    waiter.join(5)
    background.release(True)
    assert (admission.load().interactive, admission.load().asking) == (warm.interactive + 2, 0)
    session = admission.lease()  # a streaming session is interactive too, for as long as it lasts
    assert (admission.load().interactive, admission.load().asking) == (warm.interactive + 3, 1)
    session.release(True)
    assert admission.load().asking == 0


def test_the_board_carries_each_instance_s_interactive_requests_to_the_jobs_side(tmp_path):
    path = tmp_path / "routing.board"
    board = Board.create(path)
    demand = BoardDemand(path)
    assert demand() == Demand(0, 0)
    admission = Admission(concurrency=1)
    admission.become_ready()
    ticket = admission.admit()
    board.publish(0, os.getpid(), True, admission.load(), 0.004)
    gone = 2**22 + 12345  # (a pid that runs no process: its requests in flight count no more)
    board.publish(1, gone, True, admission.load(), 0.004)
    assert demand() == Demand(2, 1)
    ticket.release(True)
    board.publish(0, os.getpid(), True, admission.load(), 0.004)
    assert demand() == Demand(2, 0)
    assert Board.open(path).row(0)[1].interactive == 1  # type: ignore[union-attr]
    assert BoardDemand(tmp_path / "none")() is None


class Out:
    """The runner's ``send``: holds every segment until released, and records which were out."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: list[str] = []
        self.out = 0
        self.go = threading.Semaphore(0)

    def __call__(self, params: dict, text: str, seed: int | None) -> bytes:
        with self.lock:
            self.sent.append(text)
            self.out += 1
        self.go.acquire(timeout=10)
        with self.lock:
            self.out -= 1
        return wav()


def test_the_runner_sends_no_more_than_the_share_and_makes_every_segment_once(tmp_path):
    clock = {"now": 0.0}
    board = {"demand": Demand(0, 0)}
    share = Share(floor=1, ceiling=4, fallback=3)
    send = Out()
    text = text_of(12)
    with SqliteStore(tmp_path / "jobs.sqlite3") as store:
        total = len(segments_of(text, SEGMENT_CHARS))
        job = model.new_job(OWNER, text, total, time.time(), params={"response_format": "wav", "seed": 7})
        store.create(job, text)
        runner = Runner(
            store,
            send,
            Results(tmp_path / "results"),
            worker="box:1",
            slots=4,
            segment_chars=SEGMENT_CHARS,
            share=Yielding(share, lambda: board["demand"], lambda: clock["now"]),
        )
        try:
            runner.step()
            assert (runner.allowed, runner.out) == (2, 2)  # no request ever: it grows from the floor
            clock["now"] += STEP
            runner.step()
            assert (runner.allowed, runner.out) == (4, 4)  # every slot
            board["demand"] = Demand(1, 1)  # an interactive request comes
            runner.step()
            assert (runner.allowed, runner.out) == (1, 4)  # none called back, none sent
            for _ in range(3):
                send.go.release()
            wait_until(lambda: send.out == 1)
            for _ in range(3):
                runner.step()
                runner.wait(0.05)
            assert runner.out == 1 and len(send.sent) == 4  # the three back, not replaced
            board["demand"] = Demand(1, 0)
            clock["now"] += QUIET
            deadline = time.monotonic() + 10
            while store.get(job.id, OWNER).status != model.SUCCEEDED:  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "the job did not finish"
                clock["now"] += STEP
                runner.step()
                send.go.release()
                runner.wait(0.01)
        finally:
            runner.close(drain=0)
        done = store.get(job.id, OWNER)
        assert done is not None and (done.segments_done, done.segments_total) == (total, total)
        assert sorted(send.sent) == sorted(segments_of(text, SEGMENT_CHARS))  # each exactly once


def wait_until(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_an_instance_that_background_work_alone_holds_declines_for_any_sooner_peer(tmp_path):
    from cosyvoice_lb.instance.routing.router import Router
    from cosyvoice_lb.instance.routing.rule import Backlog, Rate

    board = Board.create(tmp_path / "routing.board")
    board.configure(True, 0.05)
    board.set_rotation([0, 1])
    now = 100.0
    # slot 0: its one slot held by a segment that ends in 0.03 s, within the slack; slot 1 is free
    own = [Backlog(now + 0.03, True, interactive=0, asking=0)]
    router = Router(0, os.getpid(), lambda: own[0], lambda: True, Rate(), lambda: now, lambda: board)
    Router(1, os.getpid(), lambda: Backlog(now, False), lambda: True, Rate(), lambda: now, lambda: board).publish()
    decision = router.check("request-1", last=False)
    assert decision.decline and decision.better == 1  # (no interactive request waits behind a segment)
    own[0] = Backlog(now + 0.03, True, interactive=1, asking=1)  # an interactive request holds it: the slack holds
    assert not router.check("request-2", last=False).decline
    own[0] = Backlog(now + 0.03, True, interactive=0, asking=0)
    assert not router.check("request-3", last=True).decline  # (nginx's last resort: always taken)


class Rounds:
    """The runner's collaborators for :meth:`Runner.run`: a scripted board reader (counted),
    a scripted monotonic clock, and a sleep that records and stops the runner when told."""

    def __init__(self, stop: threading.Event, demand: Demand | None = None) -> None:
        self.stop, self.demand = stop, demand or Demand(0, 0)
        self.reads = 0
        self.slept: list[float] = []
        self.now = 0.0
        self.until: Callable[[], bool] = lambda: len(self.slept) >= 3

    def read_board(self) -> Demand | None:
        self.reads += 1
        return self.demand

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        if self.until() or len(self.slept) > 10_000:
            self.stop.set()


def test_an_idle_runner_reads_the_board_once_a_round_and_waits_through_its_sleep(tmp_path):
    stop = threading.Event()
    rounds = Rounds(stop)
    with SqliteStore(tmp_path / "jobs.sqlite3") as store:
        runner = Runner(
            store,
            lambda params, text, seed: pytest.fail("nothing to send"),
            Results(tmp_path / "results"),
            worker="box:1",
            slots=4,
            segment_chars=SEGMENT_CHARS,
            sleep=rounds.sleep,
            monotonic=rounds.clock,
            share=Yielding(Share(floor=1, ceiling=4, fallback=3), rounds.read_board, rounds.clock),
        )
        started = time.monotonic()
        runner.run(stop)
        assert time.monotonic() - started < IDLE  # (the sleeps were the fake's)
    assert rounds.slept == [IDLE] * 3 and rounds.reads == 3
    assert runner.closed and runner.allowed == 4  # quiet for a second and a half: every slot


def test_a_job_under_yield_is_made_with_the_fake_board_and_no_real_sleep(tmp_path):
    stop = threading.Event()
    rounds = Rounds(stop, demand=Demand(3, 1))  # an interactive request in flight all along
    text = text_of(3)
    sends: list[int] = []

    def send(params, text, seed) -> bytes:
        sends.append(rounds.reads)
        return wav()

    with SqliteStore(tmp_path / "jobs.sqlite3") as store:
        total = len(segments_of(text, SEGMENT_CHARS))
        job = model.new_job(OWNER, text, total, time.time(), params={"response_format": "wav", "seed": 7})
        store.create(job, text)
        rounds.until = lambda: store.get(job.id, OWNER).status == model.SUCCEEDED  # type: ignore[union-attr]
        runner = Runner(
            store,
            send,
            Results(tmp_path / "results"),
            worker="box:1",
            slots=4,
            segment_chars=SEGMENT_CHARS,
            sleep=rounds.sleep,
            monotonic=rounds.clock,
            share=Yielding(Share(floor=1, ceiling=4, fallback=3), rounds.read_board, rounds.clock),
        )
        runner.run(stop)
        done = store.get(job.id, OWNER)
    assert done is not None and done.status == model.SUCCEEDED and done.segments_done == total
    assert len(sends) == total and sends == sorted(set(sends))  # one segment out at a time: a round each
    assert set(rounds.slept) <= {POLL, IDLE} and len(rounds.slept) < 10_000
