"""The streaming session's messages (api.socket_protocol): both names for each message, the
config's checks, and the close code of each class of error."""

from __future__ import annotations

import base64
import json

import pytest

from cosyvoice_lb.instance.access.gate import TOKEN_IN_FIRST_MESSAGE
from cosyvoice_lb.instance.api import socket_protocol as protocol
from cosyvoice_lb.instance.speech.validation import BadRequest


@pytest.mark.parametrize(
    "frame,kind,text,omni",
    [
        ({"type": "input.text.delta", "delta": "Hi"}, "delta", "Hi", False),
        ({"type": "input.text", "text": "Hi"}, "delta", "Hi", True),
        ({"type": "input.text.done"}, "done", "", False),
        ({"type": "input.done"}, "done", "", True),
        ({"type": "session.close"}, "close", "", False),
    ],
)
def test_ours_and_vllm_omnis_names(frame, kind, text, omni):
    message = protocol.parse(json.dumps(frame))
    assert (message.kind, message.text, message.omni) == (kind, text, omni)


def test_a_config_flat_or_nested_and_the_foreign_fields_that_change_nothing():
    flat = protocol.parse(json.dumps({"type": "session.config", "voice": "alloy", "model": "x", "language": "en"}))
    nested = protocol.parse(json.dumps({"type": "session.config", "session": {"voice": "alloy"}}))
    assert flat.kind == nested.kind == "config" and flat.fields == nested.fields == {"voice": "alloy"}


@pytest.mark.parametrize(
    "frame,words",
    [
        (b"\x00", "not binary"),
        ("{", "not valid JSON"),
        ("[1]", '"type"'),
        (json.dumps({"type": "input.text.delta", "delta": 5}), '"delta"'),
        (json.dumps({"type": "input.text", "delta": "x"}), '"text"'),
        (json.dumps({"type": "response.create"}), "unknown message type"),
    ],
)
def test_bad_frames_say_what_is_wrong(frame, words):
    with pytest.raises(BadRequest) as caught:
        protocol.parse(frame)
    assert words in str(caught.value) and caught.value.status == 400


def test_config_defaults_and_checks():
    config = protocol.read_config({}, 1000)
    assert (config.response_format, config.events, config.prompt_audio, config.token) == ("pcm", False, None, "")
    audio = base64.b64encode(b"RIFF....").decode()
    config = protocol.read_config({"prompt_audio": audio, "stream_format": "events", "token": "t" * 20}, 1000)
    assert config.prompt_audio == b"RIFF...." and config.events and config.token == "t" * 20
    assert "prompt_audio" not in config.body and "token" not in config.body
    for fields, words in (
        ({"volume": 1}, "unknown field(s) volume"),
        ({"stream_format": "sse"}, "not audio or events"),
        ({"token": 5}, '"token" must be a string'),
        ({"prompt_audio": "***"}, "not valid base64"),
        ({"prompt_audio": "A" * 2000}, "larger than --max-upload"),
        ({"instructions": 7}, '"instructions" must be a string'),
    ):
        with pytest.raises(BadRequest) as caught:
            protocol.read_config(fields, 1000)
        assert words in str(caught.value), fields


@pytest.mark.parametrize(
    "status,code",
    [(400, 4400), (404, 4400), (422, 4400), (401, 4401), (403, 4401), (408, 4408), (504, 4408), (413, 4413)]
    + [(429, 4503), (503, 4503), (500, 1011), (502, 1011)],
)
def test_each_class_of_error_has_its_close_code(status, code):
    assert protocol.close_code(status) == code and code in protocol.CLOSE_CODES


def test_error_events_have_the_apis_body_and_a_retry_hint():
    event = json.loads(protocol.error_event(503, "busy", retry_after=1))
    assert event["type"] == "error" and event["error"]["status"] == 503 and event["error"]["retry_after"] == 1
    assert set(event["error"]) >= {"message", "type", "param", "code"}


def test_the_gate_knows_the_route_that_takes_a_token_in_its_first_message():
    assert TOKEN_IN_FIRST_MESSAGE == {protocol.PATH}
