"""The streaming session's messages (``/v1/audio/speech/stream``): what a client may send,
what it is told, and which close code ends which kind of session (pure).

Client to server, as JSON text frames (vLLM-Omni's names are accepted too):

- ``session.config`` first, once: the voice and the way it speaks (below).
- ``input.text.delta`` ``{"delta": "..."}`` any number of times (vLLM-Omni: ``input.text``
  ``{"text": "..."}``).
- ``input.text.done`` once (vLLM-Omni: ``input.done``): the text is complete.
- ``session.close``: stop now; nothing more is spoken.

Server to client: ``session.created`` (what the session will do), the audio as binary frames
(or ``audio.delta`` events with base64 audio when the config asks for ``"stream_format":
"events"``), then ``done`` (``session.done`` for a client that spoke vLLM-Omni's names) with
counts and timings, then close 1000. An error is one ``error`` event in the HTTP API's
body shape, then a close code of its class (:data:`CLOSE_CODES`).

Instance side: standard library only.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any

from cosyvoice_lb.common.error_body import error_body
from cosyvoice_lb.instance.speech.validation import BadRequest, check_text, safe

PATH = "/v1/audio/speech/stream"

NORMAL = 1000
GOING_AWAY = 1001  # the instance is stopping (a drain): reconnect, another instance answers
INTERNAL = 1011
BAD_INPUT = 4400
UNAUTHORIZED = 4401
TIMED_OUT = 4408  # idle too long, or the session ran past its length
TOO_MUCH_TEXT = 4413
OVERLOADED = 4503  # no engine slot free (a session that proved its token in its first message)

# The close codes, documented in docs/api.md: code -> what it means for the client.
CLOSE_CODES = {
    NORMAL: "the session is done: all its audio was sent",
    GOING_AWAY: "the instance is stopping: what was spoken is whole; open a new session for the rest",
    INTERNAL: "the synthesis failed: the instance is still up; open a new session",
    BAD_INPUT: "a message was not valid (the error event says which and why)",
    UNAUTHORIZED: "no valid credentials: send the header Authorization: Bearer <token>, or a token in session.config",
    TIMED_OUT: "no message within --stream-idle-timeout, or the session ran past --stream-max-seconds",
    TOO_MUCH_TEXT: "the session's text ran past --stream-max-chars",
    OVERLOADED: "no engine slot was free: retry after the error's retry_after seconds",
}

CONFIG = ("session.config",)
DELTA = {"input.text.delta": "delta", "input.text": "text"}  # type -> the field with the text
DONE = ("input.text.done", "input.done")
CLOSE = ("session.close",)
OMNI = ("input.text", "input.done")  # vLLM-Omni's names: it is answered with session.done

CONFIG_FIELDS = (
    "voice",
    "prompt_audio",
    "prompt_text",
    "mode",
    "instructions",
    "response_format",
    "speed",
    "seed",
    "speaker",
    "stream_format",
    "token",
)
# vLLM-Omni's and OpenAI's fields that change nothing here: accepted, not used.
IGNORED_FIELDS = ("model", "language", "task_type", "stream_audio", "split_granularity", "type", "session")
STREAM_FORMATS = ("audio", "events")


def close_code(status: int) -> int:
    """The close code for an error of HTTP ``status``."""
    if status in (401, 403):
        return UNAUTHORIZED
    if status == 413:
        return TOO_MUCH_TEXT
    if status in (408, 504):
        return TIMED_OUT
    if status in (429, 503):
        return OVERLOADED
    if 400 <= status < 500:
        return BAD_INPUT
    return INTERNAL


def error_event(status: int, message: str, param: str | None = None, retry_after: int | None = None) -> str:
    body: dict[str, Any] = {"type": "error", **error_body(status, message, param)}
    if retry_after is not None:
        body["error"]["retry_after"] = retry_after
    return json.dumps(body)


@dataclass(frozen=True)
class Message:
    """One client message: its ``kind`` (config, delta, done, close), its text (a delta's)
    and its fields (a config's); ``omni``: it used vLLM-Omni's name."""

    kind: str
    text: str = ""
    fields: dict[str, Any] = field(default_factory=dict)
    omni: bool = False


def parse(frame: str | bytes | None) -> Message:
    """A client's frame as a :class:`Message`; BadRequest (4400) saying what was wrong."""
    if frame is None or isinstance(frame, bytes):
        raise BadRequest('send JSON text frames, not binary ones: e.g. {"type": "input.text.delta", "delta": "Hi"}')
    try:
        message = json.loads(frame)
    except (ValueError, RecursionError):
        raise BadRequest(f"a frame is not valid JSON: {safe(frame[:80])!r}") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise BadRequest('each message is a JSON object with a "type", e.g. {"type": "input.text.done"}')
    kind = message["type"]
    if kind in CONFIG:
        nested = message.get("session")
        fields = {**message, **nested} if isinstance(nested, dict) else dict(message)
        return Message("config", fields={k: v for k, v in fields.items() if k not in IGNORED_FIELDS})
    if kind in DELTA:
        name = DELTA[kind]
        text = message.get(name)
        if not isinstance(text, str):
            raise BadRequest(f'{kind} needs "{name}": the next piece of text, as a string', param=name)
        return Message("delta", text=text, omni=kind in OMNI)
    if kind in DONE:
        return Message("done", omni=kind in OMNI)
    if kind in CLOSE:
        return Message("close")
    known = ", ".join((*CONFIG, *DELTA, *DONE, *CLOSE))
    raise BadRequest(f"unknown message type {safe(kind)!r}: the types are {known}", param="type")


@dataclass(frozen=True)
class Config:
    """A session's ``session.config``: the request every sentence repeats (the OpenAI
    speech route's fields, as a pipeline payload), its prompt audio, how audio goes out."""

    body: dict[str, Any]  # the OpenAI-shaped request (input left out)
    prompt_audio: bytes | None
    response_format: str
    events: bool  # audio as base64 events rather than binary frames
    token: str


def read_config(fields: dict[str, Any], max_upload: int) -> Config:
    """``session.config``'s fields checked; BadRequest naming the field otherwise."""
    unknown = sorted(set(fields) - set(CONFIG_FIELDS))
    if unknown:
        raise BadRequest(
            f"unknown field(s) {', '.join(safe(n) for n in unknown)} in session.config: the fields are "
            f"{', '.join(CONFIG_FIELDS)}"
        )
    stream_format = fields.get("stream_format") or "audio"
    if stream_format not in STREAM_FORMATS:
        raise BadRequest(f'"stream_format" {safe(stream_format)!r} is not audio or events', param="stream_format")
    token = fields.get("token") or ""
    if not isinstance(token, str):
        raise BadRequest('"token" must be a string: an API token', param="token")
    prompt = fields.get("prompt_audio")
    audio = None
    if prompt not in (None, ""):
        if not isinstance(prompt, str):
            raise BadRequest(
                '"prompt_audio" must be base64 of an audio file (WAV, FLAC, MP3, ...)', param="prompt_audio"
            )
        if len(prompt) * 3 // 4 > max_upload:
            raise BadRequest(f'"prompt_audio" is larger than --max-upload ({max_upload} bytes)', status=413)
        try:
            audio = base64.b64decode(prompt, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest('"prompt_audio" is not valid base64: send the audio file base64-encoded') from None
    body = {k: v for k, v in fields.items() if k not in ("prompt_audio", "stream_format", "token")}
    body["response_format"] = fields.get("response_format") or "pcm"
    if body.get("instructions") not in (None, ""):
        check_text(body["instructions"], 4096, "instructions")
    return Config(body, audio, body["response_format"], stream_format == "events", token)
