"""The flow and HiFT of concurrent syntheses batched over upstream's own modules
(instance/engines/upstream_batch.py), on upstream's code with the small model: whole
utterances and the chunks of streams, of five lengths, run one at a time on upstream's own
modules, then all at once through the batchers (tests/upstream/batching_probe.py).

Each batched result is its lone one up to the rounding of batched arithmetic: the same
length, and no sample further than 1e-5 from it (measured: 1.2e-7, on audio peaking near
0.09). The groups really form, and a flow whose estimator is not a torch module (TensorRT's)
is refused with the reason.
"""

from __future__ import annotations

import pytest
from conftest import ROOT
from upstream_support import probe

pytestmark = [pytest.mark.integration, pytest.mark.upstream]

PROBE = ROOT / "tests" / "upstream" / "batching_probe.py"
PROMPT = ROOT / "tests" / "fake_cosyvoice" / "asset" / "zero_shot_prompt.wav"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def facts(upstream):
    return probe(upstream, PROBE, "--model-dir", str(upstream.model_dir), "--prompt", str(PROMPT), timeout=600)


def test_the_batchers_are_installed_on_upstreams_model_at_the_pinned_commit(facts):
    assert facts["installed"] == ""


def test_each_batched_result_is_its_lone_one(facts):
    assert facts["calls"] >= 15 and facts["same_length"]
    assert facts["max_diff"] <= TOLERANCE, facts
    assert facts["peak"] > 100 * TOLERANCE  # (the audio is not silence: the bound means something)


def test_syntheses_really_shared_runs_of_the_flow_and_hift(facts):
    assert max(facts["sizes"]["flow"]) >= 3 and max(facts["sizes"]["hift"]) >= 3, facts["sizes"]
    assert sum(facts["sizes"]["flow"]) == sum(facts["sizes"]["hift"]) == facts["calls"]


def test_a_flow_tensorrt_runs_keeps_the_per_utterance_path(facts):
    assert "not a torch module" in facts["trt_problem"]
