"""Hostile input against a real cluster: the API and the UI through nginx, and the CLI.

One two-instance espeak cluster serves the whole module. Every API and UI case must get a
4xx (never a 5xx) that says what is wrong -- ``{"error": {"message": ...}}`` on the API;
Gradio's own routes may answer in their own JSON shape -- or, where the input is odd but
usable (bidi marks in the text, a 192 kHz prompt, a 10-minute prompt that gets trimmed),
exactly what the code does today with it. Paths that try to reach files outside the
service never return them. The last tests check that no instance restarted and none
logged a traceback.

The CLI cases need no cluster: each bad flag or place must exit non-zero with one line
that says what is wrong, no traceback, and nothing left running.
"""

from __future__ import annotations

import http.client
import io
import json
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import requests
import soundfile
from conftest import cli, free_port_block, port_free, status, unexpected_tracebacks

INSTANCES = 2


# --- the cluster ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))  # short: supervisord's socket
    port, base = free_port_block(1), free_port_block(INSTANCES)
    try:
        done = cli(
            "up",
            "--engine",
            "espeak",
            "--instances",
            str(INSTANCES),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--base-port",
            str(base),
            "--state-dir",
            str(state_dir),
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        code, body = status(state_dir)
        assert code == 0, body
        yield {
            "state_dir": state_dir,
            "port": port,
            "base": base,
            "url": f"http://127.0.0.1:{port}",
            "instances": {i["name"]: i["pid"] for i in body["instances"]},
        }
    finally:
        cli("down", "--state-dir", str(state_dir), timeout=120)
        shutil.rmtree(state_dir, ignore_errors=True)


# --- inputs ----------------------------------------------------------------------------------


def wav(seconds: float, rate: int, subtype: str = "PCM_16", silent: bool = False) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    audio = np.zeros_like(t) if silent else 0.3 * np.sin(2 * np.pi * 220 * t)
    buffer = io.BytesIO()
    soundfile.write(buffer, audio.astype(np.float32), rate, format="WAV", subtype=subtype)
    return buffer.getvalue()


def with_rate(data: bytes, rate: int) -> bytes:
    """The same WAV, its header claiming another sample rate (and byte rate)."""
    out = bytearray(data)
    out[24:28] = struct.pack("<I", rate)
    out[28:32] = struct.pack("<I", rate * 2)
    return bytes(out)


GOOD_WAV = wav(4, 16000)


def form(text: str = "Hello there.", prompt: bytes | None = None, name: str = "prompt.wav") -> dict[str, Any]:
    files = {"prompt_audio": (name, prompt, "audio/wav")} if prompt is not None else None
    return {"data": {"text": text}, "files": files}


def raw_json(body: bytes | str) -> dict[str, Any]:
    return {"data": body.encode() if isinstance(body, str) else body, "headers": {"Content-Type": "application/json"}}


def multipart_raw(body: bytes, boundary: str = "B") -> dict[str, Any]:
    return {"data": body, "headers": {"Content-Type": f"multipart/form-data; boundary={boundary}"}}


TEXT_PART = b'--B\r\nContent-Disposition: form-data; name="text"\r\n\r\nHello there.\r\n'
FILE_PART_HEAD = (
    b'--B\r\nContent-Disposition: form-data; name="prompt_audio"; filename="p.wav"\r\nContent-Type: audio/wav\r\n\r\n'
)


@dataclass
class Case:
    """One request and what must come back.

    ``expect``: the status; ``words``: in error.message (refusals) or in X-Prompt-Notice
    (accepted with a notice). A 200 must be WAV audio.
    """

    method: str
    path: str
    request: dict[str, Any] = field(default_factory=dict)
    expect: int = 400
    words: str = ""


def case(
    id: str, method: str, path: str, request: dict[str, Any] | None = None, expect: int = 400, words: str = ""
) -> Any:
    return pytest.param(Case(method, path, request or {}, expect, words), id=id)


def tts(id: str, request: dict[str, Any], expect: int = 400, words: str = "") -> Any:
    return case(id, "POST", "/v1/tts", request, expect, words)


def field_value(name: str, value: Any) -> dict[str, Any]:
    """A valid body with ``name`` set to ``value``."""
    return {"json": {"text": "Hello there.", name: value}}


API_CASES = [
    # bodies
    tts("empty-body", raw_json(b""), 400, "no body"),
    tts("whitespace-body", raw_json(b"  \n\t "), 400, "no body"),
    tts("huge-body-21MiB-over-nginx-limit", raw_json(b"x" * (21 * 2**20)), 413, "larger than"),
    tts("binary-garbage-as-json", raw_json(bytes(range(256)) * 16), 400, "not valid JSON"),
    tts(
        "binary-garbage-octet-stream",
        {"data": bytes(range(256)) * 16, "headers": {"Content-Type": "application/octet-stream"}},
        400,
        "not valid JSON",
    ),
    tts("latin1-bytes-in-json", raw_json('{"text": "caf\xe9"}'.encode("latin-1")), 400, "not valid JSON"),
    # malformed JSON
    tts("json-truncated", raw_json('{"text": "Hello'), 400, "not valid JSON"),
    tts("json-trailing-comma", raw_json('{"text": "Hello",}'), 400, "not valid JSON"),
    tts("json-single-quotes", raw_json("{'text': 'Hello'}"), 400, "not valid JSON"),
    tts("json-nested-100000-deep", raw_json("[" * 100_000 + "]" * 100_000), 400, "nested too deeply"),
    tts("json-array", raw_json('["text"]'), 400, "JSON object"),
    tts("json-string", raw_json('"Hello"'), 400, "JSON object"),
    tts("json-null", raw_json("null"), 400, "JSON object"),
    # wrong JSON types, every field
    tts("text-int", field_value("text", 12), 400, "must be a string"),
    tts("text-list", field_value("text", ["Hello"]), 400, "must be a string"),
    tts("text-object", field_value("text", {"en": "Hello"}), 400, "must be a string"),
    tts("text-bool", field_value("text", True), 400, "must be a string"),
    tts("speed-string", field_value("speed", "fast"), 400, "speed"),
    tts("speed-bool", field_value("speed", True), 400, "speed"),
    tts("speed-list", field_value("speed", [1.0]), 400, "speed"),
    tts("speed-null", field_value("speed", None), 400, "speed"),
    tts("mode-int", field_value("mode", 5), 400, "mode"),
    tts("mode-list", field_value("mode", ["sft"]), 400, "mode"),
    tts("prompt_text-int", field_value("prompt_text", 5), 400, "prompt_text"),
    tts("instruct_text-list", field_value("instruct_text", ["slowly"]), 400, "instruct_text"),
    tts("speaker-int", field_value("speaker", 5), 400, "speaker"),
    tts("speaker-object", field_value("speaker", {"name": "x"}), 400, "speaker"),
    tts("seed-string", field_value("seed", "7"), 400, "seed"),
    tts("seed-float", field_value("seed", 1.5), 400, "seed"),
    tts("seed-negative", field_value("seed", -1), 400, "seed"),
    tts("seed-bool", field_value("seed", True), 400, "seed"),
    tts("stream-string", field_value("stream", "yes"), 400, "stream"),
    tts("stream-int", field_value("stream", 1), 400, "stream"),
    tts("stream-null", field_value("stream", None), 400, "stream"),
    tts("unknown-field", field_value("volume", 11), 400, "unknown field"),
    # NaN / Infinity literals and numbers past what floats and ints hold
    tts("speed-NaN", raw_json('{"text": "Hello", "speed": NaN}'), 400, "speed"),
    tts("speed-Infinity", raw_json('{"text": "Hello", "speed": Infinity}'), 400, "speed"),
    tts("speed--Infinity", raw_json('{"text": "Hello", "speed": -Infinity}'), 400, "speed"),
    tts("speed-1e999", raw_json('{"text": "Hello", "speed": 1e999}'), 400, "speed"),
    tts("seed-NaN", raw_json('{"text": "Hello", "seed": NaN}'), 400, "seed"),
    tts("seed--Infinity", raw_json('{"text": "Hello", "seed": -Infinity}'), 400, "seed"),
    tts("text-NaN", raw_json('{"text": NaN}'), 400, "must be a string"),
    tts("speed-400-digit-integer", raw_json('{"text": "Hello", "speed": ' + "9" * 400 + "}"), 400, "speed"),
    tts("seed-5000-digit-integer", raw_json('{"text": "Hello", "seed": ' + "9" * 5000 + "}"), 400, "seed below"),
    # unicode: control characters, bidi overrides, zero-width characters, lone surrogates
    tts("text-with-bidi-override-U+202E", {"json": {"text": "Hello \u202edlrow\u202c there."}}, 200),
    tts("text-with-bidi-marks-and-isolates", {"json": {"text": "\u200fHello\u200e \u2067there\u2069."}}, 200),
    tts("text-with-control-chars", {"json": {"text": "Hello\x00\x07\x1b[31m there\x7f."}}, 200),
    tts("text-with-zero-width-chars", {"json": {"text": "Hel\u200blo\u200c the\u200dre\ufeff."}}, 200),
    tts("text-only-zero-width-chars", {"json": {"text": "\u200b\u200c\u200d\ufeff"}}, 422, "no audio"),
    tts("text-only-control-chars", {"json": {"text": "\x00\x01\x02\x1b"}}, 422, "no audio"),
    tts("text-only-bidi-override", {"json": {"text": "\u202e"}}, 422, "no audio"),
    tts("text-lone-surrogate", raw_json('{"text": "Hello \\ud800"}'), 400, "surrogate"),
    tts("speaker-with-bidi-override", field_value("speaker", "\u202eevil"), 400, "unknown speaker"),
    # path-like values
    tts("speaker-path-traversal", field_value("speaker", "../../etc/passwd"), 400, "unknown speaker"),
    tts("mode-path-traversal", field_value("mode", "../../etc/passwd"), 400, "unknown mode"),
    tts("form-speaker-path-traversal", {"data": {"text": "Hello", "speaker": "/etc/passwd"}}, 400, "unknown speaker"),
    # wrong content types
    tts("text/plain-body", {"data": b"Hello there.", "headers": {"Content-Type": "text/plain"}}, 400, "not valid JSON"),
    tts(
        "application/xml-body",
        {"data": b"<tts><text>Hello</text></tts>", "headers": {"Content-Type": "application/xml"}},
        400,
        "not valid JSON",
    ),
    # malformed multipart
    tts(
        "multipart-wrong-boundary",
        multipart_raw(TEXT_PART + b"--B--\r\n", boundary="zzz"),
        400,
        "form could not be read",
    ),
    tts(
        "multipart-no-boundary",
        {"data": TEXT_PART, "headers": {"Content-Type": "multipart/form-data"}},
        400,
        "form could not be read",
    ),
    tts("multipart-garbage", multipart_raw(bytes(range(256)) * 8), 400, "form"),
    tts("multipart-truncated-in-text-field", multipart_raw(TEXT_PART[:60]), 400, "closing boundary"),
    tts(
        "multipart-truncated-in-file-part",
        multipart_raw(TEXT_PART + FILE_PART_HEAD + GOOD_WAV[:2000]),
        400,
        "closing boundary",
    ),
    tts(
        "multipart-two-files",
        {
            "data": {"text": "Hello"},
            "files": [
                ("prompt_audio", ("a.wav", GOOD_WAV, "audio/wav")),
                ("prompt_audio", ("b.wav", GOOD_WAV, "audio/wav")),
            ],
        },
        400,
        "Too many files",
    ),
    tts(
        "multipart-text-as-a-file",
        {"files": {"text": ("t.txt", b"Hello", "text/plain")}},
        400,
        "only prompt_audio may be a file",
    ),
    tts(
        "multipart-prompt_audio-as-text-field",
        {"data": {"text": "Hello", "prompt_audio": "GOOD_WAV"}},
        400,
        "must be a file upload",
    ),
    tts("multipart-speed-nan", {"data": {"text": "Hello", "speed": "nan"}}, 400, "speed"),
    tts("multipart-seed-not-a-number", {"data": {"text": "Hello", "seed": "1e99"}}, 400, "seed"),
    # prompt audio
    tts("prompt-not-audio", form(prompt=b"this is not audio at all " * 40), 400, "not audio"),
    tts("prompt-html-named-wav", form(prompt=b"<html><body>hi</body></html>"), 400, "not audio"),
    tts("prompt-empty-file", form(prompt=b""), 400, "is empty"),
    tts("prompt-wav-truncated-in-header", form(prompt=GOOD_WAV[:30]), 400, "not audio"),
    tts("prompt-wav-truncated-mid-data", form(prompt=wav(8, 16000)[: len(wav(8, 16000)) // 2]), 200),  # 4 s left
    tts(
        "prompt-wav-truncated-to-too-short",
        form(prompt=GOOD_WAV[: len(GOOD_WAV) // 2]),
        400,
        "is 2.0 s long: cloning a voice needs 3-15 s",
    ),
    tts("prompt-wav-0-frames", form(prompt=wav(0, 16000)), 400, "no samples"),
    tts("prompt-wav-silent", form(prompt=wav(4, 16000, silent=True)), 400, "silent"),
    tts("prompt-wav-header-says-1Hz", form(prompt=with_rate(wav(1, 16000), 1)), 400, "1 Hz"),
    tts("prompt-wav-header-says-0Hz", form(prompt=with_rate(wav(1, 16000), 0)), 400, "not audio"),
    tts("prompt-wav-8000Hz", form(prompt=wav(4, 8000)), 400, "8000 Hz"),
    tts("prompt-wav-192000Hz", form(prompt=wav(4, 192000)), 200),
    tts("prompt-10-minute-wav-16bit-over-nginx-limit", form(prompt=wav(600, 16000)), 413, "larger than"),
    tts("prompt-10-minute-wav-8bit-trimmed", form(prompt=wav(600, 16000, "PCM_U8")), 200, "trimmed"),
    tts("prompt-11MiB-over-upload-limit", form(prompt=b"\0" * (11 * 2**20)), 413, "larger than 10 MiB"),
    # wrong methods, unknown paths
    case("GET-/v1/tts", "GET", "/v1/tts", expect=405, words="not allowed"),
    case("PUT-/v1/tts", "PUT", "/v1/tts", {"json": {"text": "Hello"}}, expect=405, words="not allowed"),
    case("DELETE-/v1/tts", "DELETE", "/v1/tts", expect=405, words="not allowed"),
    case("PATCH-/v1/tts", "PATCH", "/v1/tts", {"json": {"text": "Hello"}}, expect=405, words="not allowed"),
    case("OPTIONS-/v1/tts", "OPTIONS", "/v1/tts", expect=405, words="not allowed"),
    case("POST-/v1/speak", "POST", "/v1/speak", {"json": {"text": "Hello"}}, expect=404, words="no endpoint"),
    case("GET-/v1/", "GET", "/v1/", expect=404, words="no endpoint"),
    case("POST-/v1/tts/extra", "POST", "/v1/tts/extra", {"json": {"text": "Hello"}}, expect=404, words="no endpoint"),
    # very long header values
    tts("header-X-Padding-70KB", {"json": {"text": "Hello"}, "headers": {"X-Padding": "x" * 70_000}}, 431, "headers"),
    tts("header-X-Padding-17KB", {"json": {"text": "Hello"}, "headers": {"X-Padding": "x" * 17_000}}, 431, "headers"),
    tts("header-User-Agent-20KB", {"json": {"text": "Hello"}, "headers": {"User-Agent": "x" * 20_000}}, 431, "headers"),
    tts("header-Cookie-20KB", {"json": {"text": "Hello"}, "headers": {"Cookie": "a=" + "x" * 20_000}}, 431, "headers"),
]


def describe(r: requests.Response) -> str:
    kind = r.headers.get("content-type", "")
    body = f"<{len(r.content)} bytes of {kind}>" if kind.startswith("audio/") else r.text[:500]
    return f"{r.status_code} {kind} {body}"


def message_of(r: requests.Response) -> str:
    body = r.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"not {{'error': {{...}}}}: {r.text[:300]}"
    message = body["error"].get("message")
    assert isinstance(message, str) and message.strip(), f"no error.message: {r.text[:300]}"
    return message


@pytest.mark.parametrize("c", API_CASES)
def test_api_bad_input_gets_a_clear_answer_through_nginx(cluster, web, c: Case):
    r = web.request(c.method, cluster["url"] + c.path, timeout=120, **c.request)
    assert r.status_code < 500, f"server error: {describe(r)}"
    assert r.status_code == c.expect, describe(r)
    if c.expect == 200:
        assert r.headers["content-type"] == "audio/wav" and r.content[:4] == b"RIFF", describe(r)
        if c.words:
            assert c.words in r.headers.get("X-Prompt-Notice", ""), dict(r.headers)
        return
    assert "application/json" in r.headers.get("content-type", ""), describe(r)
    message = message_of(r)
    assert c.words in message, message
    assert "root:" not in r.text and "Traceback" not in r.text


def test_head_on_the_api_is_refused_without_a_body(cluster, web):
    r = web.head(cluster["url"] + "/v1/tts", timeout=10)
    assert 400 <= r.status_code < 500, r.status_code
    assert "application/json" in r.headers.get("content-type", "")


# --- path traversal through nginx ------------------------------------------------------------

TRAVERSAL = [
    "/../../etc/passwd",
    "/%2e%2e/%2e%2e/etc/passwd",
    "/..%2f..%2fetc/passwd",
    "/v1/../../etc/passwd",
    "/v1/..%2f..%2fetc%2fpasswd",
    "/gradio_api/file=/etc/passwd",
    "/gradio_api/file=%2Fetc%2Fpasswd",
    "/gradio_api/file=../../../../etc/passwd",
    "/gradio_api/file=..%2F..%2F..%2F..%2Fetc%2Fpasswd",
    "/gradio_api/file=/../../etc/passwd",
    "/gradio_api/file=/proc/self/environ",
    "/file=/etc/passwd",
    "/static/../../../../etc/passwd",
]


def raw_get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    """GET ``path`` exactly as written (requests/urllib3 would resolve the dot segments)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


@pytest.mark.parametrize("path", TRAVERSAL, ids=TRAVERSAL)
def test_path_traversal_never_returns_the_file(cluster, path):
    code, headers, body = raw_get(cluster["port"], path)
    assert b"root:" not in body and b"PATH=" not in body, body[:300]
    assert 400 <= code < 500, (code, body[:300])
    assert "application/json" in headers.get("content-type", ""), (code, headers.get("content-type"), body[:200])
    answer = json.loads(body)
    if not path.startswith(("/gradio_api/", "/file=", "/static/")):  # nginx's own refusals: the API's shape
        assert isinstance(answer.get("error", {}).get("message"), str), answer


# --- nginx's own refusals, unknown routes and methods: the one error shape --------------------


def raw(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes as they are (no client library would send most of these) and read the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(data)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def one_shape(code: int, headers: dict[str, str], body: bytes) -> str:
    """The error's message, once the answer is checked to be the one shape (``problems``)."""
    assert headers.get("content-type", "").startswith("application/json"), (code, headers, body[:200])
    answer = json.loads(body)
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code", "status"}, answer
    assert answer["error"]["status"] == code and answer["error"]["message"].strip(), answer
    return answer["error"]["message"]


def request_bytes(line: str, *headers: str, body: bytes = b"") -> bytes:
    return "\r\n".join([line, "Host: 127.0.0.1", *headers, "Connection: close", "", ""]).encode() + body


REFUSALS = [
    pytest.param(request_bytes("TRACE / HTTP/1.1"), 405, "method", id="TRACE"),
    pytest.param(request_bytes("TRACE /v1/tts HTTP/1.1"), 405, "method", id="TRACE-api"),
    pytest.param(request_bytes("CONNECT example.com:443 HTTP/1.1"), 400, "request", id="CONNECT"),
    pytest.param(request_bytes("POST /ping HTTP/1.1", "Content-Length: 999999999"), 413, "--max-body", id="413-ping"),
    pytest.param(request_bytes("POST /v1/tts HTTP/1.1", "Content-Length: 999999999"), 413, "--max-body", id="413-api"),
    pytest.param(request_bytes("GET /" + "a" * 20_000 + " HTTP/1.1"), 414, "URI is too long", id="414"),
    pytest.param(request_bytes("GET /ping HTTP/1.1", "X-Big: " + "a" * 20_000), 431, "headers", id="431-ping"),
    pytest.param(request_bytes("POST /v1/tts HTTP/1.1", "Transfer-Encoding: gzip"), 501, "Transfer-Encoding", id="501"),
    pytest.param(request_bytes("GET / HTTP/2.0"), 505, "HTTP version", id="505"),
    pytest.param(request_bytes("GET /ping HTTP/3.1"), 505, "HTTP version", id="505-ping"),
    pytest.param(request_bytes("FOO / HTTP/1.1"), 405, "FOO is not allowed", id="unknown-method-ui"),
    pytest.param(request_bytes("FOO /v1/tts HTTP/1.1"), 405, "FOO is not allowed", id="unknown-method-api"),
    pytest.param(request_bytes("DELETE / HTTP/1.1"), 405, "DELETE is not allowed", id="DELETE-ui"),
    pytest.param(request_bytes("PUT /v1/tts HTTP/1.1"), 405, "use POST", id="PUT-api"),
    pytest.param(request_bytes("GET /%ff%fe HTTP/1.1"), 404, "no such path", id="undecodable-path"),
    pytest.param(request_bytes("GET /no/such/page HTTP/1.1"), 404, "no such path", id="unknown-path"),
]


@pytest.mark.parametrize("data,code,words", REFUSALS)
def test_every_refusal_and_unknown_route_is_the_one_error_shape(cluster, data, code, words):
    status, headers, body = raw(cluster["port"], data)
    assert status == code, (status, body[:300])
    assert words in one_shape(status, headers, body)
    assert headers.get("x-should-retry") == "false"


@pytest.mark.parametrize("path", ["/ping", "/ping/brief"])
def test_ping_answers_an_http_1_0_health_check_without_host(cluster, path):
    # (HAProxy's default httpchk: "OPTIONS / HTTP/1.0" style, no Host header)
    status, headers, body = raw(cluster["port"], f"GET {path} HTTP/1.0\r\n\r\n".encode())
    assert status == 200 and json.loads(body)["ready"] is True, (status, body[:300])
    status, headers, body = raw(cluster["base"], f"GET {path} HTTP/1.0\r\n\r\n".encode())
    assert status == 200 and json.loads(body)["ready"] is True, (status, body[:300])


@pytest.mark.parametrize("port_key", ["port", "base"])
def test_gradio_queue_join_with_an_unknown_fn_index_is_a_4xx_in_the_one_shape(cluster, web, port_key):
    url = f"http://127.0.0.1:{cluster[port_key]}/gradio_api/queue/join"
    r = web.post(url, json={"fn_index": 999, "data": [], "session_hash": "hostile01"}, timeout=30)
    assert r.status_code == 400, describe(r)
    message = one_shape(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content)
    assert "fn_index" in message and "999" in message
    # a valid call still goes through to Gradio untouched
    assert web.get(f"http://127.0.0.1:{cluster[port_key]}/config", timeout=30).json()["components"]


# --- texts espeak-ng crashes on ------------------------------------------------------------------

DOTTED = "a." * 100  # espeak-ng alone aborts on it ("stack smashing detected")


@pytest.mark.parametrize("stream", [False, True])
def test_a_text_espeak_ng_crashes_on_is_spoken(cluster, web, stream):
    r = web.post(cluster["url"] + "/v1/tts", json={"text": DOTTED, "stream": stream}, timeout=120)
    assert r.status_code == 200 and r.content[:4] == b"RIFF", describe(r)
    assert len(r.content) > 48_000  # a hundred letters, each spoken


def test_a_long_text_with_such_a_sentence_is_spoken_whole(cluster, web):
    sentence = "This sentence is here so that the text is long enough to be split. "
    text = sentence * 5 + DOTTED + " " + sentence * 5  # past --max-chars 500: segments
    r = web.post(cluster["url"] + "/v1/tts", json={"text": text}, timeout=300)
    assert r.status_code == 200 and r.content[:4] == b"RIFF", describe(r)
    alone = web.post(cluster["url"] + "/v1/tts", json={"text": sentence * 5}, timeout=120)
    assert len(r.content) > 2 * len(alone.content)  # both halves and the letters between


# --- the UI ------------------------------------------------------------------------------------


def gradio_dir(cluster) -> Path:
    return cluster["state_dir"] / "run" / "gradio"


@pytest.mark.parametrize(
    "filename, content",
    [
        pytest.param("notes.txt", b"this is not audio\n" * 50, id="upload-non-audio"),
        pytest.param("prompt.wav", b"", id="upload-empty-file"),
        pytest.param("../../../../tmp/cvlb-hostile-evil.txt", b"evil", id="upload-traversal-filename"),
    ],
)
def test_ui_upload_route_takes_any_file_into_its_own_cache_only(cluster, web, filename, content):
    """Gradio's upload route is a generic file store (the UI's check is at Generate time):
    it may take the file, but only into the instance's own cache, or refuse it with a 4xx."""
    r = web.post(cluster["url"] + "/gradio_api/upload", files={"files": (filename, content, "text/plain")}, timeout=30)
    assert r.status_code < 500, describe(r)
    assert "application/json" in r.headers.get("content-type", ""), describe(r)
    if r.status_code == 200:
        paths = r.json()
        assert isinstance(paths, list) and len(paths) == 1, paths
        # the answer names the file by a marker, never by the server's own directories
        assert not paths[0].startswith("/") and ".." not in paths[0], paths
        assert str(cluster["state_dir"]) not in paths[0], paths
        stored = [
            p for p in gradio_dir(cluster).rglob(Path(paths[0]).name) if p.is_file() and p.read_bytes() == content
        ]
        assert stored, f"{paths[0]} is not in the instance's own cache"
    else:
        assert 400 <= r.status_code < 500
    assert not Path("/tmp/cvlb-hostile-evil.txt").exists()


@pytest.mark.parametrize(
    "request_kw",
    [
        pytest.param(
            {"data": b"\xff" * 100, "headers": {"Content-Type": "multipart/form-data; boundary=zz"}},
            id="upload-malformed-multipart",
        ),
        pytest.param({"data": b"not a form", "headers": {"Content-Type": "text/plain"}}, id="upload-not-a-form"),
    ],
)
def test_ui_upload_route_refuses_a_broken_form(cluster, web, request_kw):
    """Gradio's own route answers in its own shape (JSON or a plain-text reason): a 4xx that says why."""
    r = web.post(cluster["url"] + "/gradio_api/upload", timeout=30, **request_kw)
    assert 400 <= r.status_code < 500, describe(r)
    assert r.text.strip(), describe(r)


@pytest.mark.parametrize(
    "args, words",
    [
        pytest.param(("", 1.0, -1, False), "empty", id="ui-empty-text"),
        pytest.param((None, 1.0, -1, False), "missing", id="ui-no-text"),
        pytest.param(("x" * 20_001, 1.0, -1, False), "limit of 20000", id="ui-text-over-max-long-chars"),
        pytest.param(("\u200b\u200d", 1.0, -1, False), "no audio", id="ui-only-zero-width-text"),
        pytest.param(("Hello", 99, -1, False), "maximum", id="ui-speed-99"),
        pytest.param(("Hello", 1.0, 2**40, False), "seed", id="ui-seed-2**40"),
    ],
)
def test_ui_gives_a_clear_error_through_gradio_client(cluster, args, words):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    client = Client(cluster["url"] + "/", verbose=False)
    with pytest.raises(AppError) as raised:
        client.predict(*args, api_name="/generate")
    assert words in str(raised.value), str(raised.value)
    assert "Traceback" not in str(raised.value)


# --- the CLI -------------------------------------------------------------------------------------


@pytest.fixture
def scratch():
    path = Path(tempfile.mkdtemp(prefix="cvlb-h-", dir="/tmp"))
    (path / "file").write_text("a regular file\n")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def ours(marker: str) -> list[psutil.Process]:
    """Processes whose command line names ``marker`` (the case's scratch dir)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


@dataclass
class CliCase:
    args: Callable[[Path, int], list[str]]  # (scratch dir, a free port) -> arguments
    words: str  # in stderr; {d} is the scratch dir


def cli_case(id: str, args: Callable[[Path, int], list[str]], words: str) -> Any:
    return pytest.param(CliCase(args, words), id=id)


def common(scratch: Path, port: int, state: str = "s") -> list[str]:
    return [
        "--engine",
        "espeak",
        "--instances",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-port",
        str(port + 1),
        "--state-dir",
        str(scratch / state),
    ]


CLI_CASES = [
    cli_case("render-port--1", lambda d, p: ["render", *common(d, p), "--port", "-1"], "not a TCP port"),
    cli_case("render-port-70000", lambda d, p: ["render", *common(d, p), "--port", "70000"], "not a TCP port"),
    cli_case("up-port-70000", lambda d, p: ["up", *common(d, p), "--port", "70000"], "not a TCP port"),
    cli_case(
        "render-base-port-70000", lambda d, p: ["render", *common(d, p), "--base-port", "70000"], "not a TCP port"
    ),
    cli_case(
        "render-instances-abc", lambda d, p: ["render", *common(d, p), "--instances", "abc"], "number of instances"
    ),
    cli_case("up-instances-abc", lambda d, p: ["up", *common(d, p), "--instances", "abc"], "number of instances"),
    cli_case("render-instances-0", lambda d, p: ["render", *common(d, p), "--instances", "0"], "number of instances"),
    cli_case(
        "plan-footprint-12XB",
        lambda d, p: ["plan", "--engine", "espeak", "--footprint", "12XB"],
        "cannot read size '12XB'",
    ),
    cli_case(
        "render-footprint-12XB",
        lambda d, p: ["render", *common(d, p), "--footprint", "12XB"],
        "cannot read size '12XB'",
    ),
    cli_case("render-max-upload-12XB", lambda d, p: ["render", *common(d, p), "--max-upload", "12XB"], "--max-upload"),
    cli_case(
        "render-probe-interval-0", lambda d, p: ["render", *common(d, p), "--probe-interval", "0"], "--probe-interval"
    ),
    cli_case(
        "render-probe-interval-nan",
        lambda d, p: ["render", *common(d, p), "--probe-interval", "nan"],
        "--probe-interval",
    ),
    cli_case(
        "render-request-timeout-inf",
        lambda d, p: ["render", *common(d, p), "--request-timeout", "inf"],
        "--request-timeout",
    ),
    cli_case("render-max-chars-0", lambda d, p: ["render", *common(d, p), "--max-chars", "0"], "--max-chars"),
    cli_case(
        "render-unknown-engine", lambda d, p: ["render", *common(d, p), "--engine", "nope"], "'nope' is not one of"
    ),
    cli_case("up-unknown-engine", lambda d, p: ["up", *common(d, p), "--engine", "nope"], "'nope' is not one of"),
    cli_case(
        "render-state-dir-is-a-file", lambda d, p: ["render", *common(d, p), "--state-dir", str(d / "file")], "{d}/file"
    ),
    cli_case("up-state-dir-is-a-file", lambda d, p: ["up", *common(d, p), "--state-dir", str(d / "file")], "{d}/file"),
    cli_case(
        "up-state-dir-under-a-file", lambda d, p: ["up", *common(d, p), "--state-dir", str(d / "file/sub")], "{d}/file"
    ),
    cli_case(
        "up-model-dir-missing",
        lambda d, p: ["up", *common(d, p), "--engine", "cosyvoice3", "--model-dir", str(d / "no-such-model")],
        "no-such-model",
    ),
    cli_case(
        "render-model-dir-missing",
        lambda d, p: ["render", *common(d, p), "--engine", "auto", "--model-dir", str(d / "no-such-model")],
        "no-such-model",
    ),
]


@pytest.mark.parametrize("c", CLI_CASES)
def test_cli_refuses_bad_flags_and_places_with_one_clear_line(scratch, c: CliCase):
    port = free_port_block(2)
    done = cli(*c.args(scratch, port), timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert ours(str(scratch)) == [], "a failed command left processes behind"
    assert port_free(port) and port_free(port + 1)
    assert "Traceback" not in done.stderr, done.stderr[-1500:]
    assert c.words.format(d=scratch) in done.stderr, output[-1500:]


def test_cli_up_on_a_port_in_use_says_so_and_leaves_nothing_behind(scratch):
    port = free_port_block(2)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        done = cli("up", *common(scratch, port), timeout=120)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-1500:]
    assert f"port {port}" in done.stderr and "not free" in done.stderr, done.stderr
    assert ours(str(scratch)) == []
    assert port_free(port + 1)


# --- afterwards: nothing restarted, nothing crashed ------------------------------------------------


def test_the_instances_never_restarted(cluster, web):
    time.sleep(1)  # a crash just now would have the instance restarting
    code, body = status(cluster["state_dir"])
    now = {i["name"]: i["pid"] for i in body["instances"]}
    assert now == cluster["instances"], f"instances restarted: before {cluster['instances']}, now {now}"
    assert [i["restarts"] for i in body["instances"]] == [0] * INSTANCES, body["instances"]
    assert code == 0 and all(i["ready"] and i["in_rotation"] for i in body["instances"]), body
    assert web.get(cluster["url"] + "/ping", timeout=5).status_code == 200


def test_no_instance_logged_an_unexpected_traceback(cluster):
    for name in cluster["instances"]:
        log = (cluster["state_dir"] / "logs" / f"{name}.log").read_text(errors="replace")
        found = unexpected_tracebacks(log)
        assert found == [], f"{name}: {len(found)} traceback(s), the first:\n{found[0] if found else ''}"
