"""Who waits for whom when concurrent syntheses share a flow or HiFT run, and how a group is
cut (instance/engines/batching.py), with a stand-in for the model's run: on upstream's
modules, tests/integration/test_upstream_batching.py."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cosyvoice_lb.instance.engines.batching import Batcher, groups


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 500), max_size=40),
    size=st.integers(1, 16),
    waste=st.floats(0, 1),
)
def test_groups_hold_every_item_once_within_size_and_waste(lengths, size, waste):
    cut = groups(lengths, size, waste)
    assert sorted(i for group in cut for i in group) == list(range(len(lengths)))
    for group in cut:
        assert 1 <= len(group) <= size
        longest = max(lengths[i] for i in group)
        if len(group) > 1 and longest:
            assert 1 - sum(lengths[i] for i in group) / (longest * len(group)) <= waste + 1e-12


def test_similar_lengths_go_together_and_a_far_longer_one_alone():
    assert groups([100, 102, 400, 98, 101], size=8, waste=0.25) == [[3, 0, 4, 1], [2]]
    assert groups([10, 10, 10, 10, 10], size=2, waste=0.0) == [[0, 1], [2, 3], [4]]


class Recorder:
    """A run that records the groups it was given and answers each payload doubled; a
    payload of ``bad`` fails whatever group it is in."""

    def __init__(self, bad: object = None, gate: threading.Event | None = None):
        self.runs: list[list] = []
        self.bad = bad
        self.gate = gate
        self.lock = threading.Lock()
        self.entered: list[list] = []  # the runs started (before the gate)

    def __call__(self, payloads):
        self.entered.append(list(payloads))
        if self.gate is not None:
            self.gate.wait(10)
        with self.lock:
            self.runs.append(list(payloads))
        if self.bad in payloads:
            raise ValueError(f"bad payload {self.bad}")
        return [p * 2 for p in payloads]


def together(batcher: Batcher, payloads: list, key=lambda p: "k", length=lambda p: 10) -> list:
    """Submit every payload from a thread of its own at once; each one's result or error."""
    results: list = [None] * len(payloads)
    start = threading.Barrier(len(payloads), timeout=10)

    def submit(i: int) -> None:
        start.wait()
        try:
            results[i] = batcher.submit(key(payloads[i]), payloads[i], length(payloads[i]))
        except Exception as exc:  # noqa: BLE001
            results[i] = exc

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(payloads))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    return results


def test_a_synthesis_alone_runs_at_once_without_waiting_for_the_window():
    run = Recorder()
    batcher = Batcher(run, size=8, window=60.0, expected=lambda: 1)
    assert batcher.submit("k", 3, 10) == 6  # (a 60 s window would time the test out)
    assert run.runs == [[3]]


def test_everyone_expected_runs_as_one_group_and_each_gets_its_own_result():
    run, sizes = Recorder(), []
    batcher = Batcher(run, size=8, window=60.0, expected=lambda: 4, heard=sizes.append)
    assert together(batcher, [1, 2, 3, 4]) == [2, 4, 6, 8]
    assert len(run.runs) == 1 and sorted(run.runs[0]) == [1, 2, 3, 4] and sizes == [4]


def test_the_window_lets_the_ones_that_came_go_without_those_that_did_not():
    run = Recorder()
    batcher = Batcher(run, size=8, window=0.05, expected=lambda: 5)  # (two more never come)
    assert together(batcher, [1, 2, 3]) == [2, 4, 6]
    assert [sorted(r) for r in run.runs] == [[1, 2, 3]]


def test_a_full_group_goes_without_waiting_and_the_size_is_never_passed():
    run = Recorder()
    batcher = Batcher(run, size=2, window=60.0, expected=lambda: 9)
    assert together(batcher, [1, 2, 3, 4]) == [2, 4, 6, 8]
    assert all(len(r) <= 2 for r in run.runs) and sorted(p for r in run.runs for p in r) == [1, 2, 3, 4]


def test_only_items_with_the_same_key_share_a_run():
    run = Recorder()
    batcher = Batcher(run, size=8, window=0.05, expected=lambda: 4)
    assert together(batcher, [1, 2, 3, 4], key=lambda p: p % 2) == [2, 4, 6, 8]
    assert sorted(sorted(r) for r in run.runs) == [[1, 3], [2, 4]]


def test_a_bad_item_fails_its_own_synthesis_only():
    run = Recorder(bad=3)
    single: list = []
    batcher = Batcher(run, size=8, window=60.0, expected=lambda: 4, single=lambda p: single.append(p) or run([p])[0])
    results = together(batcher, [1, 2, 3, 4])
    assert results[:2] == [2, 4] and results[3] == 8
    assert isinstance(results[2], ValueError) and "bad payload 3" in str(results[2])
    assert sorted(single) == [1, 2, 3, 4]  # (the group failed as a whole: each ran alone after)


def test_a_group_of_one_runs_on_the_single_path():
    run, single = Recorder(), []
    batcher = Batcher(run, size=8, window=60.0, expected=lambda: 1, single=lambda p: single.append(p) or -p)
    assert batcher.submit("k", 5, 10) == -5 and single == [5] and run.runs == []


def test_size_one_never_gathers():
    run = Recorder()
    batcher = Batcher(run, size=1, window=60.0, expected=lambda: 4)
    assert together(batcher, [1, 2, 3, 4]) == [2, 4, 6, 8]
    assert all(len(r) == 1 for r in run.runs) and len(run.runs) == 4


def test_items_that_come_while_a_group_runs_make_the_next_group():
    gate = threading.Event()
    run = Recorder(gate=gate)
    batcher = Batcher(run, size=8, window=0.02, expected=lambda: 2)
    first: list = []
    late: list = []
    leader = threading.Thread(target=lambda: first.append(batcher.submit("k", 1, 10)))
    leader.start()
    while not run.entered:  # (it leads once its window passed, then waits at the gate)
        threading.Event().wait(0.005)
    others = threading.Thread(target=lambda: late.extend(together(batcher, [2, 3])))
    others.start()
    while len(run.entered) < 2:
        threading.Event().wait(0.005)
    gate.set()
    leader.join(10)
    others.join(10)
    assert first == [2] and late == [4, 6]
    assert sorted(len(r) for r in run.runs) == [1, 2]


@pytest.mark.parametrize("waste", [0.0, 0.25])
def test_lengths_too_far_apart_run_as_separate_groups(waste):
    run = Recorder()
    batcher = Batcher(run, size=8, window=60.0, waste=waste, expected=lambda: 3)
    assert together(batcher, [10, 11, 400], length=lambda p: p) == [20, 22, 800]
    assert sorted(sorted(r) for r in run.runs) == ([[10], [11], [400]] if waste == 0.0 else [[10, 11], [400]])


def test_auto_batches_the_flow_and_hift_on_a_gpu_and_not_on_a_cpu():
    import types

    from cosyvoice_lb.instance.engines.upstream_batch import batch_size

    assert batch_size("auto", types.SimpleNamespace(type="cuda")) == 8
    assert batch_size("auto", types.SimpleNamespace(type="cpu")) == 1
    assert batch_size("auto", None) == 1
    assert batch_size("6", types.SimpleNamespace(type="cpu")) == 6
