"""Upstream CosyVoice's own code beside the contract fake: one probe (tests/upstream/probe.py)
runs each checkout in the same Python, and what the engine adapter relies on must agree.

Upstream runs on the small CosyVoice3 model tests/upstream/build_model.py makes (its audio
is noise; its code paths are upstream's). Where the two differ on purpose, the test says so.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.upstream]

FAKE = ROOT / "tests" / "fake_cosyvoice"
FAKE_V3 = ROOT / "tests" / "fake_models" / "Fun-CosyVoice3-0.5B"
PROMPT = FAKE / "asset" / "zero_shot_prompt.wav"  # 4.4 s at 16 kHz
PROBE = ROOT / "tests" / "upstream" / "probe.py"
OUTPUTS = ("zero_shot", "zero_shot_stream", "cross_lingual", "instruct2", "cached_zero_shot", "cached_cross_lingual")


def probe(python, root, model_dir) -> dict:
    done = subprocess.run(
        [
            str(python),
            str(PROBE),
            "--cosyvoice-root",
            str(root),
            "--model-dir",
            str(model_dir),
            "--prompt",
            str(PROMPT),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def facts(upstream):
    return {
        "upstream": probe(upstream.python, upstream.root, upstream.model_dir),
        "fake": probe(upstream.python, FAKE, FAKE_V3),
    }


def test_both_load_a_cosyvoice3_model_with_the_same_classes_and_signatures(facts):
    real, fake = facts["upstream"], facts["fake"]
    assert real["class"] == "CosyVoice3" and real["sample_rate"] == 24000
    for key in ("class", "sample_rate", "signatures", "speakers"):
        assert fake[key] == real[key], key
    assert real["speakers"] == []  # a CosyVoice3 release has no built-in speakers


@pytest.mark.parametrize("call", OUTPUTS)
def test_every_call_yields_what_the_adapter_reads(facts, call):
    real, fake = facts["upstream"][call], facts["fake"][call]
    assert real["keys"] == ["tts_speech"] and real["types"] == ["Tensor"] and real["dtypes"] == ["torch.float32"]
    assert real["shapes"] == ["2d, 1 row(s)"] and real["samples"] > 0 and real["finite"] and real["within_one"]
    same = ("keys", "types", "dtypes", "shapes", "finite", "within_one")
    assert {k: fake[k] for k in same} == {k: real[k] for k in same}
    if call.endswith("_stream"):
        assert real["items"] > 1 and fake["items"] > 1  # chunks, not one piece
    else:
        assert real["items"] == fake["items"] == 1  # one sentence: one piece


@pytest.mark.parametrize(
    "key",
    [
        "same_seed_same_audio",
        "other_seed_other_audio",
        "speed_2_length_ratio",
        "stream_with_speed",
        "punctuation_only",
        "punctuation_only_cross_lingual",
        "prompt_8khz",
        "prompt_31s",
        "add_zero_shot_spk",
        "speakers_after_add",
        "unknown_cached_id",
    ],
)
def test_seeds_speed_prompts_and_the_speaker_cache_behave_alike(facts, key):
    assert facts["fake"][key] == facts["upstream"][key]


def test_the_known_differences_are_the_only_ones(facts):
    real, fake = facts["upstream"], facts["fake"]
    # A v3 text without <|endofprompt|>: upstream's LLM thread fails on it; the caller sees an
    # unrelated error, or, streaming, waits forever. The fake fails at once. The adapter
    # always adds the marker (engines/cosyvoice.py v3_prompt), so neither is ever reached.
    assert real["no_endofprompt"].startswith("RuntimeError") and real["no_endofprompt_stream_hangs"] is True
    assert fake["no_endofprompt"].startswith("AssertionError: <|endofprompt|> not detected")
    assert fake["no_endofprompt_stream_hangs"] is False
    assert real["speed_2_length_ratio"] == 0.5 and real["punctuation_only"] == 0
    assert real["punctuation_only_cross_lingual"] == 1  # spoken: the API refuses such a text (422)
    assert real["stream_with_speed"] == "ok"  # streaming ignores speed; the API refuses the pair
    for side in (real, fake):  # doubled after each chunk but the last, up to 4x, and left there
        hop = side["stream_chunk_tokens"]
        assert hop["loaded"] == 25 and hop["after"] == min(100, 25 * 2 ** (hop["chunks"] - 1)), hop
    differing = (
        {k for k in real if real[k] != fake[k]}
        - set(OUTPUTS)
        - {"no_endofprompt", "no_endofprompt_stream_hangs", "stream_chunk_tokens"}
    )
    assert differing == set()
