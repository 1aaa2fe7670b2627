"""The state dir's small files between the launcher and the health loop
(cosyvoice_lb/launcher/state/markers.py): versioned, and 0.1's still read."""

from __future__ import annotations

import json

import pytest

from cosyvoice_lb.launcher.state import markers
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.markers import DrainAction


@pytest.fixture
def layout(tmp_path) -> Layout:
    layout = Layout(tmp_path)
    layout.run.mkdir()
    return layout


@pytest.mark.parametrize("action", list(DrainAction))
def test_a_drain_request_reads_back_and_carries_its_version(layout, action):
    markers.ask_drain(layout, "instance-0", action)
    assert json.loads(layout.drain_request("instance-0").read_text()) == {"version": 1, "action": action.value}
    assert markers.read_drain(layout, "instance-0") is action
    markers.answer_drain(layout, "instance-0")
    assert markers.read_drain(layout, "instance-0") is None


@pytest.mark.parametrize(
    "text, action", [("HOLD\n", DrainAction.HOLD), ("", DrainAction.TERM), ("what?", DrainAction.TERM)]
)
def test_a_drain_request_of_0_1_or_a_broken_one(layout, text, action):
    layout.drain_request("instance-0").write_text(text)  # (0.1 wrote the bare action)
    assert markers.read_drain(layout, "instance-0") is action


def test_a_roll_out_marker_and_a_drain_by_hand_carry_their_version(layout):
    markers.start_rollout(layout, 2)
    assert json.loads(layout.rollout.read_text())["version"] == 1 and markers.rollout_surge(layout) == 2
    markers.drain_by_hand(layout, "instance-1")
    assert json.loads(layout.drained("instance-1").read_text())["version"] == 1
    assert markers.drained_by_hand(layout, "instance-1")
