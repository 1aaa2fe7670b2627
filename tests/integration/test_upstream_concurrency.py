"""Several syntheses at once in one model, on upstream's own code (the small model): the
engine's layer over upstream's model (instance/engines/upstream_tts.py) gives each stream
its own chunk schedule, never crosses outputs, keeps saved voices and seeds right, hands
chunks over without upstream's poll, and falls back to upstream's own path, with one
warning, when upstream's internals are not the shape it knows.

One probe (tests/upstream/concurrency_probe.py) runs it all in upstream's Python; a greedy
copy of the small model (top-1 sampling) makes a synthesis a function of its input, so
"the same alone and beside others" is checked sample for sample.
"""

from __future__ import annotations

import numpy as np
import pytest
import soundfile
from conftest import ROOT
from upstream_support import probe

pytestmark = [pytest.mark.integration, pytest.mark.upstream]

PROBE = ROOT / "tests" / "upstream" / "concurrency_probe.py"
PROMPT = ROOT / "tests" / "fake_cosyvoice" / "asset" / "zero_shot_prompt.wav"


def greedy_copy(model_dir, where):
    """The model with greedy sampling: top_k 1, and no repetition fallback (tau_r above 1)."""
    where.mkdir()
    for item in model_dir.iterdir():
        if item.name != "cosyvoice3.yaml":
            (where / item.name).symlink_to(item)
    yaml = (model_dir / "cosyvoice3.yaml").read_text()
    assert "top_k: 25" in yaml and "tau_r: 0.1" in yaml, "the small model's sampling changed: update greedy_copy"
    (where / "cosyvoice3.yaml").write_text(yaml.replace("top_k: 25", "top_k: 1").replace("tau_r: 0.1", "tau_r: 1.1"))
    return where


@pytest.fixture(scope="module")
def facts(upstream, tmp_path_factory):
    here = tmp_path_factory.mktemp("concurrency")
    other = here / "other.wav"
    t = np.arange(16000 * 4) / 16000
    soundfile.write(other, (0.3 * np.sign(np.sin(2 * np.pi * 120 * t))).astype(np.float32), 16000)
    greedy = greedy_copy(upstream.model_dir, here / "greedy")
    return probe(
        upstream,
        PROBE,
        *("--model-dir", str(upstream.model_dir), "--greedy-dir", str(greedy)),
        *("--prompt", str(PROMPT), "--other-prompt", str(other)),
    )


def test_the_layer_runs_upstreams_model_at_the_commit_the_tests_pin(facts):
    assert facts["own_path"] == ""


def test_each_stream_keeps_its_own_chunk_schedule_beside_others(facts):
    alone, together = facts["chunk_sizes_alone"], facts["chunk_sizes_together"]
    assert together == alone
    # upstream's schedule: a first hop of 25 tokens (+ the prompt's pad), then doubled, so
    # every stream's second chunk is longer than its first, beside others too
    assert all(len(s) >= 2 and s[1] > s[0] for s in together if len(s) > 2)
    assert len({s[0] for s in together}) == 1


def test_outputs_never_cross(facts):
    assert facts["repeat_same"], "greedy synthesis is not repeatable: the comparison below means nothing"
    assert facts["streams_same_together"] == [True, True, True]
    assert facts["whole_same_together"] == [True, True]


def test_saved_voices_speak_from_the_cache_beside_each_other(facts):
    assert facts["voices_differ"]
    assert facts["voices_same_together"] == [True, True]
    assert facts["cached"] == ["voice_a", "voice_b"]


def test_a_seeded_request_gives_the_same_audio_alone_or_beside_others(facts):
    assert facts["seeded_repeat_same"] and facts["seeded_same_beside_others"]


def test_chunks_are_handed_over_without_upstreams_poll(facts):
    assert facts["poll"] == "ok"


def test_a_failing_llm_thread_fails_the_synthesis_instead_of_hanging_it(facts):
    assert facts["llm_failure"] == "raised: the LLM broke"


def test_a_reader_that_leaves_frees_its_state_and_its_llm_thread(facts):
    assert facts["left_early"] == {"state_left": 0, "threads_left": 0}


def test_another_shape_of_upstream_falls_back_to_its_own_path_with_one_warning(facts):
    fallback = facts["fallback"]
    assert "token2wav() takes no" in fallback["own_path"]
    assert len(fallback["warnings"]) == 1 and "upstream's own tts runs it" in fallback["warnings"][0]
    assert fallback["spoke"] == [True, True]
