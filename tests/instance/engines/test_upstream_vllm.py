"""What the instance adds to upstream's vLLM path, on objects shaped like upstream's (vLLM
itself, on upstream's code: tests/integration/test_vllm_cluster.py): a client that leaves
aborts its request in the engine, a seed reaches vLLM's sampling, the engine stops at
exit, an export cut short is named, and a spawned engine process ends with its parent."""

from __future__ import annotations

import signal
import sys
import threading
import types

import pytest
from test_upstream_layer import FakeTensor, Speech, model_shaped_like_upstream, tts_inputs

from cosyvoice_lb.instance import lineage
from cosyvoice_lb.instance.engines import upstream_vllm
from cosyvoice_lb.instance.engines.upstream_tts import Cancelled, drive, install, llm_seed, shape_problem


class Engine:
    """vLLM's LLMEngine as upstream's LLM holds it: what abort and shutdown call."""

    def __init__(self) -> None:
        self.aborted: list[list[str]] = []
        self.engine_core = types.SimpleNamespace(shutdown=lambda: None)

    def abort_request(self, request_ids: list[str]) -> None:
        self.aborted.append(request_ids)


def vllm_model(tokens_made: threading.Semaphore, seeds: list):
    """Upstream's shape on vLLM: its LLM makes a token each time ``tokens_made`` is released,
    and says which seed its thread was given (what vLLM's SamplingParams would get)."""
    model = model_shaped_like_upstream()
    engine = Engine()
    model.llm = types.SimpleNamespace(vllm=engine, lock=threading.Lock(), vllm_output_queue={})

    def llm_job(text, prompt_text, llm_prompt_speech_token, llm_embedding, uuid):
        seeds.append(llm_seed())
        model.llm.vllm_output_queue[uuid] = "its queue"
        for token in range(200):
            tokens_made.acquire()
            model.tts_speech_token_dict[uuid].append(token)
        model.llm_end_dict[uuid] = True

    def token2wav(
        token, prompt_token, prompt_feat, embedding, token_offset, uuid, stream=False, finalize=False, speed=1.0
    ):
        return Speech(len(token.data))

    model.llm_job, model.token2wav = llm_job, token2wav
    return model, engine


@pytest.fixture
def torch_stand_in(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(tensor=FakeTensor))


def test_a_client_that_leaves_a_whole_synthesis_aborts_its_vllm_request_at_once(torch_stand_in):
    made, seeds = threading.Semaphore(0), []
    model, engine = vllm_model(made, seeds)
    assert install(model) == ""
    cancel = threading.Event()
    outcome: list[BaseException] = []

    def reader() -> None:
        try:
            list(drive(iter(model.tts(**tts_inputs(stream=False))), seed=7, cancel=cancel))
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    for _ in range(3):
        made.release()
    cancel.set()
    made.release()  # its next token: the LLM thread stops there
    thread.join(10)
    assert not thread.is_alive() and isinstance(outcome[0], Cancelled)
    (key,) = engine.aborted[0]
    assert model.llm.vllm_output_queue == {} and seeds == [7]
    assert not model.tts_speech_token_dict  # (nothing of it is left in upstream's dicts)
    assert key not in model.llm_end_dict


def test_a_stream_closed_by_its_client_aborts_its_request_too(torch_stand_in):
    made, seeds = threading.Semaphore(0), []
    model, engine = vllm_model(made, seeds)
    install(model)
    for _ in range(40):
        made.release()
    chunks = drive(iter(model.tts(**tts_inputs(stream=True))))
    next(chunks)  # the first chunk (hop 25 + lookahead 3)
    chunks.close()
    made.release()
    for _ in range(100):
        if engine.aborted:
            break
        threading.Event().wait(0.01)
    assert len(engine.aborted) == 1 and seeds == [None]


def test_a_model_on_vllm_without_what_abort_needs_keeps_upstreams_path():
    model, _engine = vllm_model(threading.Semaphore(0), [])
    del model.llm.vllm_output_queue
    assert "has no vllm_output_queue" in shape_problem(model)
    model.llm = types.SimpleNamespace(vllm=object(), lock=threading.Lock(), vllm_output_queue={})
    assert "has no abort_request()" in shape_problem(model)


def test_upstreams_sampling_params_get_the_seed_of_the_llm_thread_that_makes_them(monkeypatch):
    made: list[dict] = []
    fake = types.ModuleType("vllm")
    fake.SamplingParams = lambda **kwargs: made.append(kwargs) or kwargs  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    seed_now: list[int | None] = [11]
    upstream_vllm.seed_requests(lambda: seed_now[0])
    upstream_vllm.seed_requests(lambda: 99)  # (once per process: a second call changes nothing)
    from vllm import SamplingParams  # as upstream's inference_wrapper asks, at the call

    SamplingParams(top_k=25, max_tokens=10)
    seed_now[0] = None
    SamplingParams(top_k=25, max_tokens=10)
    SamplingParams(top_k=25, seed=5)  # (a seed already given stays)
    assert [m.get("seed") for m in made] == [11, None, 5]


def test_the_engine_is_shut_down_and_a_stuck_shutdown_does_not_hold_the_exit():
    stopped = threading.Event()
    model = types.SimpleNamespace(llm=types.SimpleNamespace(vllm=Engine()))
    model.llm.vllm.engine_core.shutdown = stopped.set
    assert upstream_vllm.shutdown(model) and stopped.is_set()
    model.llm.vllm.engine_core.shutdown = threading.Event().wait  # (never returns)
    assert upstream_vllm.shutdown(model, timeout=0.05) is False
    assert upstream_vllm.shutdown(types.SimpleNamespace(llm=object()))  # (no vLLM: nothing to stop)


def test_an_export_for_vllm_cut_short_is_named_with_what_to_do(tmp_path):
    assert upstream_vllm.export_problem(str(tmp_path)) == ""  # (not exported yet: upstream does it)
    export = tmp_path / "vllm"
    export.mkdir()
    (export / "config.json").write_text("{}")
    assert "remove that dir" in upstream_vllm.export_problem(str(tmp_path))
    (export / "model.safetensors").write_bytes(b"weights")
    assert upstream_vllm.export_problem(str(tmp_path)) == ""


def test_a_spawned_process_ends_once_its_parent_is_gone():
    parents = iter([40, 40, 40, 1])
    sent: list[int] = []
    watcher = lineage.follow_parent(poll=0.001, grace=0.001, parent=lambda: next(parents, 1), end=sent.append)
    watcher.join(5)
    assert sent == [signal.SIGTERM, signal.SIGKILL]
