"""Poison requests: marks of running syntheses, deaths counted per request, refusals."""

from __future__ import annotations

import os
import time

import pytest

from cosyvoice_lb.admission import Admission
from cosyvoice_lb.engines import create_engine
from cosyvoice_lb.ledger import Ledger, Poisoned, fingerprint
from cosyvoice_lb.pipeline import Pipeline, describe


class Processes:
    """Which pids live (each test's own world)."""

    def __init__(self, *alive: int):
        self.living = set(alive)

    def alive(self, pid: int) -> bool:
        return pid in self.living


def ledger(tmp_path, pid: int, world: Processes, now: float = 0.0) -> Ledger:
    return Ledger(str(tmp_path), pid=pid, alive=world.alive, clock=lambda: now)


def test_the_same_input_has_the_same_fingerprint_and_others_differ():
    assert fingerprint("a", b"x") == fingerprint("a", b"x")
    assert len({fingerprint("a", b"x"), fingerprint("a", b"y"), fingerprint("ax", b""), fingerprint("a")}) == 4


def test_a_request_that_ends_leaves_no_mark(tmp_path):
    world = Processes(1)
    one = ledger(tmp_path, 1, world)
    one.leave(one.enter("req"))
    assert os.listdir(tmp_path) == []


def test_one_death_allows_one_more_run_and_two_deaths_refuse_it(tmp_path):
    world = Processes(1, 2, 3)
    first = ledger(tmp_path, 1, world)
    first.enter("req")
    world.living.discard(1)  # instance 1 died with it
    second = ledger(tmp_path, 2, world)
    second.enter("req")  # the one retry
    assert second.deaths("req") == 1
    world.living.discard(2)
    with pytest.raises(Poisoned, match="2 instances crashed or hung") as caught:
        ledger(tmp_path, 3, world).enter("req")
    assert caught.value.deaths == 2
    assert describe(caught.value).status == 422 and describe(caught.value).headers == {"x-should-retry": "false"}
    ledger(tmp_path, 3, world).leave(ledger(tmp_path, 3, world).enter("another request"))  # others run on


def test_a_request_running_elsewhere_or_twice_in_one_death_counts_once(tmp_path):
    world = Processes(1, 2, 3)
    a = ledger(tmp_path, 1, world)
    a.enter("req")
    a.enter("req")  # the same input twice in one process: one death between them
    ledger(tmp_path, 2, world).enter("req")  # running (alive): no evidence
    world.living.discard(1)
    assert ledger(tmp_path, 3, world).deaths("req") == 1


def test_a_graceful_stop_clears_its_own_marks(tmp_path):
    world = Processes(1, 2)
    one = ledger(tmp_path, 1, world)
    one.enter("req")
    ledger(tmp_path, 2, world).enter("req")
    one.clear_own()
    world.living.discard(1)
    assert ledger(tmp_path, 3, world).deaths("req") == 0
    assert len(os.listdir(tmp_path)) == 1  # the other process's mark stays


def test_old_evidence_is_forgotten(tmp_path):
    world = Processes(1)
    ledger(tmp_path, 1, world).enter("req")
    world.living.clear()
    assert ledger(tmp_path, 2, world, now=1e10).deaths("req") == 0
    assert os.listdir(tmp_path) == []


def test_the_pipeline_marks_while_synthesizing_and_refuses_a_poisoned_request(tmp_path):
    world = Processes(10, 11)
    admission = Admission()
    admission.become_ready()
    engine = create_engine("simulated", simulated_ms_per_char=0.0)
    p = Pipeline(engine, admission, ledger=ledger(tmp_path, 10, world))
    job = p.prepare({"text": "Hello."})
    chunks = p.chunks(job)
    next(chunks)
    assert [n.split(".")[:2] for n in os.listdir(tmp_path)] == [[job.fingerprint, "10"]]
    list(chunks)
    assert os.listdir(tmp_path) == []
    # Two dead processes that had this very request: refused before the engine or a slot.
    for pid in (1, 2):
        open(os.path.join(tmp_path, f"{job.fingerprint}.{pid}.abcd"), "w").close()
    with pytest.raises(Poisoned):
        p.synthesize(p.prepare({"text": "Hello."}))
    assert admission.snapshot().inflight == 0 and os.listdir(tmp_path) != []
    assert p.synthesize(p.prepare({"text": "Something else."})).size > 0


def test_a_zombie_is_dead_and_a_running_process_alive():
    import subprocess

    from cosyvoice_lb.ledger import pid_alive

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert pid_alive(child.pid) and pid_alive(os.getpid())
        child.kill()
        deadline = time.monotonic() + 10
        while pid_alive(child.pid) and time.monotonic() < deadline:  # a zombie until waited for
            time.sleep(0.01)
        assert not pid_alive(child.pid) and os.path.exists(f"/proc/{child.pid}")
    finally:
        child.wait()
    assert not pid_alive(child.pid)


def test_a_request_after_a_death_is_said_once_not_at_every_repeat(tmp_path, caplog):
    world = Processes(1, 2)
    ledger(tmp_path, 1, world).enter("common text")
    world.living.discard(1)
    two = ledger(tmp_path, 2, world)
    with caplog.at_level("WARNING", logger="cosyvoice_lb.instance"):
        for _ in range(5):
            two.leave(two.enter("common text"))
    assert sum("running it once more" in r.message for r in caplog.records) == 1
