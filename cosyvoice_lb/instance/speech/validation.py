"""Request validation (pure): a decoded request in, a :class:`SynthesisRequest` or a
:class:`BadRequest` that says what to change out. Every entry point (the API, the UI)
validates through here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from cosyvoice_lb.common.settings import MIN_PROMPT_SECONDS
from cosyvoice_lb.instance.engines import MODES, SynthesisRequest

MIN_SPEED, MAX_SPEED = 0.5, 2.0
OPENAI_SPEEDS = (0.25, 4.0)  # what OpenAI's speech API takes (and so a long text's segments)
SPECIAL = re.compile(r"<\|.{0,40}?\|>", re.DOTALL)
WORD = re.compile(r"\w")  # a letter, digit or ideograph: something a voice can say
FIELDS = ("text", "speed", "mode", "prompt_text", "instruct_text", "speaker", "seed", "stream", "voice")


def prompt_span(max_seconds: float) -> str:
    """The prompt length every message and label asks for, e.g. "3-15 s"."""
    return f"{MIN_PROMPT_SECONDS:g}-{max_seconds:g} s"


def request_schema(max_chars: int, modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    """The JSON body of ``POST /v1/tts`` as a JSON Schema (for the OpenAPI description;
    :func:`make_request` is what enforces it, with messages that say what to change)."""
    text = {"type": "string", "minLength": 1, "maxLength": max_chars}
    return {
        "type": "object",
        "required": ["text"],
        "additionalProperties": False,
        "properties": {
            "text": {**text, "description": "What to say."},
            "speed": {"type": "number", "minimum": MIN_SPEED, "maximum": MAX_SPEED, "default": 1.0},
            "mode": {"type": "string", "enum": list(modes), "description": "Default: the model's first mode."},
            "prompt_text": {**text, "minLength": 0, "description": "zero_shot: the transcript of prompt_audio."},
            "instruct_text": {**text, "minLength": 0, "description": "instruct: how to speak."},
            "speaker": {"type": "string", "description": "sft: a built-in speaker."},
            "seed": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1},
            "stream": {"type": "boolean", "default": False, "description": "WAV chunks as they are made."},
            "voice": {"type": "string", "description": "A saved voice (id or name, see /v1/audio/voices)."},
        },
    }


class BadRequest(ValueError):
    """Client input that cannot be served; the message tells the client what to change."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param  # the field at fault (OpenAI's error "param")


@dataclass(frozen=True)
class Limits:
    max_chars: int = 500  # one synthesis
    max_long_chars: int = 0  # longer texts are split and fanned out (0: none)

    @property
    def text_chars(self) -> int:
        """The longest text a request may send."""
        return max(self.max_chars, self.max_long_chars)

    def long(self, text: str) -> bool:
        """A text one synthesis does not take: split, and its segments sent across the cluster."""
        return len(text) > self.max_chars

    max_prompt_seconds: float = 15.0
    max_upload_bytes: int = 10 * 1024 * 1024


def safe(value: Any, limit: int = 60) -> str:
    """A client's value quoted into a message: printable, UTF-8-safe, and short."""
    text = value if isinstance(value, str) else repr(value)
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit] + "…"


def check_text(text: Any, max_chars: int, name: str = "text", required: bool = True) -> str:
    """The text field ``name``, checked (BadRequest naming the field otherwise)."""
    try:
        return _text(text, max_chars, name, required)
    except BadRequest as exc:
        exc.param = name
        raise


def _text(text: Any, max_chars: int, name: str, required: bool) -> str:
    if text is None or (text == "" and not required):
        if required:
            raise BadRequest(f'"{name}" is missing: send the text to speak, e.g. {{"{name}": "Hello"}}')
        return ""
    if not isinstance(text, str):
        raise BadRequest(f'"{name}" must be a string, not {type(text).__name__}')
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON can carry a lone UTF-16 surrogate ("\ud800"); UTF-8 cannot
        bad = ascii(text[exc.start : exc.end])
        raise BadRequest(
            f'"{name}" holds {bad} at character {exc.start}, a lone UTF-16 surrogate that is not '
            "text: send valid Unicode (a surrogate pair or the character itself)"
        ) from None
    if "<|" in text and "|>" in text:  # upstream's own test for "special tokens inside"
        found = SPECIAL.search(text)
        shown = safe(found.group(0)) if found else "<| and |>"
        raise BadRequest(
            f'"{name}" holds {shown}, the form of the model\'s special tokens (e.g. <|endofprompt|>), which '
            "would skip text normalisation or derail the prompt: remove it (the service adds what a mode needs)"
        )
    if required and not text.strip():
        raise BadRequest(f'"{name}" is empty: send some text')
    if required and not WORD.search(text):  # upstream would drop it, or (cross-lingual) speak its own prompt
        raise BadRequest(
            f'"{name}" has no word in it, only punctuation, symbols or spaces, for which the model makes no '
            "audio: send words to speak",
            status=422,
        )
    if len(text) > max_chars:
        raise BadRequest(
            f'"{name}" has {len(text)} characters, more than the limit of {max_chars}: split it into shorter '
            "requests (the cluster's --max-chars, or --max-long-chars for long texts)",
            status=413,
        )
    return text


def check_speed(speed: Any, low: float = MIN_SPEED, high: float = MAX_SPEED) -> float:
    try:
        return _speed(speed, low, high)
    except BadRequest as exc:
        exc.param = "speed"
        raise


def _speed(speed: Any, low: float, high: float) -> float:
    if isinstance(speed, bool) or not isinstance(speed, (int, float)):
        raise BadRequest(f'"speed" must be a number between {low} and {high}, not {speed!r}')
    try:
        speed = float(speed)
    except OverflowError:  # an integer of hundreds of digits
        raise BadRequest(f'"speed" is out of range: it must be between {low} and {high}') from None
    if not (math.isfinite(speed) and low <= speed <= high):
        raise BadRequest(f'"speed" is {speed}: it must be between {low} and {high}')
    return float(speed)


def check_seed(seed: Any) -> int | None:
    if seed is None or seed == "":
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise BadRequest(f'"seed" must be a whole number from 0 to {2**32 - 1}, not {seed!r}')
    return seed


def make_request(
    payload: dict,
    limits: Limits,
    modes: tuple[str, ...],
    speakers: list[str],
    has_prompt: bool,
    speeds: tuple[float, float] = (MIN_SPEED, MAX_SPEED),
) -> SynthesisRequest:
    """Validate one request (already decoded: JSON or form) against what the engine offers.

    ``has_prompt``: prompt audio (or a saved voice) came with it; ``speeds``: the range the
    entry point accepts. Raises :class:`BadRequest`.
    """
    unknown = sorted(set(payload) - set(FIELDS))
    if unknown:
        raise BadRequest(
            f"unknown field(s) {', '.join(safe(name) for name in unknown)}: accepted fields are {', '.join(FIELDS)}"
            " (and the file prompt_audio in a multipart form)"
        )
    text = check_text(payload.get("text"), limits.text_chars)
    speed = check_speed(payload.get("speed", 1.0), *speeds)
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f'"stream" must be true or false, not {stream!r}')
    if stream and speed != 1.0:
        raise BadRequest('"speed" works only without streaming: drop "stream" or use speed 1.0')
    mode = payload.get("mode") or ""
    if not isinstance(mode, str):
        raise BadRequest(f'"mode" must be a string, one of {", ".join(modes)}')
    if mode and mode not in MODES:
        raise BadRequest(f"unknown mode {safe(mode)!r}: this model offers {', '.join(modes)}")
    if mode and mode not in modes:
        raise BadRequest(f"mode {mode} is not available with this model: choose one of {', '.join(modes)}")
    effective = mode or modes[0]
    prompt_text = check_text(payload.get("prompt_text", ""), limits.max_chars, "prompt_text", required=False)
    instruct_text = check_text(payload.get("instruct_text", ""), limits.max_chars, "instruct_text", required=False)
    speaker = payload.get("speaker") or ""
    if not isinstance(speaker, str):
        raise BadRequest('"speaker" must be a string')
    if speaker and speaker not in speakers:
        raise BadRequest(
            f"unknown speaker {speaker!r}: choose one of {', '.join(speakers) or '(none: this model has no built-in speakers)'}"
        )
    needs_prompt = effective in ("zero_shot", "cross_lingual") or (effective == "instruct" and not speakers)
    if mode and needs_prompt and not has_prompt:
        raise BadRequest(
            f"mode {mode} needs prompt_audio: send a multipart form with the file prompt_audio "
            f"({prompt_span(limits.max_prompt_seconds)} of the voice to clone)"
        )
    if effective == "zero_shot" and (mode or has_prompt) and not prompt_text.strip():
        raise BadRequest("mode zero_shot needs prompt_text: the exact transcript of prompt_audio")
    if effective == "instruct" and not instruct_text.strip():
        raise BadRequest('mode instruct needs instruct_text, e.g. "Speak slowly and warmly"')
    return SynthesisRequest(
        text=text,
        speed=speed,
        mode=mode,
        prompt_text=prompt_text,
        instruct_text=instruct_text,
        speaker=speaker,
        seed=check_seed(payload.get("seed")),
        stream=stream,
    )


def form_payload(form: dict[str, str]) -> dict:
    """Form fields are strings: give speed, seed and stream their JSON types."""
    payload: dict[str, Any] = {k: v for k, v in form.items() if v != ""}
    for name, kind in (("speed", float), ("seed", int)):
        if name in payload:
            try:
                payload[name] = kind(payload[name])
            except ValueError:
                raise BadRequest(f'"{name}" must be a number, not {payload[name]!r}') from None
    if "stream" in payload:
        value = payload["stream"].strip().lower()
        if value not in ("true", "false", "1", "0", "yes", "no"):
            raise BadRequest(f'"stream" must be true or false, not {payload["stream"]!r}')
        payload["stream"] = value in ("true", "1", "yes")
    return payload


def multipart_problem(content_type: str, body: bytes) -> str:
    """What is wrong with a multipart body's frame ("" if nothing): a body cut off inside a
    file part would otherwise be read as a shorter file."""
    boundary = ""
    for param in content_type.split(";")[1:]:
        key, _, value = param.strip().partition("=")
        if key.lower() == "boundary":
            boundary = value.strip('"')
    if not boundary:
        return "its Content-Type names no boundary"
    closing = b"--" + boundary.encode("latin-1", "replace") + b"--"
    if not body.rstrip(b"\r\n").endswith(closing):
        return f"it does not end with its closing boundary --{safe(boundary, 40)}--: cut off, or a different boundary"
    return ""
