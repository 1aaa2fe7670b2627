"""The streaming session route (/v1/audio/speech/stream) on a real uvicorn, with a real
WebSocket client (the ``websockets`` library): text in pieces, audio before the text is done,
the close codes of every way a session ends, its engine slot, credentials in the first message."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from conftest import ROOT, TOKEN, uvicorn_serving, vanish, wait_for

from cosyvoice_lb.instance.access.auth import SESSION_COOKIE, Policy, PolicyFile, digest
from cosyvoice_lb.instance.api import socket_protocol as protocol
from cosyvoice_lb.instance.api.speech_socket import StreamLimits
from cosyvoice_lb.instance.engines import SynthesisRequest
from cosyvoice_lb.instance.engines.espeak import EspeakEngine
from cosyvoice_lb.instance.server import build_app
from cosyvoice_lb.instance.speech.admission import Admission
from cosyvoice_lb.instance.speech.pipeline import Pipeline

websockets = pytest.importorskip("websockets")
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

PROMPT = str(ROOT / "cosyvoice_lb" / "instance" / "assets" / "check_prompt.wav")


class TextReader:
    """An engine that reads the session's text while it speaks (as upstream's bistream does):
    each piece it reads is spoken at once, 10 ms of tone per character."""

    name = "reader"
    sample_rate = 16000
    modes = ("zero_shot", "instruct")

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.ended = threading.Event()  # its synthesis let go (it ran out of text, or was stopped)

    def speakers(self) -> list[str]:
        return []

    def load(self) -> None:
        pass

    def default_prompt(self) -> tuple[str, str]:
        return PROMPT, "a prompt"

    def streams_text(self, mode: str) -> bool:
        return mode in self.modes

    def synthesize(self, request: SynthesisRequest) -> Iterator[np.ndarray]:
        assert request.text_stream is not None, "a session on this engine reads its text as it comes"
        try:
            for piece in request.text_stream:
                self.pieces.append(piece)
                n = int(self.sample_rate * 0.01 * len(piece))
                yield (0.2 * np.sin(np.arange(n) * 0.3)).astype(np.float32)
        finally:
            self.ended.set()


def pipeline(engine, concurrency: int = 2) -> Pipeline:
    admission = Admission(concurrency, 4)
    admission.become_ready()
    return Pipeline(engine, admission)


@contextmanager
def serving(p: Pipeline, limits: StreamLimits | None = None, policy: PolicyFile | None = None) -> Iterator[str]:
    app = build_app(p, p.engine.name, 7860, policy=policy, ui=False, stream=limits or StreamLimits())
    with uvicorn_serving(app) as url:
        yield url.replace("http://", "ws://") + protocol.PATH


def events(ws, until: tuple[str, ...] = ("done", "session.done", "error")) -> tuple[list[dict], bytes]:
    """Everything the server sends until an event of ``until``: (events, audio)."""
    got, audio = [], b""
    while True:
        frame = ws.recv(timeout=30)
        if isinstance(frame, bytes):
            audio += frame
            continue
        event = json.loads(frame)
        got.append(event)
        if event["type"] in until:
            return got, audio


def close_code(ws) -> int:
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            ws.recv(timeout=30)
    return closed.value.rcvd.code if closed.value.rcvd else 1006


@pytest.fixture(scope="module")
def espeak():
    p = pipeline(EspeakEngine())
    p.load()
    return p


@pytest.fixture(scope="module")
def url(espeak):
    with serving(espeak, StreamLimits(max_chars=300, idle_timeout=1.5, max_seconds=20)) as where:
        yield where


def test_audio_of_a_sentence_comes_before_the_text_is_done(url, espeak):
    with connect(url) as ws:
        ws.send(json.dumps({"type": "session.config"}))
        created = json.loads(ws.recv(timeout=10))
        assert created["type"] == "session.created" and created["speaking"] == "sentences"
        assert created["response_format"] == "pcm" and created["sample_rate"] == 24000
        for piece in ("Hello the", "re, this is the first sen", "tence. And"):
            ws.send(json.dumps({"type": "input.text.delta", "delta": piece}))
        first = ws.recv(timeout=20)  # the first sentence is spoken while the second is being written
        assert isinstance(first, bytes) and len(first) > 4800
        ws.send(json.dumps({"type": "input.text.delta", "delta": " here is the second one."}))
        ws.send(json.dumps({"type": "input.text.done"}))
        got, audio = events(ws)
        done = got[-1]
        assert done["type"] == "done" and done["sentences"] == 2
        assert done["characters"] == len("Hello there, this is the first sentence. And here is the second one.")
        assert done["bytes"] == len(first) + len(audio)
        assert done["audio_seconds"] == pytest.approx(done["bytes"] / 2 / 24000, abs=0.01)
        assert close_code(ws) == protocol.NORMAL
    pcm = np.frombuffer(first + audio, dtype="<i2")
    assert np.abs(pcm).max() > 1000  # speech, not silence
    wait_for(lambda: espeak.admission.snapshot().inflight == 0, 5)


def test_a_sentence_with_nothing_to_say_is_passed_over_not_refused(url):
    with connect(url) as ws:
        ws.send(json.dumps({"type": "session.config"}))
        for piece in ("First part. ", "* * * ", "... ", "Second part."):
            ws.send(json.dumps({"type": "input.text.delta", "delta": piece}))
        ws.send(json.dumps({"type": "input.text.done"}))
        got, audio = events(ws)
        assert got[-1]["type"] == "done" and got[-1]["sentences"] == 2 and audio


def test_vllm_omnis_names_and_base64_events(url):
    with connect(url) as ws:
        ws.send(json.dumps({"type": "session.config", "model": "any", "stream_format": "events"}))
        assert json.loads(ws.recv(timeout=10))["stream_format"] == "events"
        ws.send(json.dumps({"type": "input.text", "text": "Short and sweet."}))
        ws.send(json.dumps({"type": "input.done"}))
        got, binary = events(ws)
        assert binary == b""
        deltas = [base64.b64decode(e["audio"]) for e in got if e["type"] == "audio.delta"]
        assert deltas and sum(map(len, deltas)) == got[-1]["bytes"]
        assert got[-1]["type"] == "session.done"  # (vLLM-Omni's name, to a client that spoke its names)


@pytest.mark.parametrize(
    "messages,code,words",
    [
        ([{"type": "input.text.delta", "delta": "hi"}], protocol.BAD_INPUT, "first message must be"),
        ([{"type": "session.config", "volume": 3}], protocol.BAD_INPUT, "unknown field(s) volume"),
        ([{"type": "session.config", "response_format": "wma"}], protocol.BAD_INPUT, "response_format"),
        ([{"type": "session.config", "voice": "nobody-saved-this"}], protocol.BAD_INPUT, "saved voices"),
        ([{"type": "session.config"}, {"type": "input.text.delta"}], protocol.BAD_INPUT, '"delta"'),
        ([{"type": "session.config"}, {"type": "shout"}], protocol.BAD_INPUT, "unknown message type"),
        ([{"type": "session.config"}, "not json"], protocol.BAD_INPUT, "not valid JSON"),
        ([{"type": "session.config"}, b"\x00\x01"], protocol.BAD_INPUT, "not binary"),
        ([{"type": "session.config"}, {"type": "session.config"}], protocol.BAD_INPUT, "comes once"),
        (
            [{"type": "session.config"}, {"type": "input.text.delta", "delta": "say <|endofpro"}]
            + [{"type": "input.text.delta", "delta": "mpt|> now"}],
            protocol.BAD_INPUT,
            "special token",
        ),
        (
            [{"type": "session.config"}, {"type": "input.text.delta", "delta": "x" * 301}],
            protocol.TOO_MUCH_TEXT,
            "--stream-max-chars (300)",
        ),
    ],
)
def test_bad_input_gets_an_error_event_then_its_close_code(url, espeak, messages, code, words):
    with connect(url) as ws:
        for message in messages:
            ws.send(message if isinstance(message, (str, bytes)) else json.dumps(message))
        got, _ = events(ws, ("error",))
        error = got[-1]["error"]
        assert words in error["message"], error
        assert error["status"] in (400, 404, 413) and set(error) >= {"message", "type", "param", "code"}
        assert close_code(ws) == code
    wait_for(lambda: espeak.admission.snapshot().inflight == 0, 5)


def test_a_client_that_goes_quiet_is_closed_when_idle(url, espeak):
    with connect(url) as ws:
        ws.send(json.dumps({"type": "session.config"}))
        ws.send(json.dumps({"type": "input.text.delta", "delta": "I will say no more"}))
        started = time.monotonic()
        got, _ = events(ws, ("error",))
        assert "--stream-idle-timeout" in got[-1]["error"]["message"] and got[-1]["error"]["status"] == 408
        assert close_code(ws) == protocol.TIMED_OUT
        assert 1.0 < time.monotonic() - started < 6
    assert espeak.admission.snapshot().inflight == 0


def test_a_session_waiting_for_text_holds_its_slot_and_is_not_stalled(url, espeak):
    with connect(url) as ws:
        ws.send(json.dumps({"type": "session.config"}))
        ws.recv(timeout=10)
        snapshot = espeak.admission.snapshot()
        assert snapshot.inflight == 1 and snapshot.stalled_seconds == (0.0,)
        ws.send(json.dumps({"type": "input.text.done"}))
        got, audio = events(ws)
        assert got[-1]["sentences"] == 0 and audio == b""
    wait_for(lambda: espeak.admission.snapshot().inflight == 0, 5)


def test_a_client_that_vanishes_mid_sentence_frees_the_slot_at_once(url, espeak):
    served = espeak.admission.snapshot().served
    ws = connect(url)
    ws.send(json.dumps({"type": "session.config"}))
    ws.send(json.dumps({"type": "input.text.delta", "delta": "This sentence is long enough to take a while. " * 4}))
    ws.recv(timeout=10)  # session.created
    assert espeak.admission.snapshot().inflight == 1
    vanish(ws)  # gone without a close frame, as a crashed client goes
    wait_for(lambda: espeak.admission.snapshot().inflight == 0, 3)
    assert espeak.admission.snapshot().served <= served + 4


def test_no_free_slot_refuses_the_handshake_with_the_apis_503():
    p = pipeline(EspeakEngine(), concurrency=1)
    p.load()
    with serving(p) as where:
        with connect(where) as holder:
            holder.send(json.dumps({"type": "session.config"}))
            holder.recv(timeout=10)
            with pytest.raises(InvalidStatus) as refused:
                connect(where)
            response = refused.value.response
            assert response.status_code == 503 and response.headers["Retry-After"] == "1"
            assert "no engine slot free" in json.loads(response.body)["error"]["message"]
        wait_for(lambda: p.admission.snapshot().inflight == 0, 5)
        with connect(where) as again:  # the slot is back
            again.send(json.dumps({"type": "session.config"}))
            assert json.loads(again.recv(timeout=10))["type"] == "session.created"


def test_a_drain_finishes_the_sentence_then_closes_going_away():
    p = pipeline(EspeakEngine())
    p.load()
    with serving(p) as where, connect(where) as ws:
        ws.send(json.dumps({"type": "session.config"}))
        ws.recv(timeout=10)
        ws.send(json.dumps({"type": "input.text.delta", "delta": "The sentence being spoken is finished. And"}))
        first = ws.recv(timeout=20)
        assert isinstance(first, bytes)
        p.admission.drain()
        ws.send(json.dumps({"type": "input.text.delta", "delta": " this one is never spoken."}))
        got, _ = events(ws, ("error",))
        assert got[-1]["error"]["status"] == 503 and "stopping" in got[-1]["error"]["message"]
        assert close_code(ws) == protocol.GOING_AWAY
        wait_for(lambda: p.admission.snapshot().inflight == 0, 5)


def test_an_engine_that_reads_text_gets_it_word_by_word_as_it_comes():
    engine = TextReader()
    p = pipeline(engine)
    p.admission = Admission(1, 0)
    p.admission.become_ready()
    with serving(p) as where, connect(where) as ws:
        ws.send(json.dumps({"type": "session.config"}))
        assert json.loads(ws.recv(timeout=10))["speaking"] == "text stream"
        ws.send(json.dumps({"type": "input.text.delta", "delta": "Hello wor"}))
        first = ws.recv(timeout=10)  # "Hello " is spoken before the text is done
        assert isinstance(first, bytes) and engine.pieces == ["Hello "]
        time.sleep(0.3)  # the engine waits for text: not a hang
        assert p.admission.snapshot().stalled_seconds == (0.0,)
        ws.send(json.dumps({"type": "input.text.delta", "delta": "ld, streamed"}))
        ws.send(json.dumps({"type": "input.text.done"}))
        got, _ = events(ws)
        assert "".join(engine.pieces) == "Hello world, streamed"
        assert engine.pieces[1:] == ["world, ", "streamed"]
        assert got[-1]["type"] == "done" and got[-1]["characters"] == 21
        assert close_code(ws) == protocol.NORMAL
    assert p.admission.snapshot().served == 1 and p.admission.snapshot().inflight == 0


def test_an_engine_reading_text_lets_go_when_its_client_vanishes():
    engine = TextReader()
    p = pipeline(engine)
    with serving(p) as where:
        ws = connect(where)
        ws.send(json.dumps({"type": "session.config"}))
        ws.recv(timeout=10)
        ws.send(json.dumps({"type": "input.text.delta", "delta": "Waiting for "}))
        ws.recv(timeout=10)
        vanish(ws)
        wait_for(lambda: p.admission.snapshot().inflight == 0, 3)
        assert engine.ended.wait(3)  # the engine, blocked reading text, was let go
        assert p.admission.snapshot().served == 0  # (neither served nor failed: its client left)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, espeak):
    path = tmp_path_factory.mktemp("socket-gate") / "access.json"
    policy = Policy(frozenset({digest(TOKEN)}), {}, b"k" * 32)
    path.write_text(policy.to_json())
    with serving(espeak, policy=PolicyFile(str(path))) as where:
        yield where, policy


def spoken(ws) -> dict:
    ws.send(json.dumps({"type": "input.text.delta", "delta": "Allowed."}))
    ws.send(json.dumps({"type": "input.text.done"}))
    got, audio = events(ws)
    assert got[-1]["type"] == "done" and audio, got[-1]
    return got[-1]


def test_credentials_as_for_the_api_header_or_first_message(guarded):
    where, policy = guarded
    with connect(where, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        ws.send(json.dumps({"type": "session.config"}))
        spoken(ws)
    with connect(where) as ws:  # a browser: the token in its first message
        ws.send(json.dumps({"type": "session.config", "token": TOKEN}))
        spoken(ws)
    cookie = f"{SESSION_COOKIE}={policy.session('t:' + digest(TOKEN), time.time())}"
    with connect(where, additional_headers={"Cookie": cookie}) as ws:  # logged in to the UI
        ws.send(json.dumps({"type": "session.config"}))
        spoken(ws)


def test_missing_or_wrong_credentials_are_refused(guarded):
    where, policy = guarded
    with pytest.raises(InvalidStatus) as refused:
        connect(where, additional_headers={"Authorization": "Bearer not-the-token-at-all"})
    assert refused.value.response.status_code == 401
    for config in ({"type": "session.config"}, {"type": "session.config", "token": "wrong-token-abcdefgh"}):
        with connect(where) as ws:
            ws.send(json.dumps(config))
            got, _ = events(ws, ("error",))
            assert got[-1]["error"]["status"] == 401 and "Authorization" in got[-1]["error"]["message"]
            assert close_code(ws) == protocol.UNAUTHORIZED
    cookie = f"{SESSION_COOKIE}={policy.session('t:' + digest(TOKEN), time.time())}"
    with pytest.raises(InvalidStatus) as foreign:  # another site's page riding the UI's cookie
        connect(where, additional_headers={"Cookie": cookie}, origin="http://evil.example")
    assert foreign.value.response.status_code == 403
