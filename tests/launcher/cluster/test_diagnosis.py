"""What the cluster's state means (cosyvoice_lb/launcher/cluster/diagnosis.py): facts written by
hand in, the status `cosyvoice-lb status` prints out."""

from __future__ import annotations

import dataclasses

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.cluster.diagnosis import Observation, diagnose
from cosyvoice_lb.launcher.plan.planner import Roles, Slot
from cosyvoice_lb.launcher.state.health_report import HealthReport, OnPurpose, Track
from cosyvoice_lb.launcher.state.supervision import ProcessInfo

NOW = 10_000.0
SLOTS = tuple(Slot(index=i, port=7860 + i, gpu=None, memory=1) for i in range(3))


def proc(name: str, pid: int, state: str = "RUNNING") -> ProcessInfo:
    return ProcessInfo(name, state, pid, NOW - 60, NOW, "", 0)


def seen(**changes) -> Observation:
    """A healthy cluster of three serving instances, each fact overridable."""
    programs = {s.name: proc(s.name, 100 + s.index) for s in SLOTS}
    programs |= {name: proc(name, 50 + i) for i, name in enumerate(("nginx", "health", "admin", "jobs"))}
    tracks = {s.name: Track(in_rotation=True, pid=100 + s.index) for s in SLOTS}
    base = Observation(
        settings=Settings(port=8080),
        slots=SLOTS,
        roles=Roles(serving=3),
        programs=programs,
        health=HealthReport(updated=NOW - 1, tracks=tracks, pool={"wanted": 3}),
        pings={s.name: {"ready": True, "code": "abc"} for s in SLOTS},
        nginx_answer=200,
        listening=frozenset({("127.0.0.1", 8080)}),
        staged="abc",
        now=NOW,
    )
    return dataclasses.replace(base, **changes)


def with_track(name: str, **track) -> HealthReport:
    health = seen().health
    return dataclasses.replace(health, tracks={**health.tracks, name: Track(**track)})


def test_a_healthy_cluster_has_nothing_to_say():
    current = diagnose(seen())
    assert current.problems == [] and current.warnings == [] and current.exit_code == 0
    assert [i.serving for i in current.instances] == [True, True, True]
    assert current.pool["in_rotation"] == current.pool["wanted"] == 3


def test_rotation_counts_only_for_the_pid_the_loop_put_there():
    """A track of the instance's previous process (restarted since) is not this one in rotation."""
    current = diagnose(seen(health=with_track("instance-1", in_rotation=True, pid=999)))
    assert not current.instance("instance-1").in_rotation
    assert "instance-1 is ready but not in nginx's rotation yet" in current.problems


def test_a_failed_instance_says_how_to_bring_it_back():
    health = with_track("instance-2", failed="failed: crash loop", failed_at=NOW - 5)
    programs = {**seen().programs, "instance-2": proc("instance-2", 102, "STOPPED")}
    current = diagnose(seen(health=health, programs=programs))
    assert any(
        p.startswith("instance-2 failed: crash loop") and "cosyvoice-lb restart instance-2" in p
        for p in current.problems
    )
    assert not current.instance("instance-2").parked  # given up on is not parked


def test_parked_slots_and_spares_are_on_purpose_not_problems():
    programs = {**seen().programs, "instance-2": proc("instance-2", 0, "STOPPED")}
    health = dataclasses.replace(
        with_track("instance-1", in_rotation=False, pid=101, on_purpose=OnPurpose.SPARE), pool={"wanted": 1}
    )
    current = diagnose(seen(programs=programs, health=health, roles=Roles(serving=1, spares=1)))
    assert current.instance("instance-2").parked and current.instance("instance-2").reason == OnPurpose.PARKED
    assert current.instance("instance-1").spare
    assert current.problems == []
    assert (current.pool["parked"], current.pool["spares"]) == (1, 1)


def test_drained_by_hand_is_a_warning_with_the_way_back():
    health = with_track("instance-0", in_rotation=False, pid=100)
    current = diagnose(seen(health=health, drained=frozenset({"instance-0"})))
    assert current.problems == []
    assert current.warnings == [
        "instance-0 is drained by hand (out of rotation): 'cosyvoice-lb undrain instance-0' puts it back"
    ]


def test_fewer_in_rotation_than_wanted_with_none_coming_is_a_problem():
    programs = {**seen().programs, "instance-2": proc("instance-2", 0, "STOPPED")}
    current = diagnose(seen(programs=programs))  # stopped by hand: parked, yet 3 are wanted
    assert any(p.startswith("2 instance(s) in rotation of 3 wanted, and none coming") for p in current.problems)


def test_nginx_beyond_loopback_without_credentials_is_a_problem():
    current = diagnose(seen(listening=frozenset({("0.0.0.0", 8080)})))
    assert any("not on 127.0.0.1:8080 as its config says" in p for p in current.problems)
    assert any("requires no credentials: anyone who reaches it can synthesize" in p for p in current.problems)
    assert current.access["public"] is True  # what nginx does, not what its config says


def test_a_reload_nginx_did_not_take_is_a_problem():
    current = diagnose(seen(config_behind=NOW - 30))
    assert any(p.startswith("nginx still runs a config older than the one on disk") for p in current.problems)


def test_without_an_nginx_process_its_listeners_are_not_judged():
    programs = {**seen().programs, "nginx": proc("nginx", 0, "FATAL")}
    current = diagnose(seen(programs=programs, listening=None, nginx_answer=0))
    assert "nginx is fatal" in current.problems
    assert not any("listens on" in p for p in current.problems)


def test_old_code_is_a_roll_out_not_finished():
    pings = {**seen().pings, "instance-0": {"ready": True, "code": "old"}}
    current = diagnose(seen(pings=pings))
    assert current.warnings == [
        "roll-out not finished: instance-0 run(s) older code than staged (abc): 'cosyvoice-lb restart --all' "
        "replaces them"
    ]


def test_a_silent_health_loop_is_a_problem():
    current = diagnose(seen(health=dataclasses.replace(seen().health, updated=NOW - 600)))
    assert "the health loop has not reported for 600s (hung?)" in current.problems
    assert current.health["updated_seconds_ago"] == 600.0


# --- bad audio ------------------------------------------------------------------------------


def test_an_instance_out_for_bad_audio_says_so_and_what_happens_next():
    error = "a canary synthesis made bad audio: 16000 of 16000 samples of a chunk are NaN or infinite"
    pings = {**seen().pings, "instance-1": {"ready": False, "state": "bad-audio", "error": error}}
    health = with_track("instance-1", in_rotation=False, pid=101, ordered={"bad_audio": 2})
    current = diagnose(seen(pings=pings, health=health))
    item = current.instance("instance-1")
    assert (item.audio_fault, item.audio_fault_at, item.bad_audio_restarts) == (error, NOW, 2)
    assert current.problems == [f"instance-1 makes bad audio ({error}): out of rotation, the health loop restarts it"]


def test_the_health_loops_record_of_bad_audio_outlives_the_process():
    health = with_track("instance-1", in_rotation=True, pid=101, bad_audio="silent", bad_audio_at=NOW - 30)
    item = diagnose(seen(health=health)).instance("instance-1")
    assert (item.audio_fault, item.audio_fault_at) == ("silent", NOW - 30)


def test_bad_answers_of_a_serving_instance_are_a_warning_with_the_counts():
    pings = {**seen().pings, "instance-0": {"ready": True, "code": "abc", "bad_audio": {"non_finite": 3, "silent": 1}}}
    current = diagnose(seen(pings=pings))
    assert current.instance("instance-0").bad_audio == {"non_finite": 3, "silent": 1}
    assert current.problems == [] and current.exit_code == 0
    assert current.warnings == [
        "instance-0 made bad audio 4 time(s) since it started (non_finite 3, silent 1): those answers were not "
        "sent (retried elsewhere); it serves while its canary passes, see 'cosyvoice-lb logs instance-0'"
    ]
