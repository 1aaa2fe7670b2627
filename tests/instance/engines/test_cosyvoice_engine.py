"""The CosyVoice adapter against the contract fake of upstream (tests/fake_cosyvoice)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TESTS

pytest.importorskip("torch", reason="the contract fake yields torch tensors, like upstream")

from cosyvoice_lb.instance.engines import EngineError, SynthesisRequest  # noqa: E402
from cosyvoice_lb.instance.engines.cosyvoice import ENDOFPROMPT, CosyVoiceEngine, model_version, v2_prompt, v3_prompt  # noqa: E402

HERE = TESTS
ROOT = HERE / "fake_cosyvoice"
MODELS = HERE / "fake_models"
PROMPT = str(ROOT / "asset" / "zero_shot_prompt.wav")


@pytest.fixture(autouse=True)
def quick_load(monkeypatch):
    monkeypatch.setenv("FAKE_COSYVOICE_LOAD_SECONDS", "0")


def loaded(model: str, **flags) -> CosyVoiceEngine:
    engine = CosyVoiceEngine(model_dir=str(MODELS / model), cosyvoice_root=str(ROOT), **flags)
    engine.load()
    return engine


def audio(engine, **request) -> np.ndarray:
    return np.concatenate(list(engine.synthesize(SynthesisRequest(**request))))


def test_model_version_by_yaml_and_refusals(tmp_path):
    assert model_version(MODELS / "Fun-CosyVoice3-0.5B") == 3
    assert model_version(MODELS / "CosyVoice2-0.5B") == 2
    assert model_version(MODELS / "CosyVoice-300M-SFT") == 1
    both = tmp_path / "both"
    both.mkdir()
    (both / "cosyvoice.yaml").write_text("")
    (both / "cosyvoice3.yaml").write_text("")
    assert model_version(both) == 1  # upstream AutoModel checks cosyvoice.yaml first
    with pytest.raises(ValueError, match="not a local directory.*never lets an instance download"):
        model_version("FunAudioLLM/Fun-CosyVoice3-0.5B-2512")
    with pytest.raises(ValueError, match="has none of cosyvoice.yaml, cosyvoice2.yaml, cosyvoice3.yaml"):
        model_version(tmp_path)


def test_v3_prompt_format_is_upstreams_example():
    assert v3_prompt("zero_shot", "t", "transcript", "") == (
        "t",
        "You are a helpful assistant.<|endofprompt|>transcript",
        "",
    )
    assert v3_prompt("cross_lingual", "text", "", "") == ("You are a helpful assistant.<|endofprompt|>text", "", "")
    assert v3_prompt("instruct", "t", "", "请用广东话表达。") == (
        "t",
        "",
        "You are a helpful assistant. 请用广东话表达。<|endofprompt|>",
    )
    # what the user already formatted stays as it is
    assert v3_prompt("zero_shot", "t", f"custom{ENDOFPROMPT}x", "")[1] == f"custom{ENDOFPROMPT}x"
    assert v2_prompt("instruct", "t", "", "用四川话说这句话") == ("t", "", "用四川话说这句话<|endofprompt|>")
    assert v2_prompt("zero_shot", "t", "p", "") == ("t", "p", "")


def test_v3_every_mode_passes_upstreams_assertion():
    engine = loaded("Fun-CosyVoice3-0.5B")
    assert engine.version == 3 and engine.sample_rate == 24000
    assert engine.modes == ("zero_shot", "cross_lingual", "instruct") and engine.speakers() == []
    for mode, extra in (
        ("zero_shot", {"prompt_text": "希望你以后能够做的比我还好呦。"}),
        ("cross_lingual", {}),
        ("instruct", {"instruct_text": "Speak slowly."}),
    ):
        out = audio(engine, text="Hello there.", mode=mode, prompt_wav=PROMPT, **extra)
        assert out.dtype == np.float32 and out.ndim == 1 and out.size > 0.3 * 24000


def test_without_the_marker_upstream_would_refuse():
    engine = loaded("Fun-CosyVoice3-0.5B")
    with pytest.raises(AssertionError, match="endofprompt"):
        list(engine.model.inference_zero_shot("hi", "no marker here", PROMPT))


def test_seed_reproduces_and_speed_and_stream():
    engine = loaded("Fun-CosyVoice3-0.5B")
    one = audio(engine, text="Same words.", mode="cross_lingual", prompt_wav=PROMPT, seed=7)
    two = audio(engine, text="Same words.", mode="cross_lingual", prompt_wav=PROMPT, seed=7)
    other = audio(engine, text="Same words.", mode="cross_lingual", prompt_wav=PROMPT, seed=8)
    assert np.array_equal(one, two) and not np.array_equal(one, other)
    fast = audio(engine, text="Same words.", mode="cross_lingual", prompt_wav=PROMPT, speed=2.0)
    assert fast.size < 0.6 * one.size
    chunks = list(
        engine.synthesize(
            SynthesisRequest(text="Stream these words.", mode="cross_lingual", prompt_wav=PROMPT, stream=True)
        )
    )
    assert len(chunks) > 1


def test_every_stream_starts_with_the_first_chunk_size():
    # upstream doubles its chunk size on the model after each streamed chunk and never resets it
    engine = loaded("Fun-CosyVoice3-0.5B")
    for _ in range(3):
        list(
            engine.synthesize(
                SynthesisRequest(text="Stream these words.", mode="cross_lingual", prompt_wav=PROMPT, stream=True)
            )
        )
        assert engine.model.model.token_hop_len == 100  # where upstream leaves it
    assert engine.model.model.first_hops == [25, 25, 25]


def test_v2_and_v1_model_dirs():
    v2 = loaded("CosyVoice2-0.5B")
    assert v2.version == 2 and v2.modes == ("zero_shot", "cross_lingual", "instruct")
    assert audio(v2, text="hi", mode="instruct", instruct_text="用四川话说这句话", prompt_wav=PROMPT).size
    v1 = loaded("CosyVoice-300M-SFT")
    assert v1.version == 1 and v1.sample_rate == 22050
    assert v1.modes[0] == "sft" and v1.speakers() == ["中文女", "英文男"]
    assert audio(v1, text="hi").size  # default mode: the first built-in speaker
    assert audio(v1, text="hi", mode="sft", speaker="英文男").size
    assert audio(v1, text="hi", mode="instruct", instruct_text="happy").size  # v1's inference_instruct


@pytest.fixture
def vllm(monkeypatch):
    """A stand-in for vLLM that records its ModelRegistry calls (vLLM itself runs in the
    tests marked vllm: tests/integration/test_vllm_cluster.py)."""
    import sys
    import types

    registry = {}
    module = types.ModuleType("vllm")
    module.ModelRegistry = types.SimpleNamespace(
        register_model=registry.__setitem__, get_supported_archs=lambda: list(registry)
    )
    monkeypatch.setitem(sys.modules, "vllm", module)
    return registry


def test_vllm_learns_cosyvoice2s_architecture_and_cosyvoice3_needs_none(vllm, monkeypatch):
    """Upstream exports a CosyVoice2 LLM as CosyVoice2ForCausalLM (registered from upstream's
    module), a CosyVoice3 one as vLLM's own Qwen2ForCausalLM: nothing to import or register."""
    import sys

    monkeypatch.delitem(sys.modules, "cosyvoice.vllm.cosyvoice2", raising=False)
    engine = loaded("Fun-CosyVoice3-0.5B", load_vllm=True, fp16=True)
    assert engine.model.options == {"load_trt": False, "load_vllm": True, "fp16": True, "trt_concurrent": 1}
    assert vllm == {} and "cosyvoice.vllm.cosyvoice2" not in sys.modules
    loaded("CosyVoice2-0.5B", load_vllm=True)
    assert vllm["CosyVoice2ForCausalLM"].__module__ == "cosyvoice.vllm.cosyvoice2"


def test_upstreams_cosyvoice2_module_loads_with_the_union_it_forgets(tmp_path, monkeypatch):
    """Upstream's cosyvoice/vllm/cosyvoice2.py annotates with Union and imports only
    Optional: imported as it is, defining its class raises NameError on vLLM >= 0.11."""
    import sys

    from cosyvoice_lb.instance.engines.upstream_vllm import _load_with_union

    package = tmp_path / "forgetful"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(
        "from typing import Optional\n\n\nclass Model:\n    def forward(self, x: Optional[int]) -> Union[int, str]:\n"
        "        return x\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(NameError, match="Union"):
        __import__("forgetful.model")
    module = _load_with_union("forgetful.model")
    assert module.Model().forward(3) == 3 and sys.modules["forgetful.model"] is module


def test_vllm_missing_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(EngineError, match="--load-vllm needs vLLM"):
        loaded("Fun-CosyVoice3-0.5B", load_vllm=True)


def test_flags_reach_the_model_and_unknown_ones_are_refused():
    engine = loaded("Fun-CosyVoice3-0.5B", load_trt=True)
    assert engine.model.options["load_trt"] is True
    with pytest.raises(EngineError, match="--load-vllm is not supported by CosyVoice models"):
        loaded("CosyVoice-300M-SFT", load_vllm=True)


def test_the_bundled_prompt_is_found_without_cosyvoice_root(monkeypatch):
    import sys

    engine = loaded("Fun-CosyVoice3-0.5B")  # imports the fake's cosyvoice package
    engine.cosyvoice_root = ""
    assert engine.default_prompt() == (str(ROOT / "asset" / "zero_shot_prompt.wav"), "希望你以后能够做的比我还好呦。")
    assert "cosyvoice" in sys.modules


def test_a_missing_checkout_is_a_clear_error(tmp_path):
    import sys

    for name in [m for m in sys.modules if m == "cosyvoice" or m.startswith("cosyvoice.")]:
        del sys.modules[name]
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if "fake_cosyvoice" not in p]
    try:
        engine = CosyVoiceEngine(model_dir=str(MODELS / "Fun-CosyVoice3-0.5B"), cosyvoice_root=str(tmp_path))
        with pytest.raises(EngineError, match="--cosyvoice-root"):
            engine.load()
    finally:
        sys.path[:] = saved


# --- saved voices through upstream's speaker cache ---------------------------------------------


def test_a_saved_voice_is_cached_once_then_spoken_from_the_cache():
    engine = loaded("Fun-CosyVoice3-0.5B")
    frontend = engine.model.frontend
    voice = dict(prompt_wav=PROMPT, prompt_text="希望你以后能够做的比我还好呦。", voice_id="voice_" + "a" * 24)
    for _ in range(3):
        assert audio(engine, text="你好。", mode="zero_shot", **voice).size > 0
    assert audio(engine, text="Hello.", mode="cross_lingual", **voice).size > 0
    assert frontend.extractions == 1  # the prompt's features were extracted once, at its first use
    cached = frontend.spk2info[voice["voice_id"]]["prompt_text"]
    assert cached == "You are a helpful assistant.<|endofprompt|>希望你以后能够做的比我还好呦。"  # v3's form
    # an upload is extracted at every request
    audio(engine, text="你好。", mode="zero_shot", prompt_wav=PROMPT, prompt_text="希望你以后能够做的比我还好呦。")
    assert frontend.extractions == 2
    assert engine.speakers() == []  # a cached voice is no built-in speaker


def test_a_saved_voice_with_instructions_follows_them():
    # upstream's instruct2 with a cached speaker id speaks its prompt text instead of the instruction
    engine = loaded("Fun-CosyVoice3-0.5B")
    voice = dict(prompt_wav=PROMPT, prompt_text="希望你以后能够做的比我还好呦。", voice_id="voice_" + "b" * 24)
    audio(engine, text="你好。", mode="instruct", instruct_text="Speak slowly.", **voice)
    assert engine.model.last_instruct == "You are a helpful assistant. Speak slowly.<|endofprompt|>"


def test_a_deleted_voice_leaves_the_cache():
    engine = loaded("Fun-CosyVoice3-0.5B")
    kept, gone = "voice_" + "c" * 24, "voice_" + "d" * 24
    for voice_id in (kept, gone):
        audio(engine, text="你好。", mode="zero_shot", prompt_wav=PROMPT, prompt_text="好。", voice_id=voice_id)
    engine.retain_voices([kept])
    assert set(engine.cached) == {kept} and gone not in engine.model.frontend.spk2info
