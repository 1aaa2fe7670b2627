"""The OpenAI-compatible API end to end, with the official ``openai`` client through nginx.

A real cluster of two espeak instances (real speech), with --max-chars 80 so that longer
inputs are split and fanned out across both instances.
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import soundfile
from conftest import cli, free_port_block, unexpected_tracebacks, wait_for

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.integration
SENTENCE = "This is sentence number {} of a long text that the cluster splits. "
LONG = "".join(SENTENCE.format(i) for i in range(10))  # ~690 characters, 9 or 10 segments


@pytest.fixture(scope="module")
def cluster():
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(2)
    done = cli(
        "up",
        "--instances",
        "2",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        "--max-chars",
        "80",
        "--segment-chars",
        "80",
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=url + "/v1", api_key="anything: no credentials configured", max_retries=2)
    session = requests.Session()
    session.trust_env = False
    yield {"url": url, "client": client, "http": session, "state_dir": state_dir, "base": base}
    cli("down", "--state-dir", str(state_dir), timeout=120)
    shutil.rmtree(state_dir, ignore_errors=True)


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768, 24000
    if fmt == "aac":
        import av

        with av.open(io.BytesIO(data)) as container:
            frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
            return np.concatenate(frames).astype(np.float32), container.streams.audio[0].rate
    audio, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    return audio, rate


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_every_format_from_the_official_client_decodes_to_speech(cluster, fmt):
    response = cluster["client"].audio.speech.create(
        model="tts-1", voice="alloy", input="Hello from the OpenAI client.", response_format=fmt
    )
    audio, rate = decode(response.content, fmt)
    assert rate == 24000
    seconds = audio.size / rate
    assert 0.8 < seconds < 5, seconds  # espeak says this in about 2 s
    assert float(np.sqrt(np.mean(audio**2))) > 0.01  # speech, not silence


def test_the_default_format_is_mp3_with_its_content_type_as_open_webui_asks(cluster):
    # Open WebUI posts {model, input, voice} to {base}/audio/speech and saves the answer as .mp3
    r = cluster["http"].post(
        cluster["url"] + "/v1/audio/speech",
        json={"model": "tts-1", "input": "Open WebUI says hello.", "voice": "nova"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/mpeg"
    audio, rate = decode(r.content, "mp3")
    assert rate == 24000 and audio.size > rate // 2


def test_models_are_listed_and_any_model_name_works(cluster):
    ids = [m.id for m in cluster["client"].models.list()]
    assert "espeak" in ids and "tts-1" in ids and "gpt-4o-mini-tts" in ids
    response = cluster["client"].audio.speech.create(
        model="whatever-model", voice="echo", input="Any model.", response_format="wav"
    )
    assert decode(response.content, "wav")[0].size > 0


def test_a_long_input_streams_its_segments_in_order_first_bytes_long_before_the_last(cluster):
    arrivals = []
    with cluster["client"].audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=LONG, response_format="pcm"
    ) as response:
        data = b""
        for chunk in response.iter_bytes(4096):
            arrivals.append(time.monotonic())
            data += chunk
    audio, rate = decode(data, "pcm")
    # the whole text was spoken (espeak: ~3.5 s a sentence), in pieces that came as they were made
    assert audio.size / rate > 25, audio.size / rate
    assert len(arrivals) > 5
    assert arrivals[0] < arrivals[-1]
    # the segments ran on both instances (nginx's log: upstream of each segment)
    log = (cluster["state_dir"] / "logs" / "nginx-access.log").read_text()
    upstreams = set(re.findall(r'"POST /v1/tts HTTP/1.1" 200 \d+ rt=\S+ upstream=(\S+)', log))
    assert {f"127.0.0.1:{cluster['base']}", f"127.0.0.1:{cluster['base'] + 1}"} <= upstreams


def test_a_long_text_on_v1_tts_is_joined_whole_with_no_segment_twice(cluster):
    log = cluster["state_dir"] / "logs" / "nginx-access.log"
    before = log.read_text().count('"POST /v1/tts')
    r = cluster["http"].post(cluster["url"] + "/v1/tts", json={"text": LONG, "seed": 3}, timeout=120)
    assert r.status_code == 200, r.text
    audio, rate = soundfile.read(io.BytesIO(r.content), dtype="float32")
    assert float(r.headers["x-audio-seconds"]) == pytest.approx(audio.size / rate, abs=0.01)
    assert audio.size / rate > 25
    from cosyvoice_lb.instance.audio.segments import split_text

    expected = len(split_text(LONG, 80, first_chars=40))
    # (the request itself is logged just after its answer)
    wait_for(lambda: log.read_text().count('"POST /v1/tts') >= before + expected + 1, timeout=10)
    time.sleep(0.5)
    assert log.read_text().count('"POST /v1/tts') - before - 1 == expected  # each segment once


def test_server_sent_events_carry_base64_audio_then_done(cluster):
    r = cluster["http"].post(
        cluster["url"] + "/v1/audio/speech",
        timeout=60,
        stream=True,
        json={
            "model": "gpt-4o-mini-tts",
            "input": "Events, please.",
            "voice": "alloy",
            "response_format": "wav",
            "stream_format": "sse",
        },
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "speech.audio.done" and events[-1]["usage"]["input_tokens"] == 15
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    data = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    audio = np.frombuffer(data[44:], dtype="<i2")  # a streamed WAV: header, then 16-bit samples
    assert data[:4] == b"RIFF" and audio.size > 24000 // 2


def test_errors_raise_the_right_exception_and_say_a_retry_cannot_help(cluster):
    client = cluster["client"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", response_format="ogg")  # type: ignore
    assert "response_format" in bad.value.message and "mp3" in bad.value.message
    assert bad.value.response.headers["x-should-retry"] == "false"
    body = bad.value.body
    assert set(body) >= {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    assert body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="4096"):
        client.audio.speech.create(model="tts-1", voice="alloy", input="x" * 4097)
    with pytest.raises(openai.BadRequestError, match="speed") as slow:
        client.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", speed=5.0)
    assert slow.value.body["param"] == "speed"
    # a saved voice on an engine that cannot clone: said, and not retried
    with pytest.raises(openai.BadRequestError, match="cannot speak saved voices"):
        client.audio.speech.create(model="tts-1", voice={"id": "voice_0123456789abcdef01234567"}, input="Hi.")
    log = cluster["state_dir"] / "logs" / "nginx-access.log"

    def refused() -> int:  # (nginx logs a request just after its answer)
        return len(re.findall(r'"POST /v1/audio/speech HTTP/1.1" 400', log.read_text()))

    wait_for(lambda: refused() >= 4, timeout=10)
    time.sleep(1)  # a retry would come within the client's backoff
    assert refused() == 4  # each sent once: no retries


def test_speed_is_applied_and_the_instances_stayed_up(cluster):
    client = cluster["client"]
    slow = client.audio.speech.create(
        model="tts-1", voice="alloy", input="Slowly now.", response_format="wav", speed=0.6
    )
    fast = client.audio.speech.create(
        model="tts-1", voice="alloy", input="Slowly now.", response_format="wav", speed=1.8
    )
    assert decode(slow.content, "wav")[0].size > 1.5 * decode(fast.content, "wav")[0].size
    logs = "".join(p.read_text() for p in (cluster["state_dir"] / "logs").glob("instance-*.log"))
    assert not unexpected_tracebacks(logs)


def test_the_ui_speaks_a_long_text_across_the_instances(cluster):
    from gradio_client import Client

    path = Client(cluster["url"] + "/", verbose=False).predict(LONG, 1.0, -1, False, api_name="/generate")
    audio, rate = soundfile.read(path, dtype="float32")
    assert audio.size / rate > 25  # the whole text, not its first --max-chars


SPEECH = {"model": "tts-1", "input": "Hi.", "voice": "alloy"}
HOSTILE = [
    (
        "speech-not-json",
        "/v1/audio/speech",
        {"data": b"{nope", "headers": {"content-type": "application/json"}},
        400,
        "not valid JSON",
    ),
    ("speech-empty-body", "/v1/audio/speech", {"data": b""}, 400, "no body"),
    ("speech-array", "/v1/audio/speech", {"json": [SPEECH]}, 400, "JSON object"),
    (
        "speech-deep-nesting",
        "/v1/audio/speech",
        {"data": b"[" * 100_000, "headers": {"content-type": "application/json"}},
        400,
        "not valid JSON",
    ),
    ("speech-no-input", "/v1/audio/speech", {"json": {"model": "tts-1", "voice": "alloy"}}, 400, '"input" is missing'),
    ("speech-input-list", "/v1/audio/speech", {"json": {**SPEECH, "input": ["a"]}}, 400, "must be a string"),
    ("speech-blank-input", "/v1/audio/speech", {"json": {**SPEECH, "input": "   "}}, 400, "empty"),
    (
        "speech-special-tokens",
        "/v1/audio/speech",
        {"json": {**SPEECH, "input": "hi <|endofprompt|>"}},
        400,
        "special tokens",
    ),
    ("speech-model-number", "/v1/audio/speech", {"json": {**SPEECH, "model": 7}}, 400, '"model" must be a string'),
    ("speech-voice-number", "/v1/audio/speech", {"json": {**SPEECH, "voice": 7}}, 400, '"voice" must be'),
    (
        "speech-voice-object-extra",
        "/v1/audio/speech",
        {"json": {**SPEECH, "voice": {"id": "x", "y": 1}}},
        400,
        '"voice" must be',
    ),
    (
        "speech-format-list",
        "/v1/audio/speech",
        {"json": {**SPEECH, "response_format": ["mp3"]}},
        400,
        "response_format",
    ),
    ("speech-stream-format", "/v1/audio/speech", {"json": {**SPEECH, "stream_format": "ws"}}, 400, "stream_format"),
    ("speech-speed-string", "/v1/audio/speech", {"json": {**SPEECH, "speed": "fast"}}, 400, "speed"),
    (
        "speech-speed-nan",
        "/v1/audio/speech",
        {"data": b'{"input": "Hi.", "speed": NaN}', "headers": {"content-type": "application/json"}},
        400,
        "speed",
    ),
    ("speech-speed-0.1", "/v1/audio/speech", {"json": {**SPEECH, "speed": 0.1}}, 400, "0.25 and 4.0"),
    ("speech-unknown-field", "/v1/audio/speech", {"json": {**SPEECH, "temperature": 1}}, 400, "temperature"),
    (
        "speech-instructions-number",
        "/v1/audio/speech",
        {"json": {**SPEECH, "instructions": 5}},
        400,
        '"instructions" must be a string',
    ),
    (
        "speech-instructions-espeak",
        "/v1/audio/speech",
        {"json": {**SPEECH, "instructions": "Whisper."}},
        400,
        "instruct",
    ),
    ("speech-mode-unknown", "/v1/audio/speech", {"json": {**SPEECH, "mode": "sing"}}, 400, "unknown mode"),
    ("speech-seed-negative", "/v1/audio/speech", {"json": {**SPEECH, "seed": -1}}, 400, "seed"),
    ("speech-punctuation-only", "/v1/audio/speech", {"json": {**SPEECH, "input": "..."}}, 422, "no word in it"),
    ("voices-json", "/v1/audio/voices", {"json": {"name": "x"}}, 400, "cannot speak saved voices"),
    ("voice-traversal", "/v1/audio/voices/..%2F..%2Fetc%2Fpasswd", {"method": "GET"}, 404, "no endpoint"),
    ("models-post", "/v1/models", {"json": {}}, 405, "use GET"),
    ("speech-get", "/v1/audio/speech", {"method": "GET"}, 405, "use POST"),
]


@pytest.mark.parametrize("path,kwargs,status,words", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_requests_to_the_openai_routes_get_a_4xx_in_openais_shape(cluster, path, kwargs, status, words):
    kwargs = dict(kwargs)
    method = kwargs.pop("method", "POST")
    r = cluster["http"].request(method, cluster["url"] + path, timeout=30, **kwargs)
    assert r.status_code == status, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and words in error["message"]
    assert r.headers["x-should-retry"] == "false"


def test_after_the_hostile_requests_no_instance_restarted(cluster):
    from conftest import status

    code, report = status(cluster["state_dir"])
    assert code == 0 and all(i["restarts"] == 0 for i in report["instances"]), report


def test_a_client_cannot_pass_for_a_segment(cluster):
    # without the cluster's segment key nginx drops the segment headers: the request is an
    # ordinary one (kept, split when long) and pays the rate limit like any other
    forged = {"X-Cvlb-Segment": "1/1", "X-Cvlb-Segment-Key": "0" * 64}
    short = cluster["http"].post(cluster["url"] + "/v1/tts", json={"text": "Forged."}, headers=forged, timeout=60)
    assert short.status_code == 200 and short.headers.get("x-output-file")
    long = cluster["http"].post(cluster["url"] + "/v1/tts", json={"text": LONG}, headers=forged, timeout=120)
    assert long.status_code == 200 and float(long.headers["x-audio-seconds"]) > 25


def test_a_scene_break_with_no_words_does_not_fail_a_long_text(cluster):
    text = SENTENCE.format(1) * 2 + "\n* * *\n" + SENTENCE.format(2) * 2
    r = cluster["http"].post(cluster["url"] + "/v1/tts", json={"text": text}, timeout=120)
    assert r.status_code == 200, r.text
