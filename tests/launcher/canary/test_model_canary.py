"""A model roll-out's canary, its pure parts: what it may change (``canary.state``) and the
comparison of both sides with its verdict (``canary.compare``)."""

from __future__ import annotations

import pytest

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.canary.compare import Side, compare, percentile, rows
from cosyvoice_lb.launcher.state import canary as state
from cosyvoice_lb.launcher.state.canary import Canary, CanaryError, Thresholds
from cosyvoice_lb.launcher.state.layout import Layout

# --- what a canary may change -------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("load_vllm", "true", True),
        ("load_vllm", "off", False),
        ("asr_max_error", "0.4", 0.4),
        ("max_chars", "300", 300),
        ("openai_voices", "alloy=rms", "alloy=rms"),
        ("engine", "flite", "flite"),
        ("python", "/opt/env/bin/python", "/opt/env/bin/python"),
    ],
)
def test_set_values_are_typed_by_their_declaration(name, text, value):
    assert state.parse_value(name, text) == value


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("port", "9000", "not a setting an instance is started with"),  # nginx's: not the canary's to change
        ("load_vllm", "maybe", "a switch takes true or false"),
        ("max_chars", "many", "not a int"),
        ("engine", "festival", "one of"),
    ],
)
def test_set_refuses_what_it_cannot_take(name, text, said):
    with pytest.raises(CanaryError, match=said):
        state.parse_value(name, text)


def test_a_canary_must_change_something():
    serving = Settings(engine="flite")
    with pytest.raises(CanaryError, match="would run what the serving instances run"):
        state.checked_changes(serving, {"engine": "flite"})


def test_a_canary_whose_settings_cannot_work_is_refused():
    with pytest.raises(CanaryError, match="cannot work"):
        state.checked_changes(Settings(engine="flite"), {"asr_sample": 2.0})


def test_both_sides_are_heard_by_the_same_recogniser():
    # flite's auto recogniser is pocketsphinx; a canary on another engine would pick none
    assert state.checked_changes(Settings(engine="flite"), {"engine": "simulated"}) == {
        "engine": "simulated",
        "asr": "pocketsphinx",
    }
    with_model = Settings(engine="cosyvoice3", model_dir="/m", asr_model="/asr")
    assert state.checked_changes(with_model, {"model_dir": "/new"})["asr"] == "sherpa-onnx"
    named = state.checked_changes(Settings(engine="flite"), {"engine": "espeak", "asr": "off"})
    assert named["asr"] == "off"  # (the canary's own choice stands)
    assert "asr" not in state.checked_changes(Settings(engine="espeak"), {"max_chars": 100})


def test_the_canary_file_round_trips_and_a_broken_one_is_none(tmp_path):
    layout = Layout(tmp_path)
    layout.run.mkdir()
    assert state.read(layout) is None
    canary = Canary(("instance-2",), {"model_dir": "/new", "load_vllm": True}, "share", 5.0, 12.5, Thresholds(30))
    state.write(layout, canary)
    assert state.read(layout) == canary
    assert oct(layout.canary_json.stat().st_mode & 0o777) == "0o600"
    assert state.names(layout) == {"instance-2"}
    assert canary.settings_for(Settings(model_dir="/old")).model_dir == "/new"
    assert "instance-2 on --load-vllm True, --model-dir /new (share 5%)" == canary.describe()
    assert state.displaced(layout, {"instance-2", "instance-3"}) is None  # still parked: kept
    assert state.displaced(layout, {"instance-3"}) == canary and state.read(layout) is None
    layout.canary_json.write_text("{not json")
    assert state.read(layout) is None and state.names(layout) == frozenset()


# --- the comparison -----------------------------------------------------------------------


def sample(outcome="ok", first=0.1, total=1.0, error=0.1, similarity=None, at=100.0) -> dict:
    return {
        "at": at,
        "outcome": outcome,
        "first_chunk": first,
        "total": total,
        "error": error,
        "similarity": similarity,
        "unchecked": "",
    }


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99 and percentile(values, 100) == 100
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


def test_a_side_counts_outcomes_and_measures_answered_requests_only():
    side = Side.of(
        [sample(total=t) for t in (1.0, 2.0, 3.0)]
        + [sample("failed", total=9.0), sample("bad_audio"), sample("refused"), sample("invalid"), sample(at=1.0)],
        since=50.0,
    )
    assert (side.requests, side.ok, side.failed, side.bad_audio, side.refused, side.invalid) == (7, 3, 1, 1, 1, 1)
    assert side.judged == 5 and side.failure_ratio == 0.2 and side.bad_audio_ratio == 0.2
    assert side.total_p50 == 2.0 and side.total_p99 == 3.0  # (the failed one's 9 s is no latency)
    assert side.checked == 3 and side.error_mean == pytest.approx(0.1)


def many(n=30, **kwargs) -> list[dict]:
    return [sample(**kwargs) for _ in range(n)]


LIMITS = Thresholds(min_requests=20)


def test_a_model_as_good_as_the_serving_one_passes():
    found = compare(Side.of(many(error=0.1)), Side.of(many(error=0.12)), LIMITS)
    assert found.verdict == "pass", found.findings
    assert {f.name for f in found.findings} == {"failures", "bad audio", "speech check", "first-chunk p99", "total p99"}


@pytest.mark.parametrize(
    ("canary", "failing"),
    [
        (many(error=0.95), "speech check"),  # says something else (or a tone: nothing heard)
        (many(25) + many(5, outcome="bad_audio"), "bad audio"),
        (many(25) + many(5, outcome="failed"), "failures"),
        (many(total=2.0), "total p99"),
        (many(first=0.3), "first-chunk p99"),
        (many(error=None), "speech check"),  # unheard is never a pass
    ],
)
def test_a_worse_model_fails_on_the_figure_that_is_worse(canary, failing):
    found = compare(Side.of(many()), Side.of(canary), LIMITS)
    assert found.verdict == "fail"
    assert [f.name for f in found.failed] == [failing]


def test_too_few_answers_is_waiting_not_a_pass():
    found = compare(Side.of(many(30)), Side.of(many(5)), LIMITS)
    assert found.verdict == "waiting"
    assert found.failed[0].name == "answers" and "canary 5" in found.failed[0].said


def test_speaker_similarity_is_judged_when_both_sides_have_it():
    serving = Side.of(many(similarity=0.8))
    assert compare(serving, Side.of(many(similarity=0.75)), LIMITS).verdict == "pass"
    found = compare(serving, Side.of(many(similarity=0.5)), LIMITS)
    assert [f.name for f in found.failed] == ["speaker similarity"]


def test_the_table_has_both_sides_side_by_side():
    table = dict((name, (s, c)) for name, s, c in rows(compare(Side.of(many()), Side.of(many(total=2.0)), LIMITS)))
    assert table["total p99"] == ("1000 ms", "2000 ms")
    assert table["requests"] == ("30", "30") and table["speaker similarity"] == ("—", "—")


def test_latency_is_judged_from_the_engines_start_and_the_queue_shown_apart():
    """One canary alone queues where a pool balanced by least connections would not: no
    finding about its model."""
    queued = [{**s, "queued": 0.9, "first_chunk": 1.0, "total": 1.9} for s in many()]
    side = Side.of(queued)
    assert side.first_chunk_p99 == pytest.approx(0.1) and side.total_p99 == pytest.approx(1.0)
    assert side.queued_p50 == pytest.approx(0.9)
    assert compare(Side.of(many()), side, LIMITS).verdict == "pass"
    table = {name: (s, c) for name, s, c in rows(compare(Side.of(many()), side, LIMITS))}
    assert table["queue wait p50 (not judged)"] == ("0 ms", "900 ms")


def test_too_few_answers_heard_is_waiting_and_none_heard_a_failure():
    heard_few = many(25, error=None) + many(5)
    found = compare(Side.of(many(30)), Side.of(heard_few), LIMITS)
    assert found.verdict == "waiting" and found.failed[0].name == "answers heard"
    assert compare(Side.of(many(30)), Side.of(many(30, error=None)), LIMITS).verdict == "fail"


def test_a_canary_is_not_restarted_by_name(tmp_path):
    from cosyvoice_lb.launcher.errors import ClusterError

    layout = Layout(tmp_path)
    layout.run.mkdir()
    state.not_restarted(layout, ["instance-2"])  # (no canary: nothing refused)
    state.write(layout, Canary(("instance-2",), {"engine": "simulated"}))
    state.not_restarted(layout, None)  # (--all leaves it out)
    state.not_restarted(layout, ["instance-0"])
    with pytest.raises(ClusterError, match="canary abort"):
        state.not_restarted(layout, ["instance-0", "instance-2"])
