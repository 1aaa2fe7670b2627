"""The instance app in-process (Starlette's test client) and on a real uvicorn on 127.0.0.1:
/ping, the API's answers and errors, the pipeline's bookkeeping, drains."""

from __future__ import annotations

import io
import json
import threading
import time

import numpy as np
import pytest
import requests
import soundfile
from conftest import uvicorn_serving
from fastapi.testclient import TestClient

from cosyvoice_lb.instance.audio.outputs import Outputs
from cosyvoice_lb.instance.engines import EngineError, SynthesisRequest
from cosyvoice_lb.instance.engines.espeak import EspeakEngine
from cosyvoice_lb.instance.server import build_app
from cosyvoice_lb.instance.speech.admission import Admission, Overloaded
from cosyvoice_lb.instance.speech.pipeline import Job, Pipeline
from cosyvoice_lb.instance.speech.validation import Limits


def pipeline(
    engine,
    port: int = 7860,
    ready: bool = True,
    concurrency: int = 1,
    max_queue: int | None = None,
    request_timeout: float = 0.0,
    limits: Limits | None = None,
) -> Pipeline:
    admission = Admission(concurrency, max_queue)
    if ready:
        admission.become_ready()
    return Pipeline(engine, admission, limits, port=port, request_timeout=request_timeout)


def app(p: Pipeline):
    return build_app(p, p.engine.name, p.port)


def snap(p: Pipeline):
    return p.admission.snapshot()


@pytest.fixture(scope="module")
def loaded():
    p = pipeline(EspeakEngine(), ready=False, limits=Limits(max_chars=40))
    p.load()
    return p


@pytest.fixture(scope="module")
def client(loaded):
    with TestClient(app(loaded), raise_server_exceptions=False) as c:
        yield c


def test_ping_is_200_and_says_ready_after_warm_up(client):
    r = client.get("/ping")
    assert r.status_code == 200
    body = r.json()
    assert body["ready"] is True and body["engine"] == "espeak" and body["inflight"] == 0
    assert isinstance(body["pid"], int) and body["busy_seconds"] == 0.0


def test_ping_is_503_while_loading():
    with TestClient(app(pipeline(EspeakEngine(), port=7861, ready=False))) as c:
        r = c.get("/ping")
        assert r.status_code == 503 and r.json()["state"] == "loading" and r.json()["ready"] is False
        tts = c.post("/v1/tts", json={"text": "hi"})
        assert tts.status_code == 503 and "still loading" in tts.json()["error"]["message"]


def test_tts_answers_wav_and_counts_it(client, loaded):
    served = snap(loaded).served
    r = client.post("/v1/tts", json={"text": "Hello world", "speed": 1.2})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    audio, rate = soundfile.read(io.BytesIO(r.content))
    assert rate == 22050 and audio.size > 0.3 * rate
    assert float(r.headers["X-Audio-Seconds"]) == pytest.approx(audio.size / rate, abs=0.01)
    assert snap(loaded).served == served + 1


@pytest.mark.parametrize(
    "body, status, words",
    [
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
        ('{"text": "hi", "voices": "x"}', 400, "unknown field(s) voices"),
        ('{"text": "hi", "voice": "x"}', 404, "keeps no saved voices"),
        ('{"text": "hi", "voice": 7}', 400, "must be a saved voice's id or name"),
        ('{"text": "hi", "mode": "karaoke"}', 400, "unknown mode 'karaoke': this model offers sft"),
        # what a new user's run hit: each was a 500 before
        ('{"text": "\\ud800 hi"}', 400, "a lone UTF-16 surrogate"),
        ('{"text": "\\ud800 hi", "stream": true}', 400, "a lone UTF-16 surrogate"),
        ('{"text": "hi", "\\ud800": 1}', 400, "unknown field(s) \\ud800"),
        ("[" * 100_000 + "]" * 100_000, 400, "nested too deeply"),
        ('{"text": "hi", "mode": "zero_shot"}', 400, "not available with this model: choose one of sft"),
        ('{"text": "hi", "seed": -1}', 400, '"seed" must be a whole number'),
        ('{"text": "hi", "seed": 1.5}', 400, '"seed" must be a whole number'),
        ('{"text": "hi", "stream": "yes"}', 400, '"stream" must be true or false'),
        ('{"text": "hi", "stream": true, "speed": 1.5}', 400, "only without streaming"),
        ('{"text": "hi", "speaker": "nobody"}', 400, "unknown speaker 'nobody'"),
        (json.dumps({"text": "a" * 41}), 413, "41 characters, more than the limit of 40"),
    ],
)
def test_bad_requests_are_4xx_with_a_message(client, body, status, words):
    r = client.post(
        "/v1/tts",
        content=body.encode("utf-8", errors="surrogateescape") if body != "\xff" else b"\xff",
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == status
    assert words in r.json()["error"]["message"]
    assert client.get("/ping").status_code == 200


def test_wrong_method_and_unknown_path_are_json_errors(client):
    r = client.get("/v1/tts")
    assert r.status_code in (404, 405)
    assert client.get("/ping").status_code == 200


def test_inflight_is_tracked_during_a_synthesis():
    seen = []

    class Watching:
        name, sample_rate, modes = "espeak", 22050, ("sft",)

        def speakers(self):
            return []

        def synthesize(self, request):
            seen.append(snap(watcher).inflight)
            yield np.full(1000, 0.1, dtype=np.float32)  # (audio that passes the audio check)

    watcher = pipeline(Watching())
    watcher.synthesize(Job(SynthesisRequest("x")))
    assert seen == [1] and snap(watcher).inflight == 0 and snap(watcher).served == 1


def test_a_stop_signal_drains_syntheses_in_flight_before_the_server_exits():
    import signal
    import time

    import uvicorn

    from cosyvoice_lb.instance.lifetime import draining_server

    admission = Admission()
    admission.become_ready()
    busy = admission.admit()
    server = draining_server(uvicorn.Config(app=lambda *a: None), admission, drain_timeout=5.0)
    server.handle_exit(signal.SIGTERM, None)
    assert admission.phase == "draining" and not admission.snapshot().ready  # /ping now says so; no new work
    time.sleep(0.3)
    assert server.should_exit is False  # still waiting for the synthesis
    busy.release(True)
    deadline = time.monotonic() + 2
    while not server.should_exit and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.should_exit is True


def test_the_drain_is_bounded():
    import signal
    import time

    import uvicorn

    from cosyvoice_lb.instance.lifetime import draining_server

    admission = Admission()
    admission.become_ready()
    admission.admit()  # stuck: never released
    server = draining_server(uvicorn.Config(app=lambda *a: None), admission, drain_timeout=0.3)
    server.handle_exit(signal.SIGTERM, None)
    deadline = time.monotonic() + 3
    while not server.should_exit and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.should_exit is True and admission.snapshot().inflight == 1


def test_the_drain_waits_for_the_long_texts_the_instance_coordinates():
    import signal
    import time

    import uvicorn

    from cosyvoice_lb.instance.lifetime import Tally, draining_server

    admission = Admission()
    admission.become_ready()
    long_texts = Tally()
    server = draining_server(uvicorn.Config(app=lambda *a: None), admission, 5.0, long_texts.count)
    with long_texts:  # a long text's segments are out at other instances: nothing in flight here
        server.handle_exit(signal.SIGTERM, None)
        time.sleep(0.3)
        assert server.should_exit is False and long_texts.count() == 1
    deadline = time.monotonic() + 2
    while not server.should_exit and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.should_exit is True and long_texts.count() == 0


def test_draining_instance_answers_503_so_nginx_tries_another(loaded):
    draining = pipeline(loaded.engine, port=7864)
    draining.admission.drain()
    with TestClient(app(draining)) as c:
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
    refusing = pipeline(Refusing(), port=7865)
    with TestClient(app(refusing)) as c:
        r = c.post("/v1/tts", json={"text": "hi", "stream": stream})
        assert r.status_code == 422 and "refused this input" in r.json()["error"]["message"]
        assert snap(refusing).inflight == 0 and c.get("/ping").status_code == 200
        assert snap(refusing).failed >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_no_audio_at_all_is_a_422(stream):
    with TestClient(app(pipeline(Refusing(yields_nothing=True), port=7866))) as c:
        r = c.post("/v1/tts", json={"text": "hi", "stream": stream})
        assert r.status_code == 422 and "produced no audio" in r.json()["error"]["message"]


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
        yield np.full(1000, 0.1, dtype=np.float32)


def test_a_full_queue_is_refused_at_once_and_frees_up_again():
    import threading
    import time

    engine = Blocking()
    p = pipeline(engine, port=7867, concurrency=1, max_queue=1)
    results = []
    workers = [
        threading.Thread(target=lambda: results.append(p.synthesize(Job(SynthesisRequest("x")), bounded=True).size))
        for _ in range(2)
    ]
    for w in workers:  # one synthesizing, one waiting
        w.start()
    deadline = time.monotonic() + 5
    while snap(p).inflight + snap(p).waiting < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (snap(p).inflight, snap(p).waiting) == (1, 1)
    started = time.monotonic()
    with pytest.raises(Overloaded, match="1 synthesizing, 1 waiting"):
        p.synthesize(Job(SynthesisRequest("x")), bounded=True)
    assert time.monotonic() - started < 0.5  # refused at once, not queued
    # unbounded callers (the UI, whose own queue bounds it; the warm-up) still wait their turn
    engine.release.set()
    for w in workers:
        w.join(5)
    assert results == [1000, 1000] and snap(p).waiting == 0
    assert p.synthesize(Job(SynthesisRequest("x")), bounded=True).size == 1000


def test_busy_instance_answers_503_with_retry_after():
    engine = Blocking()
    p = pipeline(engine, port=7868, concurrency=1, max_queue=0)
    p.admission.admit()  # the one slot is taken
    with TestClient(app(p)) as c:
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
            yield np.full(960, 0.1, dtype=np.float32)
        self.finished += 1


def test_the_pipeline_deadline_reads_nginx_stamp():
    import time

    p = pipeline(Chunky(1, 0), port=7870, request_timeout=10.0)
    now = time.monotonic()
    assert p.deadline(None) == pytest.approx(now + 10, abs=0.2)
    assert p.deadline(f"{time.time() - 4:.3f}") == pytest.approx(now + 6, abs=0.2)  # 4 s spent already
    assert pipeline(Chunky(1, 0), port=7870).deadline(None) is None  # no --request-timeout: no bound


def test_a_synthesis_running_past_the_request_timeout_is_a_504_and_frees_the_engine():
    import time

    engine = Chunky(chunks=20, every=0.2)
    p = pipeline(engine, port=7871, request_timeout=1.0)
    with TestClient(app(p)) as c:
        started = time.monotonic()
        r = c.post("/v1/tts", json={"text": "long"})
        assert r.status_code == 504 and "ran past the request timeout" in r.json()["error"]["message"]
        assert time.monotonic() - started < 3  # at the bound, not after the 4 s the synthesis wanted
        assert snap(p).inflight == 0 and engine.finished == 0  # stopped at the next chunk
        stamped = c.post("/v1/tts", json={"text": "x"}, headers={"X-Request-Start": f"{time.time() - 5:.3f}"})
        assert stamped.status_code == 504  # its time was spent before it got here (a retry)


def test_a_stuck_engine_is_answered_504_at_the_bound_and_shows_as_stalled():
    import time

    engine = Blocking()
    p = pipeline(engine, port=7872, request_timeout=0.5)
    try:
        with TestClient(app(p)) as c:
            r = c.post("/v1/tts", json={"text": "stuck"})
            assert r.status_code == 504 and "no answer within the request timeout" in r.json()["error"]["message"]
            ping = c.get("/ping").json()  # the stuck synthesis still holds the engine, visibly
            assert ping["inflight"] == 1 and ping["stalled_seconds"][0] >= 0.5
            queued = c.post("/v1/tts", json={"text": "behind it"})  # waits for the slot until its bound
            assert queued.status_code == 504 and "no engine slot came free" in queued.json()["error"]["message"]
    finally:
        engine.release.set()
    deadline = time.monotonic() + 5
    while snap(p).inflight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert snap(p).inflight == 0


def test_stalled_seconds_restart_with_every_chunk():
    import threading
    import time

    engine = Chunky(chunks=6, every=0.25)
    p = pipeline(engine, port=7873)
    worker = threading.Thread(target=p.synthesize, args=(Job(SynthesisRequest("x")),))
    worker.start()
    time.sleep(1.0)
    ping = snap(p)
    worker.join(5)
    assert ping.inflight == 1 and ping.busy_seconds >= 0.9
    assert ping.stalled_seconds[0] < 0.3  # it made a chunk a moment ago: not stuck, only long


def test_a_slow_stream_reader_is_not_a_stalled_synthesis():
    import time

    engine = Chunky(chunks=3, every=0.3)
    p = pipeline(engine, port=7874)
    chunks = p.chunks(Job(SynthesisRequest("x")))
    next(chunks)  # a chunk made; the reader now takes its time
    time.sleep(0.8)
    waiting_for_reader = snap(p)
    assert waiting_for_reader.inflight == 1 and waiting_for_reader.stalled_seconds == (0.0,)
    next(chunks)  # the engine worked 0.3 s on the second chunk: counted from the resume, not before
    assert snap(p).stalled_seconds == (0.0,)
    chunks.close()
    assert snap(p).inflight == 0


def test_the_simulated_engine_waits_in_proportion_to_the_text_and_returns_a_quiet_tone():
    import time

    from cosyvoice_lb.instance.audio.check import check_audio
    from cosyvoice_lb.instance.engines import create_engine

    engine = create_engine("simulated", simulated_ms_per_char=10.0, simulated_base_ms=20.0, model_dir="ignored")
    assert engine.service_seconds("x" * 10) == pytest.approx(0.12)
    started = time.monotonic()
    chunks = list(engine.synthesize(SynthesisRequest("x" * 10)))
    assert 0.11 <= time.monotonic() - started < 0.5
    assert len(chunks) == 1 and chunks[0].size == 10 * engine.sample_rate * 4 // 100  # 40 ms a character
    assert 0.09 < np.abs(chunks[0]).max() <= 0.1  # -20 dBFS: audio that passes the check, never loud
    assert check_audio(chunks[0], "x" * 10, 1.0, engine.sample_rate) is None
    started = time.process_time()
    list(engine.synthesize(SynthesisRequest("x" * 30)))
    assert time.process_time() - started < 0.05  # waiting, not computing: it models a GPU-bound instance


# --- races ------------------------------------------------------------------------------------


def serving(p: Pipeline):
    """The app on a real uvicorn on 127.0.0.1 (a client can go away for real); its URL."""
    return uvicorn_serving(app(p))


class PerChar:
    """An engine that makes one chunk per character, 0.1 s each (a long text streams for seconds)."""

    name, sample_rate, modes = "perchar", 24000, ("sft",)

    def speakers(self):
        return []

    def synthesize(self, request):
        for _ in request.text:
            time.sleep(0.1)
            yield np.full(2400, 0.1, dtype=np.float32)


def test_a_streaming_client_that_goes_away_frees_its_engine_slot_at_once():
    """A race: the slot used to stay taken until the socket's buffers filled (seconds)."""
    p = pipeline(PerChar(), port=7875, max_queue=2, request_timeout=60)
    session = requests.Session()
    session.trust_env = False
    with serving(p) as url:
        stream = session.post(url + "/v1/tts", json={"text": "x" * 100, "stream": True}, stream=True, timeout=30)
        assert stream.status_code == 200
        next(stream.iter_content(1024))  # the header and the first chunk arrived
        stream.close()  # the client goes away ~9.9 s of audio early
        gone = time.monotonic()
        inflight = session.get(url + "/ping", timeout=5).json()["inflight"]
        while inflight and time.monotonic() - gone < 5:
            time.sleep(0.05)
            inflight = session.get(url + "/ping", timeout=5).json()["inflight"]
        freed_after = time.monotonic() - gone
        assert inflight == 0
        assert freed_after < 1.0, f"the slot stayed taken {freed_after:.1f}s after the client left"
        asked = time.monotonic()
        nxt = session.post(url + "/v1/tts", json={"text": "x"}, timeout=30)
        assert nxt.status_code == 200
        assert time.monotonic() - asked < 1.0  # served at once, not behind the abandoned stream
    snapshot = snap(p)
    assert (snapshot.served, snapshot.failed) == (1, 0)  # the abandoned stream counts as neither


class WarmUpGate:
    """An engine whose warm-up synthesis waits for the test."""

    name, sample_rate, modes = "gate", 24000, ("sft",)

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()

    def load(self):
        pass

    def speakers(self):
        return []

    def synthesize(self, request):
        self.started.set()
        self.release.wait(10)
        yield np.ones(2400, dtype=np.float32) * 0.1


def test_an_instance_drained_during_its_warm_up_never_turns_ready():
    import signal

    import uvicorn

    from cosyvoice_lb.instance.lifetime import draining_server

    engine = WarmUpGate()
    p = pipeline(engine, ready=False)
    loader = threading.Thread(target=p.load)
    loader.start()
    assert engine.started.wait(5)
    server = draining_server(uvicorn.Config(app=lambda *a: None), p.admission, drain_timeout=5.0)
    server.handle_exit(signal.SIGTERM, None)  # supervisord's TERM while the warm-up runs
    engine.release.set()
    loader.join(5)
    assert p.admission.phase == "draining" and not snap(p).ready
    with TestClient(app(p)) as c:
        assert c.get("/ping").status_code == 503 and c.get("/ping").json()["state"] == "draining"


def test_a_stream_whose_first_chunk_never_comes_is_a_504_not_a_500():
    engine = Blocking()
    p = pipeline(engine, port=7876, request_timeout=0.5)
    try:
        with TestClient(app(p), raise_server_exceptions=False) as c:
            r = c.post("/v1/tts", json={"text": "stuck", "stream": True})
            assert r.status_code == 504 and "no answer within the request timeout" in r.json()["error"]["message"]
    finally:
        engine.release.set()
    deadline = time.monotonic() + 5
    while snap(p).inflight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert snap(p).inflight == 0  # the synthesis let go of its slot once the engine came back


# --- a full or read-only disk: 507 that names the cause, nothing half-written, still up ----------


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs (a full disk after a second of audio), and a read-only one."""
    import subprocess

    disks = {"full": tmp_path / "full", "readonly": tmp_path / "ro"}
    mounted = []
    for (name, path), opts in zip(disks.items(), ("size=64k", "ro,size=64k")):
        path.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True).returncode:
            for done in mounted:
                subprocess.run(["umount", str(done)])
            pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
        mounted.append(path)
    try:
        yield disks
    finally:
        for path in mounted:
            subprocess.run(["umount", "-l", str(path)])


@pytest.mark.parametrize("disk,cause", [("full", "No space left on device"), ("readonly", "Read-only file system")])
def test_a_result_that_cannot_be_kept_is_a_507_naming_the_cause(loaded, small_disk, disk, cause):
    from cosyvoice_lb.instance.audio.outputs import Outputs

    directory = small_disk[disk]
    if disk == "full":
        (directory / "filler").write_bytes(b"\0" * 60 * 1024)
    p = Pipeline(loaded.engine, loaded.admission, Limits(max_chars=400), port=7870)
    p.outputs = Outputs("", 7870, 3600, 2**30)
    p.outputs.dir = directory
    with TestClient(app(p), raise_server_exceptions=False) as c:
        r = c.post("/v1/tts", json={"text": "A sentence long enough to need more than the disk has left. " * 3})
        assert r.status_code == 507, r.text
        message = r.json()["error"]["message"]
        assert cause in message and str(directory) in message and "--outputs-dir" in message
        assert [f.name for f in directory.iterdir() if f.name != "filler"] == []  # no half file
        assert c.get("/ping").json()["ready"] is True


def test_a_prompt_that_cannot_be_written_is_a_507(loaded, small_disk):
    p = Pipeline(loaded.engine, loaded.admission, Limits(max_chars=400), scratch=str(small_disk["readonly"]), port=7871)
    prompt = io.BytesIO()
    voice = 0.3 * np.sin(np.linspace(0, 2 * np.pi * 220 * 3, 3 * 24000)).astype(np.float32)
    soundfile.write(prompt, voice, 24000, format="WAV")
    with pytest.raises(OSError) as caught:
        p.prepare_prompt(prompt.getvalue())
    assert "Read-only file system" in str(caught.value) and "disk" in str(caught.value)
    from cosyvoice_lb.instance.speech.failures import describe

    assert describe(caught.value).status == 507


def metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url + "/metrics", timeout=10).text
    found = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    assert len(found) == 1, (name, found)
    return found[0]


def test_a_full_disk_is_a_problem_of_the_instance_until_a_result_is_kept_again(loaded, small_disk):
    directory = small_disk["full"]
    filler = directory / "filler"
    filler.write_bytes(b"\0" * 60 * 1024)
    p = Pipeline(loaded.engine, loaded.admission, Limits(max_chars=400), port=7872)
    p.outputs = Outputs("", 7872, 3600, 2**30)
    p.outputs.dir = directory
    text = "A sentence long enough to need more than the disk has left. " * 3
    web = requests.Session()
    web.trust_env = False
    with serving(p) as url:
        assert "problems" not in web.get(url + "/ping", timeout=10).json()
        assert metric(url, "cosyvoice_outputs_failing") == 0

        refused = web.post(url + "/v1/tts", json={"text": text}, timeout=60)
        assert refused.status_code == 507, refused.text
        message = refused.json()["error"]["message"]
        # the answer and its header agree: a retry cannot help until the disk is fixed
        assert refused.headers["x-should-retry"] == "false"
        assert "a retry fails the same way" in message and "then retry" not in message

        ping = web.get(url + "/ping", timeout=10)
        assert ping.status_code == 200 and ping.json()["ready"] is True  # it still speaks
        (problem,) = ping.json()["problems"]
        assert "results are not being kept" in problem and "No space left on device" in problem
        assert metric(url, "cosyvoice_outputs_failing") == 1
        assert metric(url, "cosyvoice_results_not_kept_total") == 1

        streamed = web.post(url + "/v1/tts", json={"text": text, "stream": True}, timeout=60)
        assert streamed.status_code == 200 and len(streamed.content) > 44  # the client has its audio
        time.sleep(0.5)  # (kept, or not, after the last byte went out)
        assert metric(url, "cosyvoice_results_not_kept_total") == 2  # the lost copy is counted
        assert web.get(url + "/ping", timeout=10).json()["problems"] == [problem]

        filler.unlink()  # space again: the next result is kept and the problem goes
        kept = web.post(url + "/v1/tts", json={"text": "Kept again."}, timeout=60)
        assert kept.status_code == 200 and (directory / kept.headers["X-Output-File"]).is_file()
        assert "problems" not in web.get(url + "/ping", timeout=10).json()
        assert metric(url, "cosyvoice_outputs_failing") == 0


class Unsanitised(EspeakEngine):
    """espeak-ng given the text as it came, past the engine's rewrite: what a text it
    crashes on that nobody knows of yet does."""

    def synthesize(self, request):
        yield self._speak("en", request.text, 175)


@pytest.mark.parametrize("stream", [False, True])
def test_a_text_the_engine_crashes_on_is_a_422_that_asks_for_other_words(stream):
    engine = Unsanitised()
    engine.load()
    p = pipeline(engine, port=7873)
    with TestClient(app(p), raise_server_exceptions=False) as c:
        r = c.post("/v1/tts", json={"text": "a." * 100, "stream": stream})
        assert r.status_code == 422, r.text
        message = r.json()["error"]["message"]
        assert "cannot speak this text" in message and "stack smashing" not in message
        assert r.headers["x-should-retry"] == "false"
        assert c.post("/v1/tts", json={"text": "Still here."}).status_code == 200
        assert c.get("/ping").status_code == 200


class FailsMidway:
    """Two chunks, then the engine fails (a CUDA error half-way through a text)."""

    name, sample_rate, modes = "midway", 24000, ("sft",)

    def speakers(self):
        return []

    def synthesize(self, request):
        yield np.full(2400, 0.1, dtype=np.float32)
        yield np.full(2400, 0.1, dtype=np.float32)
        raise EngineError("device-side assert")


def test_a_stream_that_breaks_off_is_cut_not_ended_and_not_kept(tmp_path):
    p = pipeline(FailsMidway(), port=7876, max_queue=2, request_timeout=60)
    p.outputs = Outputs(str(tmp_path), 7876, 3600, 2**30)
    session = requests.Session()
    session.trust_env = False
    with serving(p) as url:
        stream = session.post(url + "/v1/tts", json={"text": "xx", "stream": True}, stream=True, timeout=30)
        assert stream.status_code == 200
        with pytest.raises(requests.exceptions.ChunkedEncodingError):  # the client sees it cut off
            b"".join(stream.iter_content(None))
        sse = session.post(
            url + "/v1/audio/speech",
            stream=True,
            timeout=30,
            json={"input": "xx", "response_format": "pcm", "stream_format": "sse"},
        )
        events = [json.loads(line[6:]) for line in sse.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "error" and "device-side assert" in events[-1]["error"]["message"]
    assert "speech.audio.done" not in [e["type"] for e in events]
    assert list(tmp_path.iterdir()) == []  # a broken-off result is not kept as if whole
    assert snap(p).failed == 2


# --- routing by work ----------------------------------------------------------------------


def test_a_busy_instance_declines_for_a_freer_one_at_once_and_the_last_resort_is_served(tmp_path):
    """A real board: slot 1 (this process, as a peer) is idle; the instance (slot 0) holds a
    4 s synthesis (long enough to outlast a loaded machine's pauses). A request nginx marked as a try is declined with a fast 503 before its
    body is even read (and not counted as a request); the same request marked "last"
    (nginx's last resort) is served; one straight at the port is never declined."""
    import os

    from cosyvoice_lb.instance.engines.simulated import SimulatedEngine
    from cosyvoice_lb.instance.routing.board import Board
    from cosyvoice_lb.instance.routing.rule import Backlog
    from cosyvoice_lb.instance.wiring import routed_admission

    board = Board.create(tmp_path / "routing.board")
    board.configure(True, 0.05)
    board.set_rotation([0, 1])
    board.publish(1, os.getpid(), True, Backlog(0.0, False), 0.004)
    a, router = routed_admission(1, 8, 0, lambda: board)
    a.become_ready()
    p = Pipeline(SimulatedEngine(simulated_ms_per_char=4), a, Limits(max_chars=1000), port=7860, router=router)
    with TestClient(app(p), raise_server_exceptions=False) as c:
        assert c.post("/v1/tts", json={"text": "a" * 10}).status_code == 200  # idle: taken
        assert c.get("/ping").json()["routing"]["seconds_per_char"] == pytest.approx(0.004, rel=0.2)
        long = threading.Thread(target=lambda: c.post("/v1/tts", json={"text": "a" * 1000}))
        long.start()
        deadline = time.monotonic() + 5
        while not snap(p).inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert board.row(0)[1].wait(a.clock()) > 0.4  # published: the others see it is busy
        declined = c.post("/v1/tts", content=b"not even JSON", headers={"X-Cvlb-Try": "r-1"})
        assert declined.status_code == 503 and declined.headers["X-Cvlb-Declined"] == "1"
        assert "declined" in declined.json()["error"]["message"]
        speech = c.post("/v1/audio/speech", json={"input": "hi", "voice": "alloy"}, headers={"X-Cvlb-Try": "r-2"})
        assert speech.status_code == 503 and speech.headers["X-Cvlb-Declined"] == "1"
        last = c.post("/v1/tts", json={"text": "a" * 10}, headers={"X-Cvlb-Try": "r-1", "X-Cvlb-Route": "last"})
        assert last.status_code == 200
        direct = c.post("/v1/tts", json={"text": "a" * 10}, headers={"X-Request-Id": "r-3"})
        assert direct.status_code == 200  # no nginx mark: answered here
        routing = c.get("/ping").json()["routing"]
        assert routing["declined"] == 2 and routing["last_resort"] == 1
        long.join(10)
        metrics = c.get("/metrics").text
        assert "cosyvoice_routing_declined_total 2.0" in metrics
        assert "cosyvoice_routing_last_resort_total 1.0" in metrics
        assert "cosyvoice_seconds_per_char " in metrics and "cosyvoice_queued_work_seconds " in metrics
        refused = [line for line in metrics.splitlines() if line.startswith("cosyvoice_requests_total")]
        refused = [line for line in refused if 'outcome="refused"' in line]
        assert refused and all(line.endswith(" 0.0") for line in refused)  # declines are no requests
    board.close()
