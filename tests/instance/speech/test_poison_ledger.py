"""Poison requests: marks of running syntheses, deaths counted per request, refusals."""

from __future__ import annotations

import os
import time

import pytest

from cosyvoice_lb.instance.engines import create_engine
from cosyvoice_lb.instance.speech.admission import Admission
from cosyvoice_lb.instance.speech.failures import describe
from cosyvoice_lb.instance.speech.pipeline import Pipeline
from cosyvoice_lb.instance.speech.poison import SPOKEN, Ledger, Poisoned, fingerprint


class Processes:
    """Which pids live (each test's own world)."""

    def __init__(self, *alive: int):
        self.living = set(alive)

    def alive(self, pid: int) -> bool:
        return pid in self.living


def ledger(tmp_path, pid: int, world: Processes, now: float = 0.0) -> Ledger:
    return Ledger(str(tmp_path), pid=pid, alive=world.alive, clock=lambda: now)


def marks(tmp_path) -> list[str]:
    return sorted(name for name in os.listdir(tmp_path) if name != SPOKEN)


def at(path: str, when: float) -> str:
    """Date a mark or a success (the rule compares when they were made)."""
    os.utime(path, (when, when))
    return path


def spoken(tmp_path, print_: str, when: float) -> None:
    """A success of ``print_`` on some instance, at ``when``."""
    world = Processes(99)
    other = ledger(tmp_path, 99, world, now=when)
    other.leave(other.enter(print_, 0), spoken=True)
    at(os.path.join(tmp_path, SPOKEN, print_), when)


def test_the_same_input_has_the_same_fingerprint_and_others_differ():
    assert fingerprint("a", b"x") == fingerprint("a", b"x")
    assert len({fingerprint("a", b"x"), fingerprint("a", b"y"), fingerprint("ax", b""), fingerprint("a")}) == 4


def test_a_request_that_ends_leaves_no_mark(tmp_path):
    world = Processes(1)
    one = ledger(tmp_path, 1, world)
    one.leave(one.enter("req"))
    assert marks(tmp_path) == []


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
    assert len(marks(tmp_path)) == 1  # the other process's mark stays


def test_old_evidence_is_forgotten(tmp_path):
    world = Processes(1)
    ledger(tmp_path, 1, world).enter("req")
    world.living.clear()
    assert ledger(tmp_path, 2, world, now=1e10).deaths("req") == 0
    assert marks(tmp_path) == []


def test_the_pipeline_marks_while_synthesizing_and_refuses_a_poisoned_request(tmp_path):
    world = Processes(10, 11)
    admission = Admission()
    admission.become_ready()
    engine = create_engine("simulated", simulated_ms_per_char=0.0)
    p = Pipeline(engine, admission, ledger=ledger(tmp_path, 10, world))
    job = p.prepare({"text": "Hello."})
    chunks = p.chunks(job)
    next(chunks)
    assert [n.split(".")[:2] for n in marks(tmp_path)] == [[job.fingerprint, "10"]]
    list(chunks)
    assert marks(tmp_path) == []
    assert os.listdir(os.path.join(tmp_path, SPOKEN)) == [job.fingerprint]  # spoken to the end
    # Two tries of one client request died (nginx's id on both): refused before the engine or a slot.
    other = p.prepare({"text": "Another."})
    for pid in (1, 2):
        open(os.path.join(tmp_path, f"{other.fingerprint}.{pid}.0.nginx42.abcd"), "w").close()
    with pytest.raises(Poisoned):
        p.synthesize(p.prepare({"text": "Another."}, headers={"x-cvlb-try": "nginx7"}))
    assert p.prepare({"text": "Hi."}, headers={"x-cvlb-try": "nginx7"}).attempt == "nginx7"
    assert admission.snapshot().inflight == 0 and marks(tmp_path) != []
    assert p.synthesize(p.prepare({"text": "Something else."})).size > 0


def test_a_cut_or_failed_synthesis_is_not_a_success(tmp_path):
    world = Processes(10)
    admission = Admission()
    admission.become_ready()
    p = Pipeline(create_engine("simulated", simulated_ms_per_char=0.0), admission, ledger=ledger(tmp_path, 10, world))
    chunks = p.chunks(p.prepare({"text": "Hello there. And more."}))
    next(chunks)
    chunks.close()  # the client went away
    assert marks(tmp_path) == [] and os.listdir(os.path.join(tmp_path, SPOKEN)) == []


def test_a_request_after_a_death_is_said_once_not_at_every_repeat(tmp_path, caplog):
    world = Processes(1, 2)
    ledger(tmp_path, 1, world).enter("common text")
    world.living.discard(1)
    two = ledger(tmp_path, 2, world)
    with caplog.at_level("WARNING", logger="cosyvoice_lb.instance"):
        for _ in range(5):
            two.leave(two.enter("common text"))
    assert sum("running it once more" in r.message for r in caplog.records) == 1


# --- the rule: only the culprit trips it ---------------------------------------------------


def test_a_success_after_a_death_clears_it(tmp_path):
    world = Processes(1, 2)
    at(ledger(tmp_path, 1, world).enter("common", 0), 1000)
    world.living.discard(1)
    assert ledger(tmp_path, 2, world).deaths("common") == 1
    spoken(tmp_path, "common", 1001)  # another instance spoke it to the end afterwards
    assert ledger(tmp_path, 2, world).deaths("common") == 0


def test_a_success_before_a_death_does_not_clear_it(tmp_path):
    world = Processes(1, 2)
    spoken(tmp_path, "req", 999)
    at(ledger(tmp_path, 1, world).enter("req", 0), 1000)
    world.living.discard(1)
    assert ledger(tmp_path, 2, world).deaths("req") == 1


@pytest.mark.parametrize("deaths", [2, 5, 10])
def test_unrelated_deaths_with_a_common_text_in_flight_never_refuse_it(tmp_path, deaths):
    """One instance after another dies with the common text running, and the other clients'
    copies of it are spoken in between (as the chaos run's realistic traffic does)."""
    world = Processes(*range(1, deaths + 2))
    when = 1000.0
    for pid in range(1, deaths + 1):
        seen = ledger(tmp_path, pid, world).check("common")
        at(ledger(tmp_path, pid, world).enter("common", seen), when)
        world.living.discard(pid)
        spoken(tmp_path, "common", when + 0.5)
        when += 30
    assert ledger(tmp_path, deaths + 1, world).check("common") == 0


@pytest.mark.parametrize("instances", [2, 5])
def test_deaths_at_one_moment_are_not_repetition(tmp_path, instances):
    """A box-wide kill: every instance had the common text, all marks made before any died."""
    world = Processes(*range(1, instances + 3))
    for pid in range(1, instances + 1):
        ledger(tmp_path, pid, world).enter("common", 0)
    world.living.difference_update(range(1, instances + 1))
    survivor = ledger(tmp_path, instances + 1, world)
    assert survivor.check("common") == instances  # each death counts, none refuses on its own
    survivor.leave(survivor.enter("common", instances), spoken=True)  # the retries are spoken
    assert ledger(tmp_path, instances + 2, world).check("common") == 0


def test_a_culprit_is_refused_after_one_retry_and_again_later(tmp_path):
    world = Processes(1, 2, 3, 4)
    first = ledger(tmp_path, 1, world)
    first.enter("culprit", first.check("culprit"))
    world.living.discard(1)
    retry = ledger(tmp_path, 2, world)
    retry.enter("culprit", retry.check("culprit"))  # knows of the first death
    world.living.discard(2)
    for pid in (3, 4):  # the next try, and a client sending it again soon after
        with pytest.raises(Poisoned):
            ledger(tmp_path, pid, world, now=time.time() + 300).check("culprit")


def test_a_shared_death_does_not_count_against_a_request_known_to_succeed(tmp_path):
    """Two instances at once: a culprit and the common text die together, twice."""
    world = Processes(1, 2, 3)
    spoken(tmp_path, "common", 900)
    one = ledger(tmp_path, 1, world)
    at(one.enter("common", 0), 1000)
    at(one.enter("culprit", 0), 1000)
    world.living.discard(1)
    two = ledger(tmp_path, 2, world)
    at(two.enter("culprit", two.check("culprit")), 1001)
    at(two.enter("common", two.check("common")), 1001)
    world.living.discard(2)
    third = ledger(tmp_path, 3, world)
    assert third.check("common") == 0
    with pytest.raises(Poisoned):
        third.check("culprit")


def test_a_shared_death_counts_against_a_request_never_spoken(tmp_path):
    world = Processes(1, 2, 3)
    one = ledger(tmp_path, 1, world)
    one.enter("new", 0)
    one.enter("other", 0)
    world.living.discard(1)
    two = ledger(tmp_path, 2, world)
    assert two.check("new") == 1
    two.enter("new", 1)
    world.living.discard(2)
    with pytest.raises(Poisoned):
        ledger(tmp_path, 3, world).check("new")


def test_marks_of_the_earlier_format_are_read_as_first_runs(tmp_path):
    world = Processes(3)
    for pid in (1, 2):
        open(os.path.join(tmp_path, f"req.{pid}.abcd1234"), "w").close()
    assert ledger(tmp_path, 3, world).check("req") == 2  # two deaths, no retry among them


def test_old_successes_are_swept(tmp_path):
    world = Processes(1)
    spoken(tmp_path, "old", 0)
    one = Ledger(str(tmp_path), pid=1, alive=world.alive, clock=lambda: 0.0)
    one.clock = lambda: 10_000.0  # the next success comes long after the sweep before it
    one.leave(one.enter("new", 0), spoken=True)
    assert os.listdir(os.path.join(tmp_path, SPOKEN)) == ["new"]


def test_two_tries_of_one_request_are_a_repetition_even_when_the_first_death_went_unseen(tmp_path):
    """nginx retries the moment the instance's socket closes: the retry may find the first
    process still exiting, start as a first run, and die too. Its attempt id tells."""
    world = Processes(1, 2, 3)
    ledger(tmp_path, 1, world).enter("culprit", 0, attempt="req-1")
    ledger(tmp_path, 2, world).enter("culprit", 0, attempt="req-1")  # did not see 1's death yet
    world.living.difference_update({1, 2})
    with pytest.raises(Poisoned):
        ledger(tmp_path, 3, world).check("culprit")


def test_tries_of_different_requests_at_one_moment_are_not(tmp_path):
    world = Processes(1, 2, 3)
    ledger(tmp_path, 1, world).enter("common", 0, attempt="req-1")
    ledger(tmp_path, 2, world).enter("common", 0, attempt="req-2")
    world.living.difference_update({1, 2})
    assert ledger(tmp_path, 3, world).check("common") == 2
