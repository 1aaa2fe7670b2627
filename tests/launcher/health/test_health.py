"""The health loop's rules (cosyvoice_lb/launcher/health/rules.py): the pure ``judge`` and a real ``probe``.

``judge`` is fed ProcessInfo records built here (uptime = now - start); ``probe`` talks to a
tiny HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import dataclasses

import pytest

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.health.probe import Probe
from cosyvoice_lb.launcher.health.rules import Policy, judge
from cosyvoice_lb.launcher.state.health_report import OnPurpose, Track
from cosyvoice_lb.launcher.state.markers import DrainAction
from cosyvoice_lb.launcher.state.supervision import ProcessInfo

NOW = 1_700_000_000.0
POLICY = Policy(fail_threshold=3, recover_threshold=2, hang_timeout=120.0, startup_timeout=300.0)
READY = Probe("ready", busy_seconds=0.5)
LOADING = Probe("loading")
FAILED = Probe("failed", detail="/ping: ConnectionError")


def process(pid: int = 100, state: str = "RUNNING", uptime: float = 1000.0) -> ProcessInfo:
    return ProcessInfo(
        name="instance-0", state=state, pid=pid, start=NOW - uptime, now=NOW, description=f"pid {pid}", exitstatus=0
    )


def serving(pid: int = 100, **changes) -> Track:
    """An instance that has been ready and is in rotation."""
    return Track(**{"in_rotation": True, "pid": pid, "ever_ready": True, "goods": 5, **changes})


def run(track: Track, probes, proc=None, policy: Policy = POLICY):
    """Judge a run of probes against one process; the verdicts in order."""
    verdicts = []
    for p in probes:
        verdict = judge(track, proc or process(), p, policy)
        verdicts.append(verdict)
        track = verdict.track
    return verdicts


def test_process_uptime():
    assert process(uptime=42.0).uptime == 42.0
    never_started = ProcessInfo("instance-0", "STARTING", 5, start=0.0, now=NOW, description="", exitstatus=0)
    assert never_started.uptime == 0.0


def test_policy_from_settings():
    settings = Settings(fail_threshold=4, recover_threshold=3, hang_timeout=60.0, startup_timeout=90.0, start_retries=5)
    assert Policy.from_settings(settings) == Policy(4, 3, 60.0, 90.0, start_retries=5)


# --- coming into rotation -----------------------------------------------------------------


@pytest.mark.parametrize("recover", [1, 2, 3, 5])
@pytest.mark.parametrize("state", ["RUNNING", "STARTING"])
def test_a_new_process_comes_into_rotation_after_recover_threshold_good_probes(recover, state):
    policy = Policy(fail_threshold=3, recover_threshold=recover)
    verdicts = run(Track(), [READY] * (recover + 2), process(pid=321, state=state, uptime=5.0), policy)
    assert [v.track.in_rotation for v in verdicts] == [False] * (recover - 1) + [True] * 3
    assert [v.track.goods for v in verdicts] == list(range(1, recover + 3))
    assert all(v.restart == "" for v in verdicts)
    assert all(v.track.pid == 321 and v.track.ever_ready for v in verdicts)
    assert verdicts[recover - 1].track.reason == ""  # in rotation: no reason to be out
    if recover > 1:
        assert verdicts[0].track.reason == "started"


def test_a_new_process_starts_out_of_rotation_even_if_the_old_one_was_in():
    verdict = judge(serving(pid=100), process(pid=200, uptime=2.0), READY, POLICY)
    assert not verdict.track.in_rotation
    assert (verdict.track.pid, verdict.track.goods) == (200, 1)


# --- failing probes -----------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [1, 2, 3, 5])
def test_k_minus_1_failures_keep_it_in_rotation_and_k_restart_it(threshold):
    policy = Policy(fail_threshold=threshold, recover_threshold=2)
    verdicts = run(serving(), [FAILED] * threshold, policy=policy)
    *before, last = verdicts
    assert [v.track.in_rotation for v in before] == [True] * (threshold - 1)
    assert [v.track.fails for v in before] == list(range(1, threshold))
    assert all(v.restart == "" for v in before)
    assert last.restart == f"{threshold} probes failed in a row: /ping: ConnectionError"
    assert last.track.reason == last.restart
    assert not last.track.in_rotation
    assert (last.track.fails, last.track.goods, last.track.restarts) == (0, 0, 1)


def test_a_good_probe_resets_the_fail_count():
    probes = [FAILED, FAILED, READY, FAILED, FAILED, READY, FAILED, FAILED]
    verdicts = run(serving(), probes)
    assert [v.track.fails for v in verdicts] == [1, 2, 0, 1, 2, 0, 1, 2]
    assert all(v.restart == "" and v.track.in_rotation for v in verdicts)
    assert run(serving(), probes + [FAILED])[-1].restart  # the third in a row does restart it


def test_a_failure_resets_the_good_count_of_a_recovering_instance():
    policy = Policy(fail_threshold=5, recover_threshold=3)
    track = Track(pid=100, ever_ready=True)  # out of rotation, was ready before
    verdicts = run(track, [READY, READY, FAILED, READY, READY, READY], policy=policy)
    assert [v.track.goods for v in verdicts] == [1, 2, 0, 1, 2, 3]
    assert [v.track.in_rotation for v in verdicts] == [False] * 5 + [True]


# --- hung synthesis -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "stalled, restarts", [(0.0, False), (119.9, False), (120.0, False), (120.1, True), (900.0, True)]
)
def test_a_synthesis_stalled_past_the_hang_timeout_means_a_drained_restart(stalled, restarts):
    verdict = judge(serving(), process(), Probe("ready", busy_seconds=stalled, stalled=(stalled,)), POLICY)
    assert bool(verdict.restart) is restarts
    assert verdict.track.in_rotation is not restarts
    if restarts:
        assert verdict.restart == f"a synthesis has made no progress for {stalled:.0f}s (hang timeout 120s)"
        assert verdict.track.restarts == 1 and verdict.drain  # it still answers: others may finish first


def test_a_long_synthesis_that_keeps_making_chunks_is_not_hung():
    verdict = judge(serving(), process(), Probe("ready", busy_seconds=900.0, stalled=(2.0,)), POLICY)
    assert not verdict.restart and verdict.track.in_rotation


def test_hang_restarts_even_a_newcomer_on_its_first_probe():
    verdict = judge(Track(), process(pid=7, uptime=10.0), Probe("ready", stalled=(500.0,)), POLICY)
    assert verdict.restart and verdict.track.pid == 7 and verdict.track.restarts == 1


def test_a_hung_instance_already_on_its_way_out_is_not_restarted_twice():
    going = serving(in_rotation=False, draining_since=NOW, drain_signal=DrainAction.KILL, restarts=1)
    verdict = judge(going, process(), Probe("ready", stalled=(500.0,)), POLICY)
    assert not verdict.restart and verdict.track.restarts == 1


def test_failed_probes_mean_a_restart_now_not_a_drain():
    verdict = run(serving(), [FAILED] * 3)[-1]
    assert verdict.restart and not verdict.drain  # it does not answer: nothing to wait for


# --- drains (planned stops) ----------------------------------------------------------------

from cosyvoice_lb.launcher.health.rules import drain_done, failed_starts, start_drain  # noqa: E402


def test_start_drain_takes_it_out_and_counts_one_restart():
    track = start_drain(serving(restarts=2), "restart requested", DrainAction.TERM, NOW)
    assert (track.in_rotation, track.draining_since, track.drain_signal, track.restarts) == (False, NOW, "TERM", 3)
    again = start_drain(track, "a synthesis has made no progress", DrainAction.KILL, NOW + 5)  # escalated, same stop
    assert (again.draining_since, again.drain_signal, again.restarts) == (NOW, "KILL", 3)


@pytest.mark.parametrize(
    "signal_name, probe_, elapsed, done",
    [
        (DrainAction.TERM, Probe("ready", inflight=0, waiting=0), 1.0, True),
        (DrainAction.TERM, Probe("ready", inflight=1, stalled=(0.1,)), 1.0, False),  # one still synthesizing
        (DrainAction.TERM, Probe("ready", inflight=0, waiting=1), 1.0, False),  # one queued, still to be served
        # streaming sessions last as long as their clients write: the instance's drain ends them
        (DrainAction.TERM, Probe("ready", inflight=2, sessions=2, stalled=(0.0, 0.0)), 1.0, True),
        (DrainAction.TERM, Probe("ready", inflight=2, sessions=1, stalled=(0.0, 0.1)), 1.0, False),
        (DrainAction.TERM, Probe("ready", inflight=1, stalled=(0.1,)), 30.5, True),  # --drain-timeout
        (DrainAction.TERM, Probe("failed"), 1.0, True),  # does not answer: TERM now (it drains itself anyway)
        (DrainAction.HOLD, Probe("ready", inflight=0), 1.0, True),
        (DrainAction.KILL, Probe("ready", inflight=1, stalled=(500.0,)), 1.0, True),  # only the hung one is left
        (DrainAction.KILL, Probe("ready", inflight=2, stalled=(500.0, 0.2)), 1.0, False),  # another still progresses
        (DrainAction.KILL, Probe("ready", inflight=2, stalled=(500.0, 0.2)), 31.0, True),
    ],
)
def test_drain_done(signal_name, probe_, elapsed, done):
    track = start_drain(serving(), "why", signal_name, NOW)
    assert drain_done(track, probe_, Policy(hang_timeout=120.0, drain_timeout=30.0), NOW + elapsed) is done


def test_a_signalled_instance_stays_out_until_its_new_process_serves():
    track = dataclasses.replace(
        start_drain(serving(), "restart requested", DrainAction.TERM, NOW), signalled_at=NOW + 1
    )
    verdict = judge(track, process(pid=100), READY, Policy(recover_threshold=1))
    assert not verdict.track.in_rotation and not verdict.restart
    new = judge(verdict.track, process(pid=101, uptime=5.0), READY, Policy(recover_threshold=1)).track
    assert new.in_rotation and (new.draining_since, new.signalled_at, new.restarts) == (0.0, 0.0, 1)


# --- crash loops ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "starts, since, alive, count",
    [
        (1, 0, True, 0),
        (1, 0, False, 1),
        (4, 0, True, 3),
        (4, 0, False, 4),
        (7, 5, True, 1),
        (5, 5, True, 0),
    ],
)
def test_failed_starts(starts, since, alive, count):
    assert failed_starts(starts, since, alive) == count


def test_an_instance_that_keeps_dying_while_loading_is_given_up_on():
    policy = Policy(start_retries=2)
    track, verdicts = Track(), []
    for start in range(1, 6):  # each start: loading, then it exits
        v1 = judge(track, process(pid=100 + start, uptime=2.0), LOADING, policy, starts=start)
        v2 = judge(v1.track, process(pid=0, state="BACKOFF"), FAILED, policy, starts=start)
        verdicts += [v1, v2]
        track = v2.track
    gave_up = [bool(v.give_up) for v in verdicts]
    assert gave_up.index(True) == 5  # the 3rd exit: more than --start-retries 2 in a row
    assert track.failed.startswith("failed: it exited 3 times in a row without getting ready")
    assert not track.in_rotation


def test_supervisord_giving_up_is_a_failure_too():
    verdict = judge(Track(), process(pid=0, state="FATAL"), FAILED, POLICY, starts=4)
    assert verdict.give_up == verdict.track.failed == "failed: supervisord gave up starting it after 4 exits in a row"


def test_a_failed_instance_that_runs_again_is_stopped_again():
    failed = Track(failed="failed: it exited 4 times", reason="failed: it exited 4 times")
    verdict = judge(failed, process(pid=300, uptime=1.0), LOADING, POLICY, starts=6)
    assert verdict.give_up == failed.failed and not verdict.track.in_rotation


def test_being_ready_once_resets_the_crash_count():
    policy = Policy(start_retries=1, recover_threshold=1)
    track = judge(Track(), process(pid=5, uptime=3.0), READY, policy, starts=3).track
    assert track.ready_starts == 3
    track = judge(track, process(pid=0, state="BACKOFF"), FAILED, policy, starts=3).track
    verdict = judge(track, process(pid=6, uptime=1.0), LOADING, policy, starts=4)
    assert not verdict.give_up and verdict.track.reason == "loading"


# --- loading ------------------------------------------------------------------------------


@pytest.mark.parametrize("status", ["loading", "failed"])
def test_an_instance_loading_within_the_startup_timeout_is_never_restarted(status):
    proc_probe = Probe(status, detail="/ping: ConnectionError")
    track = Track()
    for uptime in range(0, 300):  # one probe a second for the whole startup window
        verdict = judge(track, process(pid=55, uptime=uptime + 0.5), proc_probe, POLICY)
        assert verdict.restart == "", uptime
        assert not verdict.track.in_rotation
        assert (verdict.track.fails, verdict.track.reason) == (0, "loading")
        track = verdict.track
    assert track.restarts == 0


def test_not_ready_by_the_startup_timeout_reporting_loading_restarts():
    track = judge(Track(), process(uptime=299.9), LOADING, POLICY).track
    verdict = judge(track, process(uptime=300.0), LOADING, POLICY)
    assert verdict.restart == "not ready after the startup timeout (300s)"
    assert not verdict.track.in_rotation and verdict.track.restarts == 1


def test_not_ready_by_the_startup_timeout_failing_restarts_after_k_failures():
    track = judge(Track(), process(uptime=299.0), FAILED, POLICY).track
    verdicts = run(track, [FAILED] * 3, process(uptime=301.0))
    assert [bool(v.restart) for v in verdicts] == [False, False, True]
    assert verdicts[-1].restart.startswith("3 probes failed in a row")


def test_the_startup_window_only_covers_a_process_that_was_never_ready():
    # Ready once, then failing: ordinary failure counting, however young the process is.
    verdicts = run(Track(), [READY] + [FAILED] * 3, process(uptime=5.0))
    assert [bool(v.restart) for v in verdicts] == [False, False, False, True]


def test_a_ready_instance_reporting_loading_again_is_restarted():
    verdict = judge(serving(), process(uptime=5.0), LOADING, POLICY)
    assert verdict.restart == "reports loading again"
    assert not verdict.track.in_rotation


# --- the process is not alive -------------------------------------------------------------


@pytest.mark.parametrize("state", ["BACKOFF", "EXITED", "STOPPED", "STOPPING", "UNKNOWN", None])
@pytest.mark.parametrize("the_probe", [READY, LOADING, FAILED])
def test_a_process_that_is_not_running_is_out_of_rotation_without_a_restart(state, the_probe):
    proc = None if state is None else process(pid=0 if state in ("EXITED", "FATAL", "STOPPED") else 100, state=state)
    verdict = judge(serving(fails=2, restarts=4), proc, the_probe, POLICY)
    assert verdict.restart == ""
    assert not verdict.track.in_rotation
    assert (verdict.track.fails, verdict.track.goods, verdict.track.pid, verdict.track.ever_ready) == (0, 0, 0, False)
    assert verdict.track.restarts == 4
    # (stopped on purpose, by the launcher or the elastic scaler: a parked slot)
    assert (verdict.track.on_purpose, verdict.track.reason) == (
        (OnPurpose.PARKED, "") if state == "STOPPED" else (None, f"process {(state or 'missing').lower()}")
    )


def test_running_without_a_pid_counts_as_not_running():
    verdict = judge(serving(), process(pid=0, state="RUNNING"), READY, POLICY)
    assert verdict.restart == "" and not verdict.track.in_rotation and verdict.track.goods == 0


# A warm spare (ready, out on purpose) as the loop leaves it between steps
SPARE = serving(in_rotation=False, on_purpose=OnPurpose.SPARE)
HUNG = Probe("ready", stalled=(500.0,))


@pytest.mark.parametrize(
    "verdict, reason",
    [
        (judge(SPARE, process(pid=0, state="EXITED"), READY, POLICY), "process exited"),
        (judge(SPARE, process(pid=200, uptime=1.0), READY, POLICY), "started"),
        (judge(SPARE, process(pid=200, uptime=1.0), LOADING, POLICY), "loading"),
        (run(SPARE, [FAILED] * 3)[-1], "3 probes failed in a row: /ping: ConnectionError"),
        (judge(SPARE, process(), HUNG, POLICY), "a synthesis has made no progress for 500s (hang timeout 120s)"),
        (judge(SPARE, process(pid=0, state="FATAL"), FAILED, POLICY), "failed: supervisord gave up starting it"),
    ],
)
def test_a_reason_for_people_replaces_being_out_on_purpose(verdict, reason):
    assert (verdict.track.on_purpose, verdict.track.reason) == (None, reason)
    assert verdict.track.reason_words == reason  # (what status, the logs and health.json say)


def test_being_out_on_purpose_replaces_a_reason_for_people_and_back_in_rotation_clears_both():
    parked = judge(serving(reason="process exited"), process(pid=0, state="STOPPED"), READY, POLICY).track
    assert (parked.on_purpose, parked.reason, parked.reason_words) == (OnPurpose.PARKED, "", OnPurpose.PARKED.value)
    drained = start_drain(SPARE, "recycling: served 11 requests", DrainAction.TERM, NOW)
    assert (drained.on_purpose, drained.reason) == (None, "recycling: served 11 requests")
    back = run(SPARE, [READY] * POLICY.recover_threshold)[-1].track
    assert back.in_rotation and (back.on_purpose, back.reason) == (None, "")


# --- restart bookkeeping ------------------------------------------------------------------


def test_the_restart_counter_counts_every_restart_verdict():
    policy = Policy(fail_threshold=2, recover_threshold=1)
    hung = Probe("ready", busy_seconds=999, stalled=(999.0,))
    probes = [hung, READY, FAILED, FAILED, READY, hung, LOADING, READY, FAILED]
    verdicts = run(serving(), probes, policy=policy)
    assert [v.track.restarts for v in verdicts] == [1, 1, 1, 2, 2, 3, 4, 4, 4]
    assert [bool(v.restart) for v in verdicts] == [True, False, False, True, False, True, True, False, False]


@pytest.mark.parametrize("the_probe, reason", [(READY, "started"), (FAILED, "loading"), (LOADING, "loading")])
def test_a_new_pid_after_a_restart_resets_the_counts_but_keeps_restarts(the_probe, reason):
    old = serving(pid=100, fails=2, goods=7, restarts=3, reason="3 probes failed in a row")
    verdict = judge(old, process(pid=200, uptime=1.0), the_probe, POLICY)
    track = verdict.track
    assert verdict.restart == ""
    assert (track.pid, track.restarts, track.in_rotation, track.fails) == (200, 3, False, 0)
    assert track.goods == (1 if the_probe is READY else 0)
    assert track.ever_ready is (the_probe is READY)
    assert track.reason == reason


def test_full_cycle_failure_restart_and_recovery():
    track = serving(pid=100)
    track = run(track, [FAILED] * 3, process(pid=100))[-1].track  # restart ordered
    assert track.restarts == 1 and not track.in_rotation
    track = judge(track, process(pid=0, state="BACKOFF"), FAILED, POLICY).track  # KILLed, coming back
    track = judge(track, process(pid=101, state="STARTING", uptime=0.5), FAILED, POLICY).track
    assert (track.pid, track.reason, track.in_rotation) == (101, "loading", False)
    verdicts = run(track, [LOADING, READY, READY], process(pid=101, uptime=30.0))
    assert [v.track.in_rotation for v in verdicts] == [False, False, True]
    assert verdicts[-1].track.restarts == 1
    assert all(v.restart == "" for v in verdicts)


from cosyvoice_lb.launcher.health.rules import pick_recycle, recycle_due  # noqa: E402

RECYCLE = Policy(max_requests=100, max_memory=8 * 2**30)
SERVING = Track(in_rotation=True, ever_ready=True, pid=7, recycle_at=110)


@pytest.mark.parametrize(
    "track, probe, memory, reason",
    [
        (SERVING, Probe("ready", served=109), 2**30, ""),
        (SERVING, Probe("ready", served=110), 2**30, "served 110 requests (--max-requests 100)"),
        (SERVING, Probe("ready", served=5), 9 * 2**30, "uses 9.0 GiB (--max-memory 8.0 GiB)"),
        (dataclasses.replace(SERVING, in_rotation=False), Probe("ready", served=500), 0, ""),  # not serving: no
        (dataclasses.replace(SERVING, draining_since=1.0), Probe("ready", served=500), 0, ""),  # already going
        (dataclasses.replace(SERVING, recycle_at=0), Probe("ready", served=500), 0, ""),  # share not drawn yet
        (SERVING, Probe("failed", served=500), 0, ""),  # sick is the health verdict's business
    ],
)
def test_recycle_due(track, probe, memory, reason):
    assert recycle_due(track, probe, memory, RECYCLE) == reason


def test_recycling_is_off_by_default():
    assert recycle_due(SERVING, Probe("ready", served=10**6), 10**12, Policy()) == ""


def test_one_recycle_at_a_time_and_only_while_the_others_serve():
    tracks = {"a": SERVING, "b": SERVING, "c": SERVING}
    ages = {"a": 50.0, "b": 40.0, "c": 30.0}
    assert pick_recycle({"a": "", "b": "x", "c": "y"}, tracks, ages) == ("b", "x")
    busy = {**tracks, "a": dataclasses.replace(SERVING, draining_since=5.0)}
    assert pick_recycle({"b": "x"}, busy, ages) is None
    one_out = {**tracks, "c": dataclasses.replace(SERVING, in_rotation=False)}
    assert pick_recycle({"b": "x"}, one_out, ages) is None  # c is out: b stays until c is back
    assert pick_recycle({"c": "y"}, one_out, ages) == ("c", "y")


def test_of_those_due_the_oldest_process_is_recycled_first():
    tracks = {"a": SERVING, "b": SERVING, "c": SERVING}
    due = {"a": "x", "b": "y", "c": "z"}
    assert pick_recycle(due, tracks, {"a": 5.0, "b": 70.0, "c": 20.0}) == ("b", "y")
    assert pick_recycle(due, tracks, {"a": 90.0, "b": 7.0, "c": 20.0}) == ("a", "x")


def test_a_recycling_instance_stays_out_of_rotation_while_it_drains():
    track = dataclasses.replace(SERVING, in_rotation=False, draining_since=5.0)
    verdict = judge(track, process(pid=7), Probe("ready"), Policy(recover_threshold=1))
    assert verdict.track.in_rotation is False and not verdict.restart


def test_the_start_after_a_planned_stop_is_no_crash_even_while_loading():
    policy = Policy(start_retries=1)
    track = judge(Track(), process(pid=5, uptime=2.0), LOADING, policy, starts=1).track  # loading, never ready
    for start in range(2, 6):  # restarted by hand (or replaced) again and again while it loads
        track = dataclasses.replace(
            start_drain(track, "restart requested", DrainAction.TERM, NOW), signalled_at=NOW + 1
        )
        verdict = judge(track, process(pid=5 + start, uptime=1.0), LOADING, policy, starts=start)
        assert not verdict.give_up and verdict.track.reason == "loading"
        track = verdict.track
    assert track.ready_starts == 4  # only starts that ended on their own would count


# --- bad audio ------------------------------------------------------------------------------

BAD_AUDIO = Probe("bad_audio", detail="the warm-up synthesis made bad audio: silent")


def test_bad_audio_restarts_a_serving_instance_at_once_and_records_it():
    verdict = judge(serving(), process(), BAD_AUDIO, POLICY, starts=1, now=NOW)
    assert verdict.restart == "it made bad audio: the warm-up synthesis made bad audio: silent"
    assert verdict.kind == "bad_audio" and not verdict.drain and not verdict.give_up
    track = verdict.track
    assert not track.in_rotation and track.restarts == 1 and track.ordered == {"bad_audio": 1}
    assert (track.bad_audio, track.bad_audio_at) == (BAD_AUDIO.detail, NOW)


def test_a_loading_instance_that_says_bad_audio_is_restarted_not_waited_for():
    """Its warm-up failed the check: within --startup-timeout, yet nothing to wait for."""
    verdict = judge(Track(), process(pid=7, uptime=5.0), BAD_AUDIO, POLICY, starts=1, now=NOW)
    assert verdict.kind == "bad_audio" and verdict.restart


def test_the_bad_audio_record_outlives_the_process():
    track = judge(serving(), process(), BAD_AUDIO, POLICY, starts=1, now=NOW).track
    reborn = judge(track, process(pid=200, uptime=1.0), LOADING, POLICY, starts=2, now=NOW + 5).track
    assert (reborn.pid, reborn.bad_audio, reborn.bad_audio_at) == (200, BAD_AUDIO.detail, NOW)


def test_warm_ups_with_bad_audio_are_failed_starts():
    policy = Policy(start_retries=1)
    track, verdicts = Track(), []
    for start in range(1, 5):
        verdict = judge(track, process(pid=100 + start, uptime=2.0), BAD_AUDIO, policy, starts=start, now=NOW)
        verdicts.append(verdict)
        track = verdict.track
    assert [bool(v.restart) for v in verdicts[:2]] == [True, True]
    assert verdicts[2].give_up.startswith("failed: it was started 3 times without getting ready (--start-retries 1)")
    assert verdicts[2].give_up.endswith("it made bad audio: the warm-up synthesis made bad audio: silent")
