"""The lifecycle's ordering rules (cosyvoice_lb/launcher/cluster/lifecycle.py, rollout.py,
waits.py) against a scripted cluster (tests/cluster_sim.py): what must happen before what
when `up` applies new settings, when `restart` replaces instances, when a roll-out fails."""

from __future__ import annotations

import dataclasses

import pytest
from cluster_sim import LOAD_STEPS, world

from cosyvoice_lb.launcher.cluster import lifecycle
from cosyvoice_lb.launcher.cluster.rollout import Slots, surge_rollout
from cosyvoice_lb.launcher.cluster.waits import others_serving, wait_serving
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.state.markers import drain_by_hand


def starts(w, name: str) -> list[int]:
    return [i for i, e in enumerate(w.events) if e == ("start", name)]


def first(w, kind: str, name: str | None = None) -> int:
    return next(i for i, e in enumerate(w.events) if e[0] == kind and (name is None or e[1] == name))


# --- restart --------------------------------------------------------------------------------


def test_a_rolling_restart_keeps_all_but_one_serving_and_replaces_every_process(tmp_path):
    w = world(tmp_path, instances=3)
    before = {s.name: w.pid(s.name) for s in w.slots}
    done = lifecycle.restart_in(w.cluster(), w.slots, None, rolling=True, surge=0)
    assert done == ["restarted instance-0", "restarted instance-1", "restarted instance-2"]
    assert all(w.pid(name) != pid for name, pid in before.items())
    assert min(w.serving_seen) >= 2  # never more than one out at a time
    assert w.serving_seen[-1] == 3
    drains = [e for e in w.events if e[0] == "drain"]
    assert drains == [("drain", f"instance-{i}", "TERM") for i in range(3)]


def test_instances_not_serving_are_restarted_first(tmp_path):
    w = world(tmp_path, instances=3)
    w.stop("instance-2")
    w.start("instance-2")  # (restarted after a crash: loading, not serving)
    lifecycle.restart_in(w.cluster(), w.slots, ["instance-0", "instance-2"], rolling=True, surge=0)
    assert first(w, "drain", "instance-2") < first(w, "drain", "instance-0")


def test_the_last_serving_instance_is_never_stopped(tmp_path):
    """The only other instance is drained by hand: restarting this one would leave none
    serving, so `restart --all` refuses before it stops anything."""
    w = world(tmp_path, instances=2)
    drain_by_hand(w.layout, "instance-1")
    w.sleep(0.1)
    with pytest.raises(ClusterError, match="would leave no instance serving; 'cosyvoice-lb undrain instance-1'"):
        lifecycle.restart_in(w.cluster(), w.slots, None, rolling=True, surge=0)
    assert not [e for e in w.events if e[0] in ("stop", "drain") and e[1] == "instance-0"]


def test_a_stop_waits_until_the_others_serve(tmp_path):
    w = world(tmp_path, instances=3)
    w.stop("instance-1")
    w.start("instance-1")  # loading: not serving for a few steps
    others_serving(w.cluster(), "instance-0")
    assert w.read_status().instance("instance-1").serving  # it waited until then


# --- surge roll-outs ------------------------------------------------------------------------


def test_a_surge_roll_out_serves_the_replacement_before_the_old_one_goes(tmp_path):
    w = world(tmp_path, instances=3, parked=1)
    done = surge_rollout(w.cluster(), ["instance-0", "instance-1"], [w.slots[2]])
    assert done == ["instance-0 -> instance-2", "instance-1 -> instance-0"]
    assert min(w.serving_seen) >= 2  # in rotation never fewer than before
    assert starts(w, "instance-2")[0] < first(w, "drain", "instance-0") < first(w, "stop", "instance-0")


def test_a_failed_roll_out_stops_what_it_started_and_leaves_the_old_serving(tmp_path):
    w = world(tmp_path, instances=3, parked=1)
    w.crashing.add("instance-2")
    with pytest.raises(ClusterError, match=r"surge roll-out stopped, 0 of 1 replaced \(none\)"):
        surge_rollout(w.cluster(), ["instance-0"], [w.slots[2]])
    assert ("drain", "instance-2", "STOP") in w.events  # what it started is stopped
    assert w.read_status().instance("instance-0").serving
    assert ("stop", "instance-0") not in w.events
    assert not w.layout.rollout.exists()  # and the loop is told the roll-out is over


def test_a_replacement_that_makes_bad_audio_stops_the_roll_out_at_once(tmp_path):
    """Its warm-up failed the audio check: no waiting for the health loop to give up on it
    after --start-retries (or for --startup-timeout); the old instances keep serving."""
    w = world(tmp_path, instances=3, parked=1)
    w.bad_audio.add("instance-2")
    began = w.now
    with pytest.raises(ClusterError, match=r"surge roll-out stopped, 0 of 2 replaced \(none\)") as raised:
        surge_rollout(w.cluster(), ["instance-0", "instance-1"], [w.slots[2]])
    assert "instance-2 failed: it made bad audio (the warm-up synthesis made bad audio: " in str(raised.value)
    assert w.now - began < 10 * w.settings.probe_interval < w.settings.startup_timeout
    assert ("drain", "instance-2", "STOP") in w.events  # what it started is stopped
    assert all(w.read_status().instance(name).serving for name in ("instance-0", "instance-1"))
    assert not [e for e in w.events if e[0] in ("stop", "drain") and e[1] in ("instance-0", "instance-1")]
    assert not w.layout.rollout.exists()


def test_bad_audio_seen_before_the_roll_out_began_does_not_stop_it(tmp_path):
    """The health loop's record of an earlier run of the slot is not this start's."""
    w = world(tmp_path, instances=3, parked=1)
    w.programs["instance-2"].bad_seen = w.now - 100
    done = surge_rollout(w.cluster(), ["instance-0"], [w.slots[2]])
    assert done == ["instance-0 -> instance-2"]


# --- up on a running cluster ----------------------------------------------------------------


def applied(tmp_path, old: dict, new: dict, reload=(), parked: int = 0):
    """`up` with new settings on a running cluster whose render changed ``reload``'s programs."""
    w = world(tmp_path, instances=2 + parked, parked=parked, **old)
    w.reload_answer = ([], list(reload), [])
    c = w.cluster(dataclasses.replace(w.settings, **new))
    lifecycle.apply_rendered(c, (w.settings, w.slots), w.slots, code_changed=False, say=lambda line: None)
    return w


def test_credentials_go_on_before_nginx_listens_beyond_loopback(tmp_path):
    w = applied(tmp_path, {}, {"public": True}, reload=["instance-0", "instance-1"])
    nginx = first(w, "nginx")
    assert w.events[nginx] == ("nginx", "0.0.0.0")
    assert max(starts(w, "instance-0")[-1], starts(w, "instance-1")[-1]) < nginx  # the instances have them first


def test_nginx_back_on_loopback_comes_before_credentials_go(tmp_path):
    w = applied(tmp_path, {"public": True}, {"public": False}, reload=["instance-0", "instance-1"])
    nginx = first(w, "nginx")
    assert w.events[nginx] == ("nginx", "127.0.0.1")
    assert nginx < first(w, "drain", "instance-0")


def test_the_health_loop_restarts_before_any_instance_is_drained(tmp_path):
    w = applied(tmp_path, {}, {"max_requests": 100}, reload=["instance-0", "instance-1"])
    assert first(w, "stop", "health") < first(w, "start", "health") < first(w, "drain")


def test_changed_instances_are_replaced_one_at_a_time(tmp_path):
    w = applied(tmp_path, {}, {"max_requests": 100}, reload=["instance-0", "instance-1"])
    assert [e for e in w.events if e[0] == "drain"] == [
        ("drain", "instance-0", "HOLD"),
        ("drain", "instance-1", "HOLD"),
    ]
    assert min(w.serving_seen) >= 1
    assert all(i.serving for i in w.read_status().instances)


def test_parked_slots_take_over_from_removed_ones_first(tmp_path):
    """The plan no longer has instance-1's slot: parked instance-2 starts and serves before
    instance-1's program goes, and before the health loop restarts on the new slots."""
    w = world(tmp_path, instances=3, parked=1)
    w.reload_answer = ([], [], ["instance-1"])
    lifecycle.apply_rendered(w.cluster(), (w.settings, w.slots), w.slots[:1] + w.slots[2:], False, lambda line: None)
    took_over = starts(w, "instance-2")[0]
    assert took_over < first(w, "stop", "health") < first(w, "remove_group", "instance-1")
    assert w.serving_seen[first(w, "stop", "health") - 1 :] and min(w.serving_seen) >= 1


# --- waiting ------------------------------------------------------------------------------


def test_a_wait_for_instances_that_cannot_start_says_so(tmp_path):
    w = world(tmp_path, instances=2, parked=1)
    w.crashing.add("instance-1")
    w.start("instance-1")
    with pytest.raises(ClusterError, match="instance-1 could not start"):
        wait_serving(w.cluster(), ["instance-1"])


def test_an_instance_given_up_on_before_the_wait_but_after_its_start_fails_the_wait_at_once(tmp_path):
    """--stagger'd: the first wait saw the instance fail; the wait for all that follows must
    count that failure (it happened after the start), not wait out --startup-timeout."""
    w = world(tmp_path, instances=2, parked=1)
    started = w.now
    w.now += 20
    w.given_up["instance-1"] = w.now  # (started twice, never ready: stopped, given up on)
    w.health_step()
    w.now += 5
    before = w.now
    with pytest.raises(ClusterError, match="instance-1 could not start"):
        wait_serving(w.cluster(), ["instance-1"], since=started)
    assert w.now - before < 1  # (at once)


def test_a_wait_ends_only_once_supervisord_counts_nginx_running(tmp_path):
    """nginx answers /ping before its startsecs pass: `up` waits them out, so that `status`
    right after it finds nginx RUNNING, not "starting"."""
    w = world(tmp_path, instances=2, parked=1)
    w.start("instance-1")
    w.programs["nginx"].starting_for = LOAD_STEPS + 3
    current = wait_serving(w.cluster(), ["instance-1"])
    assert current.nginx["state"] == "RUNNING" and not current.problems
    assert w.programs["nginx"].starting_for == 0 and w.serving_seen[LOAD_STEPS] == 2


def test_settling_starts_parked_slots_up_to_the_count_asked(tmp_path):
    w = world(tmp_path, instances=3, parked=2)
    lifecycle.settle_count(w.cluster(), w.slots, dataclasses.replace(w.roles, serving=2))
    assert starts(w, "instance-1") and not starts(w, "instance-2")
    assert len(Slots.read(w.layout, w, w.slots).running) == 2
