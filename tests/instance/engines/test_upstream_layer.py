"""The layer over upstream's model, as far as it runs without upstream: the shape check that
decides between it and upstream's own path, and the turns that run seeded requests alone.
(On upstream's own code: tests/integration/test_upstream_concurrency.py.)"""

from __future__ import annotations

import sys
import threading
import types

import numpy as np
import pytest

from cosyvoice_lb.instance.engines.turns import Turns
from cosyvoice_lb.instance.engines.upstream_tts import Run, Stopped, Tokens, install, shape_problem


def model_shaped_like_upstream():
    """An object with the attributes and signatures of upstream ace7c47's CosyVoice3Model."""

    def llm_job(text, prompt_text, llm_prompt_speech_token, llm_embedding, uuid): ...
    def vc_job(source_speech_token, uuid): ...
    def token2wav(
        token, prompt_token, prompt_feat, embedding, token_offset, uuid, stream=False, finalize=False, speed=1.0
    ): ...  # noqa: E501
    def tts(text=None, flow_embedding=None, llm_embedding=None, prompt_text=None, llm_prompt_speech_token=None,
            flow_prompt_speech_token=None, prompt_speech_feat=None, source_speech_token=None, stream=False, speed=1.0,
            **kwargs): ...  # fmt: skip

    return types.SimpleNamespace(
        llm_job=llm_job,
        vc_job=vc_job,
        token2wav=token2wav,
        tts=tts,
        token_hop_len=25,
        token_max_hop_len=100,
        stream_scale_factor=2,
        tts_speech_token_dict={},
        llm_end_dict={},
        hift_cache_dict={},
        lock=threading.Lock(),
        flow=types.SimpleNamespace(pre_lookahead_len=3, token_mel_ratio=2),
    )


def test_upstreams_shape_is_known_and_the_layer_replaces_tts_on_that_object_only():
    model = model_shaped_like_upstream()
    original = model.tts
    assert shape_problem(model) == ""
    assert install(model) == ""
    assert model.tts is not original


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda m: delattr(m, "llm_job"), "the model has no llm_job()"),
        (lambda m: setattr(m, "token2wav", lambda token, uuid, finalize=False: None), "token2wav() takes no"),
        (lambda m: setattr(m, "token_hop_len", None), "the model has no number token_hop_len"),
        (lambda m: setattr(m, "stream_scale_factor", True), "the model has no number stream_scale_factor"),
        (lambda m: setattr(m, "hift_cache_dict", []), "the model has no dict hift_cache_dict"),
        (lambda m: setattr(m, "lock", None), "the model has no lock"),
        (lambda m: delattr(m.flow, "pre_lookahead_len"), "the model's flow has no number pre_lookahead_len"),
    ],
)
def test_another_shape_is_named_and_nothing_is_installed(change, problem):
    model = model_shaped_like_upstream()
    change(model)
    original = getattr(model, "tts", None)
    assert problem in shape_problem(model)
    assert problem in install(model)
    assert getattr(model, "tts", None) is original


def test_tokens_wake_the_reader_and_a_stopped_run_ends_its_producer():
    run = Run()
    tokens = Tokens(run.ready)
    got: list[list] = []
    reader = threading.Thread(target=lambda: got.append(list(run.wait(lambda: tokens, 3))))
    reader.start()
    for token in (5, 6, 7):
        tokens.append(token)
    reader.join(10)
    assert got == [[5, 6, 7]]
    tokens.stopped = True
    with pytest.raises(Stopped):
        tokens.append(8)
    assert list(tokens) == [5, 6, 7]


def test_while_held_the_llm_thread_waits_at_its_next_token_and_a_stop_ends_it_there():
    run = Run()
    tokens = Tokens(run.ready)
    made = threading.Event()
    outcome: list = []

    def llm(count: int) -> None:
        try:
            for token in range(count):
                tokens.append(token)
            made.set()
        except Stopped:
            outcome.append("stopped")

    with tokens.holding():
        producer = threading.Thread(target=llm, args=(3,))
        producer.start()
        assert not made.wait(0.1) and list(tokens) == []  # (held at its first token)
    producer.join(5)
    assert made.is_set() and list(tokens) == [0, 1, 2]
    with tokens.holding():
        producer = threading.Thread(target=llm, args=(1,))
        producer.start()
        with run.ready:
            tokens.stopped = True
            run.ready.notify_all()
        producer.join(5)
    assert outcome == ["stopped"] and list(tokens) == [0, 1, 2]


def test_a_run_that_ended_short_returns_what_it_has_and_an_error_is_raised_to_the_reader():
    run = Run()
    run.ended = True
    assert run.wait(lambda: [1], 5) == [1]
    run.error = RuntimeError("the LLM broke")
    with pytest.raises(RuntimeError, match="the LLM broke"):
        run.wait(lambda: [1], 5)


def test_alone_waits_for_shared_turns_and_keeps_new_ones_out_until_it_ran():
    turns = Turns()
    order: list[str] = []
    first = turns.shared()
    first.__enter__()
    alone_in = threading.Event()

    def seeded() -> None:
        with turns.alone():
            order.append("alone")
            alone_in.set()

    def later_shared() -> None:
        with turns.shared():
            order.append("later shared")

    waiting = threading.Thread(target=seeded)
    waiting.start()
    while not turns._waiting:  # (the seeded one asks first)
        threading.Event().wait(0.001)
    newcomer = threading.Thread(target=later_shared)
    newcomer.start()
    assert not alone_in.wait(0.05)  # a shared turn still runs
    order.append("first shared ends")
    first.__exit__(None, None, None)
    waiting.join(10)
    newcomer.join(10)
    assert order == ["first shared ends", "alone", "later shared"]


def test_shared_turns_run_side_by_side():
    turns = Turns()
    inside = threading.Barrier(3, timeout=10)

    def run() -> None:
        with turns.shared():
            inside.wait()  # all three at once, or the barrier breaks

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not inside.broken


def test_vllm_engine_args_made_during_the_load_reserve_the_planned_share(monkeypatch):
    """vLLM cannot run here (it needs a GPU): a module in its place records what upstream's
    load_vllm asks of it, the way upstream asks (``from vllm import EngineArgs`` at the call)."""
    from cosyvoice_lb.instance.engines.upstream_vllm import share as vllm_share

    made: list[dict] = []
    fake = types.ModuleType("vllm")
    fake.EngineArgs = lambda **kwargs: made.append(kwargs) or kwargs  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "vllm", fake)

    def upstreams_load_vllm():  # what cosyvoice/cli/model.py's load_vllm does with EngineArgs
        from vllm import EngineArgs

        return EngineArgs(
            model="m/vllm", skip_tokenizer_init=True, enable_prompt_embeds=True, gpu_memory_utilization=0.2
        )

    original = fake.EngineArgs
    with vllm_share(0.07):
        upstreams_load_vllm()
    upstreams_load_vllm()  # after the load: vLLM as it was
    with vllm_share(0.0):  # 0: upstream's own share
        upstreams_load_vllm()
    assert [m["gpu_memory_utilization"] for m in made] == [0.07, 0.2, 0.2]
    assert fake.EngineArgs is original


class Speech:
    """What token2wav gives back (a tensor upstream): ``.cpu()`` is itself."""

    def __init__(self, tokens: int):
        self.tokens = tokens

    def cpu(self) -> Speech:
        return self


class Clock:
    """Time that moves only when the fake model's LLM or token2wav says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def timed_model(clock: Clock, token_seconds: float, wav_seconds: float, count: int = 10):
    """Upstream's shape, with an LLM that makes ``count`` tokens, ``token_seconds`` each, and a
    token2wav of ``wav_seconds``: first hop 4 tokens, lookahead 2, no prompt. After the 6th
    token (the first chunk's) the LLM waits until ``timed`` is set (by whoever heard the first
    chunk's times), so those times are exact; ``llm_end`` is when it made its last token."""
    model = model_shaped_like_upstream()
    model.token_hop_len, model.flow.pre_lookahead_len = 4, 2
    timed = threading.Event()
    llm_end: list[float] = []

    def llm_job(text, prompt_text, llm_prompt_speech_token, llm_embedding, uuid):
        for token in range(count):
            if token == 6:
                timed.wait(10)
            clock.now += token_seconds
            model.tts_speech_token_dict[uuid].append(token)
        llm_end.append(clock.now)

    def token2wav(
        token, prompt_token, prompt_feat, embedding, token_offset, uuid, stream=False, finalize=False, speed=1.0
    ):
        clock.now += wav_seconds
        return Speech(len(token.data))

    model.llm_job, model.token2wav = llm_job, token2wav
    return model, llm_end, timed


class FakeTensor:
    def __init__(self, data):
        self.data = list(data)

    def unsqueeze(self, dim):
        return self


def tts_inputs(stream: bool) -> dict:
    empty = np.zeros((1, 0))
    return {"source_speech_token": empty, "flow_prompt_speech_token": empty, "stream": stream,
            "text": "t", "prompt_text": "", "llm_prompt_speech_token": empty, "llm_embedding": empty,
            "prompt_speech_feat": empty, "flow_embedding": empty}  # fmt: skip


def test_a_streams_first_chunk_is_timed_in_its_llm_and_token2wav_parts(monkeypatch):
    """The llm part ends when the first chunk's tokens (hop 4 + lookahead 2) were there, not
    at the LLM's end; the audio part is that chunk's token2wav; once per stream, never for a
    whole synthesis."""
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(tensor=FakeTensor))
    clock = Clock()
    model, llm_end, timed = timed_model(clock, token_seconds=0.25, wav_seconds=0.5)
    heard: list[tuple[float, float]] = []

    def hear(llm: float, audio: float) -> None:
        heard.append((llm, audio))
        timed.set()

    assert install(model, on_first_chunk=hear, clock=clock) == ""
    started = clock.now
    chunks = [c["tts_speech"].tokens for c in model.tts(**tts_inputs(stream=True))]
    assert chunks[0] == 6 and heard == [(6 * 0.25, 0.5)]
    assert llm_end[0] - started > 6 * 0.25  # (the LLM went on after the first chunk's tokens)
    list(model.tts(**tts_inputs(stream=False)))
    assert len(heard) == 1 and not model.tts_speech_token_dict
