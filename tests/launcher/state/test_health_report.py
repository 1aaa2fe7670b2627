"""health.json (cosyvoice_lb/launcher/state/health_report.py): one writer, one typed reader,
a format version, and the files 0.1 wrote still read."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cosyvoice_lb.launcher.state.health_report import (
    VERSION,
    HealthReport,
    OnPurpose,
    Track,
    read_report,
    write_report,
)
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.markers import DrainAction


def test_a_report_reads_back_as_it_was_written(tmp_path):
    layout = Layout(tmp_path)
    layout.run.mkdir()
    tracks = {
        "instance-0": Track(in_rotation=True, pid=42, ordered={"hang": 1}),
        "instance-1": Track(on_purpose=OnPurpose.SPARE, drain_signal=DrainAction.HOLD, signalled_at=5.0),
    }
    written = HealthReport(updated=100.0, tracks=tracks, probe_seconds={"instance-0": 0.01}, pool={"wanted": 1})
    write_report(layout, written)
    assert json.loads(layout.health_json.read_text())["version"] == VERSION
    assert read_report(layout) == written
    assert read_report(layout).track("instance-1").on_purpose is OnPurpose.SPARE  # a state, not words to compare
    assert read_report(layout).out_of_rotation == {"instance-1"}


def test_a_report_of_0_1_reads_as_version_0_with_its_fields(tmp_path):
    layout = Layout(tmp_path)
    layout.run.mkdir()
    old = {
        "updated": 50.0,
        "instances": {"instance-0": {"in_rotation": False, "pid": 7, "reason": OnPurpose.PARKED.value, "gone": 1}},
        "probe_seconds": {},
        "pool": {"wanted": 2},
    }
    layout.health_json.write_text(json.dumps(old))
    report = read_report(layout)
    assert report.version == 0 and report.updated == 50.0 and report.pool == {"wanted": 2}
    assert report.track("instance-0") == Track(pid=7, on_purpose=OnPurpose.PARKED)  # (an unknown key ignored)


def test_no_report_or_a_broken_one_is_an_empty_report(tmp_path):
    layout = Layout(tmp_path)
    assert read_report(layout) == HealthReport(version=VERSION)
    layout.run.mkdir()
    layout.health_json.write_text("{not json")
    assert read_report(layout).updated == 0.0 and read_report(layout).track("x") == Track()


# health.json as the version before its states were typed wrote it, byte for byte
WRITTEN_BEFORE = """{
  "version": 1,
  "updated": 1700000000.5,
  "instances": {
    "instance-1": {
      "in_rotation": false,
      "fails": 0,
      "goods": 0,
      "pid": 4343,
      "ever_ready": true,
      "reason": "warm spare: ready, enters rotation when an instance is taken out",
      "restarts": 0,
      "recycle_at": 0,
      "draining_since": 0.0,
      "drain_signal": "HOLD",
      "signalled_at": 5.0,
      "ready_starts": 0,
      "failed": "",
      "failed_at": 0.0,
      "ordered": {},
      "crashes": 0,
      "bad_audio": "",
      "bad_audio_at": 0.0
    },
    "instance-2": {
      "in_rotation": false,
      "fails": 0,
      "goods": 0,
      "pid": 0,
      "ever_ready": false,
      "reason": "failed: supervisord gave up starting it",
      "restarts": 0,
      "recycle_at": 0,
      "draining_since": 0.0,
      "drain_signal": "",
      "signalled_at": 0.0,
      "ready_starts": 0,
      "failed": "failed: supervisord gave up starting it",
      "failed_at": 1699999999.0,
      "ordered": {},
      "crashes": 0,
      "bad_audio": "",
      "bad_audio_at": 0.0
    }
  },
  "probe_seconds": {
    "instance-1": 0.012
  },
  "pool": {
    "wanted": 1,
    "in_rotation": 1,
    "spares": 1
  }
}
"""


def test_a_report_written_before_reads_with_its_states_and_is_written_again_byte_for_byte(tmp_path):
    layout = Layout(tmp_path)
    layout.run.mkdir()
    layout.health_json.write_text(WRITTEN_BEFORE)
    report = read_report(layout)
    spare, given_up = report.track("instance-1"), report.track("instance-2")
    assert (spare.on_purpose, spare.reason) == (OnPurpose.SPARE, "") and spare.drain_signal is DrainAction.HOLD
    assert (given_up.on_purpose, given_up.reason) == (None, "failed: supervisord gave up starting it")
    layout.health_json.unlink()
    write_report(layout, report)
    assert layout.health_json.read_text() == WRITTEN_BEFORE


SPARE_WORDS = f'"reason": "{OnPurpose.SPARE.value}"'
GIVEN_UP_WORDS = '"reason": "failed: supervisord gave up starting it"'


def test_a_new_reason_replaces_the_last_and_is_written_as_before(tmp_path):
    """On purpose, then words for people, and the other way round: one at a time, and
    health.json keeps either as before, under its one "reason"."""
    layout = Layout(tmp_path)
    layout.run.mkdir()
    layout.health_json.write_text(WRITTEN_BEFORE)
    report = read_report(layout)
    spare, given_up = report.track("instance-1"), report.track("instance-2")
    with pytest.raises(ValueError, match="one at a time"):
        dataclasses.replace(spare, reason="process exited")  # (a setter that forgot to clear the other)

    exited = dataclasses.replace(spare, on_purpose=None, reason="process exited")
    parked = dataclasses.replace(given_up, on_purpose=OnPurpose.PARKED, reason="")
    assert (exited.on_purpose, exited.reason_words) == (None, "process exited")
    assert (parked.on_purpose, parked.reason_words) == (OnPurpose.PARKED, OnPurpose.PARKED.value)
    write_report(layout, dataclasses.replace(report, tracks={"instance-1": exited, "instance-2": parked}))
    expected = WRITTEN_BEFORE.replace(SPARE_WORDS, '"reason": "process exited"')
    expected = expected.replace(GIVEN_UP_WORDS, f'"reason": "{OnPurpose.PARKED.value}"')
    assert expected.count('"reason": ') == 2 and SPARE_WORDS not in expected and GIVEN_UP_WORDS not in expected
    assert layout.health_json.read_text() == expected
    again = read_report(layout)
    assert (again.track("instance-1").on_purpose, again.track("instance-2").on_purpose) == (None, OnPurpose.PARKED)
