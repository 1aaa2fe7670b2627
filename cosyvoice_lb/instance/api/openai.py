"""The OpenAI-compatible routes: speech, models and saved voices.

``POST /v1/audio/speech`` takes OpenAI's request (``model``, ``input``, ``voice``,
``instructions``, ``response_format``, ``speed``, ``stream_format``) plus CosyVoice's own
options as extra fields (``mode``, ``prompt_text``, ``seed``, ``speaker``), and answers with
audio in the asked format as it is made (or as server-sent events). It is one more adapter
onto the pipeline: the same checks, admission, long-text fan-out and error table as
``/v1/tts``, with errors in OpenAI's shape (``problems``).

OpenAI's voice names (alloy, nova, ...) speak in the model's default voice unless
``--openai-voices`` maps them to a saved voice or a built-in speaker; any other name is a
saved voice (id or name) or a built-in speaker.

Instance side: standard library, numpy, starlette/fastapi.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from cosyvoice_lb.instance.api.forms import read_form
from cosyvoice_lb.instance.api.streams import AudioStream, Framing, audio_source, first_of, streaming_headers
from cosyvoice_lb.instance.audio.formats import CONTENT_TYPES, FORMATS, Encoder, available
from cosyvoice_lb.instance.speech.admission import is_background
from cosyvoice_lb.instance.speech.fanout import FanOut
from cosyvoice_lb.instance.speech.pipeline import Pipeline
from cosyvoice_lb.instance.speech.validation import OPENAI_SPEEDS, BadRequest, check_text, safe

VOICES = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "onyx",
    "nova",
    "sage",
    "shimmer",
    "verse",
    "marin",
    "cedar",
)
MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
MAX_INPUT = 4096
OPENAI_FIELDS = ("model", "input", "voice", "instructions", "response_format", "speed", "stream_format")
EXTRA_FIELDS = ("mode", "prompt_text", "seed", "speaker")
VOICE_FORM = ("name", "audio_sample", "prompt_text", "consent")


def speech_request(body: Any, voice_map: dict[str, str], speakers: list[str]) -> tuple[dict, str, bool]:
    """OpenAI's request -> (the pipeline's payload, response format, server-sent events?)."""
    if not isinstance(body, dict):
        raise BadRequest('the body must be a JSON object, e.g. {"model": "tts-1", "input": "Hello", "voice": "alloy"}')
    unknown = sorted(set(body) - set(OPENAI_FIELDS) - set(EXTRA_FIELDS))
    if unknown:
        raise BadRequest(
            f"unknown field(s) {', '.join(safe(n) for n in unknown)}: accepted fields are "
            f"{', '.join(OPENAI_FIELDS)}, and CosyVoice's {', '.join(EXTRA_FIELDS)}"
        )
    model = body.get("model", "")
    if not isinstance(model, str):
        raise BadRequest('"model" must be a string (any model name works, see GET /v1/models)', param="model")
    text = body.get("input")
    if isinstance(text, str) and len(text) > MAX_INPUT:  # (OpenAI answers 400, not 413)
        raise BadRequest(
            f'"input" has {len(text)} characters, more than the {MAX_INPUT} this API takes: send it in parts, '
            'or POST it to /v1/tts as {"text": ...} (up to --max-long-chars)',
            param="input",
        )
    text = check_text(text, MAX_INPUT, "input")
    fmt = body.get("response_format") or "mp3"
    if fmt not in FORMATS:
        raise BadRequest(f'"response_format" {safe(fmt)!r} is not one of {", ".join(FORMATS)}', param="response_format")
    problem = available(fmt)
    if problem:
        raise BadRequest(problem, param="response_format")
    stream_format = body.get("stream_format") or "audio"
    if stream_format not in ("audio", "sse"):
        raise BadRequest(f'"stream_format" {safe(stream_format)!r} is not audio or sse', param="stream_format")
    speed = body.get("speed", 1.0)
    payload: dict[str, Any] = {k: body[k] for k in EXTRA_FIELDS if body.get(k) not in (None, "")}
    payload.update(text=text, speed=speed)
    # Chunks as the engine makes them, unless the speed changes (the engine's speed works
    # on whole texts only): then the audio goes out once it is done.
    payload["stream"] = isinstance(speed, (int, float)) and not isinstance(speed, bool) and speed == 1.0
    instructions = body.get("instructions")
    if instructions not in (None, ""):
        payload["instruct_text"] = check_text(instructions, MAX_INPUT, "instructions")
        payload.setdefault("mode", "instruct")
    target = voice_target(body.get("voice"), voice_map)
    if target and target in speakers:
        payload.setdefault("speaker", target)
    elif target:
        payload["voice"] = target
    return payload, fmt, stream_format == "sse"


def voice_target(voice: Any, voice_map: dict[str, str]) -> str:
    """What an OpenAI ``voice`` speaks with: a saved voice or speaker, or "" (the default)."""
    if voice is None:
        return ""
    if isinstance(voice, dict) and set(voice) == {"id"} and isinstance(voice["id"], str):
        voice = voice["id"]
    if not isinstance(voice, str):
        raise BadRequest(
            '"voice" must be a voice name (e.g. "alloy"), a saved voice id, or {"id": "voice_..."}', param="voice"
        )
    if voice in voice_map:
        return voice_map[voice]
    if voice.lower() in VOICES:
        return voice_map.get(voice.lower(), "")
    return voice


async def read_voice_form(request: Request, max_bytes: int) -> dict[str, Any]:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "multipart/form-data":
        raise BadRequest(
            "send multipart/form-data with name, audio_sample (the file), prompt_text (its transcript) and "
            "consent=yes (the speaker agreed), e.g. curl -F name=narrator -F audio_sample=@voice.wav "
            "-F prompt_text='...' -F consent=yes"
        )
    fields, data = await read_form(request, "audio_sample", len(VOICE_FORM) - 1, max_bytes)
    unknown = sorted(set(fields) - set(VOICE_FORM))
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(safe(n) for n in unknown)}: send {', '.join(VOICE_FORM)}")
    return {**fields, "audio_sample": data}


def add_openai_routes(
    app: FastAPI, pipeline: Pipeline, fanout: FanOut | None, voice_map: dict[str, str], port: int
) -> None:
    engine = pipeline.engine

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        ids = (engine.name, *MODELS)
        return {
            "object": "list",
            "data": [{"id": i, "object": "model", "created": created, "owned_by": "cosyvoice-lb"} for i in ids],
        }

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        pipeline.route(request.headers)  # (see /v1/tts)
        body = await request.body()
        try:
            decoded = json.loads(body) if body.strip() else None
        except (ValueError, RecursionError):
            raise BadRequest(
                'the body is not valid JSON: POST {"model": "tts-1", "input": "Hello", "voice": "alloy"}'
            ) from None
        if decoded is None:
            raise BadRequest('no body: POST {"model": "tts-1", "input": "Hello", "voice": "alloy"}')
        payload, fmt, sse = speech_request(decoded, voice_map, engine.speakers())
        encoder = Encoder(fmt, engine.sample_rate)  # (before any synthesis: it may refuse)
        loop = asyncio.get_running_loop()
        job = await loop.run_in_executor(
            None, lambda: pipeline.prepare(payload, None, speeds=OPENAI_SPEEDS, route="openai", headers=request.headers)
        )
        job.background = is_background(request.headers)  # (a job's segment: interactive requests first)
        deadline = pipeline.deadline(request.headers.get("x-request-start"))
        source = audio_source(pipeline, fanout, job, payload, None, request.headers, deadline)
        first = await first_of(source, request)
        headers = streaming_headers({"X-Instance-Port": str(port)})
        usage = {"input_tokens": len(payload["text"]), "output_tokens": 0, "total_tokens": len(payload["text"])}
        media = "text/event-stream" if sse else CONTENT_TYPES[fmt]
        return AudioStream(
            pipeline, first, source, encoder.feed, encoder.finish, media, headers, Framing(sse=sse, usage=usage)
        )

    @app.post("/v1/audio/voices")
    async def create_voice(request: Request):
        pipeline.voices()  # refused before the upload is read when this engine cannot clone
        fields = await read_voice_form(request, pipeline.limits.max_upload_bytes)
        voice, notices = await asyncio.get_running_loop().run_in_executor(
            None,
            pipeline.save_voice,
            fields.get("name"),
            fields.get("audio_sample"),
            fields.get("prompt_text"),
            fields.get("consent", ""),
        )
        return {**voice.public(), **({"notices": notices} if notices else {})}

    @app.get("/v1/audio/voices")
    async def list_voices():
        voices = await asyncio.get_running_loop().run_in_executor(None, lambda: pipeline.voices().all())
        return {"object": "list", "data": [v.public() for v in voices]}

    @app.get("/v1/audio/voices/{voice_id}")
    async def get_voice(voice_id: str):
        voice = await asyncio.get_running_loop().run_in_executor(None, lambda: pipeline.voices().require(voice_id))
        return voice.public()

    @app.delete("/v1/audio/voices/{voice_id}")
    async def delete_voice(voice_id: str):
        voice = await asyncio.get_running_loop().run_in_executor(None, lambda: pipeline.voices().delete(voice_id))
        return JSONResponse({"id": voice.id, "object": "audio.voice.deleted", "deleted": True})
