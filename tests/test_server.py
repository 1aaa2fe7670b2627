"""The instance app in-process (Starlette's test client): validation, /ping, errors."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import soundfile
from fastapi.testclient import TestClient

from cosyvoice_lb.engines import SynthesisRequest
from cosyvoice_lb.engines.espeak import EspeakEngine
from cosyvoice_lb.server import BadRequest, Instance, InstanceState, Limits, build_app, form_payload, make_request


@pytest.fixture(scope="module")
def loaded():
    instance = Instance(EspeakEngine(), InstanceState(engine_name="espeak", port=7860, max_chars=40),
                        Limits(max_chars=40))
    instance.load()
    return instance


@pytest.fixture(scope="module")
def client(loaded):
    with TestClient(build_app(loaded), raise_server_exceptions=False) as c:
        yield c


def test_ping_is_200_and_says_ready_after_warm_up(client):
    r = client.get("/ping")
    assert r.status_code == 200
    body = r.json()
    assert body["ready"] is True and body["engine"] == "espeak" and body["inflight"] == 0
    assert isinstance(body["pid"], int) and body["busy_seconds"] == 0.0


def test_ping_is_503_while_loading():
    instance = Instance(EspeakEngine(), InstanceState(engine_name="espeak", port=7861))
    with TestClient(build_app(instance)) as c:
        r = c.get("/ping")
        assert r.status_code == 503 and r.json()["state"] == "loading" and r.json()["ready"] is False
        tts = c.post("/v1/tts", json={"text": "hi"})
        assert tts.status_code == 503 and "still loading" in tts.json()["error"]["message"]


def test_tts_answers_wav_and_counts_it(client, loaded):
    served = loaded.state.served
    r = client.post("/v1/tts", json={"text": "Hello world", "speed": 1.2})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    audio, rate = soundfile.read(io.BytesIO(r.content))
    assert rate == 22050 and audio.size > 0.3 * rate
    assert float(r.headers["X-Audio-Seconds"]) == pytest.approx(audio.size / rate, abs=0.01)
    assert loaded.state.served == served + 1


@pytest.mark.parametrize("body, status, words", [
    ("", 400, "no body"),
    ("   ", 400, "no body"),
    ("{", 400, "not valid JSON"),
    ("\xff", 400, "not valid JSON"),
    ("null", 400, "JSON object"),
    ('"text"', 400, "JSON object"),
    ('{"text": ""}', 400, "empty"),
    ('{"text": " \\n\\t "}', 400, "empty"),
    ('{"text": null}', 400, "missing"),
    ('{"text": ["a"]}', 400, "must be a string"),
    ('{"text": "hi", "speed": null}', 400, "must be a number"),
    ('{"text": "hi", "speed": true}', 400, "must be a number"),
    ('{"text": "hi", "speed": 0.1}', 400, "between 0.5 and 2.0"),
    ('{"text": "hi", "speed": 1e400}', 400, "between 0.5 and 2.0"),
    ('{"text": "hi", "voice": "x"}', 400, "unknown field(s) voice"),
    ('{"text": "hi", "mode": "karaoke"}', 400, "unknown mode 'karaoke'"),
    ('{"text": "hi", "mode": "zero_shot"}', 400, "not available with this model: choose one of sft"),
    ('{"text": "hi", "seed": -1}', 400, '"seed" must be a whole number'),
    ('{"text": "hi", "seed": 1.5}', 400, '"seed" must be a whole number'),
    ('{"text": "hi", "stream": "yes"}', 400, '"stream" must be true or false'),
    ('{"text": "hi", "stream": true, "speed": 1.5}', 400, "only without streaming"),
    ('{"text": "hi", "speaker": "nobody"}', 400, "unknown speaker 'nobody'"),
    (json.dumps({"text": "a" * 41}), 413, "41 characters, more than the limit of 40"),
])
def test_bad_requests_are_4xx_with_a_message(client, body, status, words):
    r = client.post("/v1/tts", content=body.encode("utf-8", errors="surrogateescape") if body != "\xff" else b"\xff",
                    headers={"Content-Type": "application/json"})
    assert r.status_code == status
    assert words in r.json()["error"]["message"]
    assert client.get("/ping").status_code == 200


def test_wrong_method_and_unknown_path_are_json_errors(client):
    r = client.get("/v1/tts")
    assert r.status_code in (404, 405)
    assert client.get("/ping").status_code == 200


def test_make_request_accepts_the_documented_shape():
    espeak = dict(limits=Limits(max_chars=10), modes=("sft",), speakers=[], has_prompt=False)
    assert make_request({"text": "hi"}, **espeak) == SynthesisRequest("hi", 1.0)
    assert make_request({"text": "hi", "speed": 2, "seed": 7}, **espeak) == SynthesisRequest("hi", 2.0, seed=7)
    with pytest.raises(BadRequest) as exc:
        make_request({"text": "x" * 11}, **espeak)
    assert exc.value.status == 413


@pytest.mark.parametrize("payload, has_prompt, words", [
    ({"text": "hi", "mode": "zero_shot", "prompt_text": "hello"}, False, "needs prompt_audio"),
    ({"text": "hi", "mode": "zero_shot"}, True, "needs prompt_text"),
    ({"text": "hi", "mode": "cross_lingual"}, False, "needs prompt_audio"),
    ({"text": "hi", "mode": "instruct"}, True, "needs instruct_text"),
    ({"text": "hi", "mode": "sft"}, False, "not available with this model"),
])
def test_cloning_modes_check_what_they_need(payload, has_prompt, words):
    v3 = dict(limits=Limits(), modes=("zero_shot", "cross_lingual", "instruct"), speakers=[])
    with pytest.raises(BadRequest, match=words):
        make_request(payload, has_prompt=has_prompt, **v3)


def test_a_complete_clone_request_passes():
    v3 = dict(limits=Limits(), modes=("zero_shot", "cross_lingual", "instruct"), speakers=[])
    request = make_request({"text": "hi", "mode": "zero_shot", "prompt_text": "the transcript", "seed": 3},
                           has_prompt=True, **v3)
    assert (request.mode, request.prompt_text, request.seed) == ("zero_shot", "the transcript", 3)


def test_form_fields_get_their_types():
    assert form_payload({"text": "hi", "speed": "1.5", "seed": "42", "stream": "true", "mode": ""}) == {
        "text": "hi", "speed": 1.5, "seed": 42, "stream": True}
    with pytest.raises(BadRequest, match='"speed" must be a number'):
        form_payload({"speed": "fast"})
    with pytest.raises(BadRequest, match='"stream" must be true or false'):
        form_payload({"stream": "maybe"})


def test_inflight_is_tracked_during_a_synthesis(loaded):
    seen = []

    class Watching:
        name, sample_rate, modes = "espeak", 22050, ("sft",)

        def synthesize(self, request):
            seen.append(loaded.state.ping()["inflight"])
            yield np.zeros(10, dtype=np.float32)

    watcher = Instance(Watching(), loaded.state)
    watcher.synthesize(SynthesisRequest("x"))
    assert seen == [1] and loaded.state.ping()["inflight"] == 0


def test_a_stop_signal_drains_syntheses_in_flight_before_the_server_exits():
    import signal
    import time

    import uvicorn

    from cosyvoice_lb.server import draining_server

    state = InstanceState(engine_name="espeak", port=7862, ready=True, phase="ready")
    state.inflight["busy"] = time.monotonic()
    server = draining_server(uvicorn.Config(app=lambda *a: None), state, drain_timeout=5.0)
    server.handle_exit(signal.SIGTERM, None)
    assert state.phase == "draining" and state.ready is False  # /ping now says so; no new work
    time.sleep(0.3)
    assert server.should_exit is False  # still waiting for the synthesis
    del state.inflight["busy"]
    deadline = time.monotonic() + 2
    while not server.should_exit and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.should_exit is True


def test_the_drain_is_bounded():
    import signal
    import time

    import uvicorn

    from cosyvoice_lb.server import draining_server

    state = InstanceState(engine_name="espeak", port=7863, ready=True, phase="ready")
    state.inflight["stuck"] = time.monotonic()
    server = draining_server(uvicorn.Config(app=lambda *a: None), state, drain_timeout=0.3)
    server.handle_exit(signal.SIGTERM, None)
    deadline = time.monotonic() + 3
    while not server.should_exit and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.should_exit is True and "stuck" in state.inflight


def test_draining_instance_answers_503_so_nginx_tries_another(loaded):
    state = InstanceState(engine_name="espeak", port=7864, phase="draining")
    with TestClient(build_app(Instance(loaded.engine, state))) as c:
        r = c.post("/v1/tts", json={"text": "hi"})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert c.get("/ping").json()["state"] == "draining"


class Refusing:
    """An engine whose model refuses every input, as upstream does with assert."""

    name, sample_rate, modes = "refusing", 24000, ("sft",)

    def __init__(self, yields_nothing: bool = False):
        self.yields_nothing = yields_nothing

    def speakers(self):
        return []

    def synthesize(self, request):
        if self.yields_nothing:
            return
        assert False, "<|endofprompt|> not detected"
        yield  # a generator, like upstream's


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_input_is_a_422_even_when_streaming(stream):
    state = InstanceState(engine_name="refusing", port=7865, ready=True, phase="ready")
    with TestClient(build_app(Instance(Refusing(), state))) as c:
        r = c.post("/v1/tts", json={"text": "hi", "stream": stream})
        assert r.status_code == 422 and "refused this input" in r.json()["error"]["message"]
        assert state.ping()["inflight"] == 0 and c.get("/ping").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_no_audio_at_all_is_a_422(stream):
    state = InstanceState(engine_name="refusing", port=7866, ready=True, phase="ready")
    with TestClient(build_app(Instance(Refusing(yields_nothing=True), state))) as c:
        r = c.post("/v1/tts", json={"text": "...", "stream": stream})
        assert r.status_code == 422 and "no audio" in r.json()["error"]["message"]


def test_an_uploaded_prompt_without_mode_still_needs_its_transcript():
    v3 = dict(limits=Limits(), modes=("zero_shot", "cross_lingual", "instruct"), speakers=[])
    with pytest.raises(BadRequest, match="needs prompt_text"):
        make_request({"text": "hi"}, has_prompt=True, **v3)


class Blocking:
    """An engine that holds its slot until released, to fill an instance's queue."""

    name, sample_rate, modes = "blocking", 24000, ("sft",)

    def __init__(self):
        import threading

        self.release = threading.Event()

    def speakers(self):
        return []

    def synthesize(self, request):
        self.release.wait(10)
        yield np.zeros(100, dtype=np.float32)


def test_a_full_queue_is_refused_at_once_and_frees_up_again():
    import threading
    import time

    from cosyvoice_lb.server import Overloaded

    engine = Blocking()
    state = InstanceState(engine_name="blocking", port=7867, ready=True, phase="ready")
    instance = Instance(engine, state, concurrency=1, max_queue=1)
    results = []
    workers = [threading.Thread(target=lambda: results.append(instance.synthesize(SynthesisRequest("x"),
                                                                                   bounded=True).size))
               for _ in range(2)]
    for w in workers:  # one synthesizing, one waiting
        w.start()
    deadline = time.monotonic() + 5
    while state.ping()["inflight"] + state.ping()["waiting"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (state.ping()["inflight"], state.ping()["waiting"]) == (1, 1)
    started = time.monotonic()
    with pytest.raises(Overloaded, match="1 synthesizing, 1 waiting"):
        instance.synthesize(SynthesisRequest("x"), bounded=True)
    assert time.monotonic() - started < 0.5  # refused at once, not queued
    # unbounded callers (the UI, whose own queue bounds it; the warm-up) still wait their turn
    engine.release.set()
    for w in workers:
        w.join(5)
    assert results == [100, 100] and state.ping()["waiting"] == 0
    assert instance.synthesize(SynthesisRequest("x"), bounded=True).size == 100


def test_busy_instance_answers_503_with_retry_after():
    engine = Blocking()
    state = InstanceState(engine_name="blocking", port=7868, ready=True, phase="ready")
    instance = Instance(engine, state, concurrency=1, max_queue=0)
    with state.lock:
        state.inflight["someone"] = [0.0, 0.0]  # the one slot is taken
    with TestClient(build_app(instance)) as c:
        for body in ({"text": "hi"}, {"text": "hi", "stream": True}):
            r = c.post("/v1/tts", json=body)
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            assert "busy" in r.json()["error"]["message"]


# --- the request timeout and progress -------------------------------------------------------


class Chunky:
    """An engine that makes ``chunks`` chunks, ``every`` seconds apart."""

    name, sample_rate, modes = "chunky", 24000, ("sft",)

    def __init__(self, chunks: int, every: float):
        self.chunks, self.every, self.finished = chunks, every, 0

    def speakers(self):
        return []

    def synthesize(self, request):
        import time

        for _ in range(self.chunks):
            time.sleep(self.every)
            yield np.zeros(240, dtype=np.float32)
        self.finished += 1


def ready_state(port: int) -> InstanceState:
    return InstanceState(engine_name="test", port=port, ready=True, phase="ready")


def test_the_deadline_counts_from_nginx_stamp():
    import time

    instance = Instance(Chunky(1, 0), ready_state(7870), request_timeout=10.0)
    now = time.monotonic()
    assert instance.deadline(None) == pytest.approx(now + 10, abs=0.2)
    assert instance.deadline(f"{time.time() - 4:.3f}") == pytest.approx(now + 6, abs=0.2)  # 4 s spent already
    for odd in ("soon", "", f"{time.time() + 100:.3f}", f"{time.time() - 10**6:.3f}"):
        assert instance.deadline(odd) == pytest.approx(now + 10, abs=0.2)
    assert Instance(Chunky(1, 0), ready_state(7870)).deadline(None) is None  # no --request-timeout: no bound


def test_a_synthesis_running_past_the_request_timeout_is_a_504_and_frees_the_engine():
    import time

    engine = Chunky(chunks=20, every=0.2)
    state = ready_state(7871)
    with TestClient(build_app(Instance(engine, state, request_timeout=1.0))) as c:
        started = time.monotonic()
        r = c.post("/v1/tts", json={"text": "long"})
        assert r.status_code == 504 and "ran past the request timeout" in r.json()["error"]["message"]
        assert time.monotonic() - started < 3  # at the bound, not after the 4 s the synthesis wanted
        assert state.ping()["inflight"] == 0 and engine.finished == 0  # stopped at the next chunk
        stamped = c.post("/v1/tts", json={"text": "x"}, headers={"X-Request-Start": f"{time.time() - 5:.3f}"})
        assert stamped.status_code == 504  # its time was spent before it got here (a retry)


def test_a_stuck_engine_is_answered_504_at_the_bound_and_shows_as_stalled():
    import time

    engine = Blocking()
    state = ready_state(7872)
    try:
        with TestClient(build_app(Instance(engine, state, request_timeout=1.0))) as c:
            r = c.post("/v1/tts", json={"text": "stuck"})
            assert r.status_code == 504 and "no answer within the request timeout" in r.json()["error"]["message"]
            ping = c.get("/ping").json()  # the stuck synthesis still holds the engine, visibly
            assert ping["inflight"] == 1 and ping["stalled_seconds"][0] >= 1.0
            queued = c.post("/v1/tts", json={"text": "behind it"})  # waits for the slot until its bound
            assert queued.status_code == 504 and "no engine slot came free" in queued.json()["error"]["message"]
    finally:
        engine.release.set()
    deadline = time.monotonic() + 5
    while state.ping()["inflight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state.ping()["inflight"] == 0


def test_stalled_seconds_restart_with_every_chunk():
    import threading
    import time

    engine = Chunky(chunks=6, every=0.25)
    state = ready_state(7873)
    instance = Instance(engine, state)
    worker = threading.Thread(target=instance.synthesize, args=(SynthesisRequest("x"),))
    worker.start()
    time.sleep(1.0)
    ping = state.ping()
    worker.join(5)
    assert ping["inflight"] == 1 and ping["busy_seconds"] >= 0.9
    assert ping["stalled_seconds"][0] < 0.3  # it made a chunk a moment ago: not stuck, only long


def test_a_slow_stream_reader_is_not_a_stalled_synthesis():
    import time

    engine = Chunky(chunks=3, every=0.3)
    state = ready_state(7874)
    chunks = Instance(engine, state).stream(SynthesisRequest("x"))
    next(chunks)  # a chunk made; the reader now takes its time
    time.sleep(0.8)
    waiting_for_reader = state.ping()
    assert waiting_for_reader["inflight"] == 1 and waiting_for_reader["stalled_seconds"] == [0.0]
    next(chunks)  # the engine worked 0.3 s on the second chunk: counted from the resume, not before
    assert state.ping()["stalled_seconds"] == [0.0]
    chunks.close()
    assert state.ping()["inflight"] == 0


def test_the_simulated_engine_waits_in_proportion_to_the_text_and_returns_silence():
    import time

    from cosyvoice_lb.engines import create_engine

    engine = create_engine("simulated", simulated_ms_per_char=10.0, simulated_base_ms=20.0, model_dir="ignored")
    assert engine.service_seconds("x" * 10) == pytest.approx(0.12)
    started = time.monotonic()
    chunks = list(engine.synthesize(SynthesisRequest("x" * 10)))
    assert 0.11 <= time.monotonic() - started < 0.5
    assert len(chunks) == 1 and chunks[0].size == 10 * engine.sample_rate // 100 and not chunks[0].any()
    started = time.process_time()
    list(engine.synthesize(SynthesisRequest("x" * 30)))
    assert time.process_time() - started < 0.05  # waiting, not computing: it models a GPU-bound instance
