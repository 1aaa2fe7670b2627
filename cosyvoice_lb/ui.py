"""The Gradio UI at "/": an entry point onto the instance's pipeline.

The same modes, checks and errors as the API (``pipeline.describe`` words them), audio
streamed as it is made when ffmpeg is there to encode it. Gradio's own queue bounds what
waits here, so the UI's syntheses wait their turn instead of being refused.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np

from .engines import clones
from .fanout import FanOut, blocking
from .metrics import outcome_of
from .pipeline import Pipeline, describe
from .streams import audio_source
from .validation import MAX_SPEED, MIN_SPEED, BadRequest

MODE_LABELS = {
    "zero_shot": "Zero-shot clone (prompt audio + its transcript)",
    "cross_lingual": "Cross-lingual clone (prompt audio)",
    "instruct": "Instruct (style in words)",
    "sft": "Built-in speaker",
}


def int16(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio, -1, 1) * 32767).astype(np.int16)


def saved_voices(pipeline: Pipeline) -> list[tuple[str, str]]:
    """(label, id) of every saved voice, for the dropdown ([] where voices do not apply)."""
    if pipeline.registry is None or not clones(pipeline.engine):
        return []
    return [(voice.name, voice.id) for voice in pipeline.registry.all()]


def mount_ui(app: Any, pipeline: Pipeline, port: int, fanout: FanOut | None = None) -> Any:
    """Mount the UI on ``app`` (FastAPI) at "/" and return what Gradio returns. A text past
    --max-chars goes to the cluster in segments (``fanout``), as from the API."""
    import gradio as gr

    engine, limits = pipeline.engine, pipeline.limits
    modes = pipeline.modes
    cloning = any(m in modes for m in ("zero_shot", "cross_lingual", "instruct"))
    has_voices = cloning and pipeline.registry is not None
    # Gradio encodes a streamed audio output with ffmpeg; without it the UI plays whole results.
    can_stream = shutil.which("ffmpeg") is not None

    def read_upload(path: str | None) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as handle:
            data = handle.read(limits.max_upload_bytes + 1)
        if len(data) > limits.max_upload_bytes:
            raise BadRequest(f"the prompt audio is larger than {limits.max_upload_bytes // 2**20} MiB")
        return data

    def generate(
        text, mode, prompt_audio, prompt_text, instruct_text, speaker, speed, seed, stream, voice=None, request=None
    ) -> Iterator[tuple[int, np.ndarray]]:
        payload = {
            "text": text,
            "mode": mode if len(pipeline.modes) > 1 else "",
            "prompt_text": prompt_text or "",
            "instruct_text": instruct_text or "",
            "speaker": speaker or "",
            "speed": float(speed),
            "stream": bool(stream) and can_stream,
            "seed": None if seed is None or int(seed) < 0 else int(seed),
        }
        if voice:
            payload.update(voice=voice, prompt_text="")
        job = None
        outcome = "cancelled"  # (what stays when the browser leaves mid-stream)
        try:
            upload = None if voice else read_upload(prompt_audio)
            job = pipeline.prepare(payload, upload, route="ui")
            for notice in job.notices:
                gr.Info(notice)
            if limits.long(job.request.text):  # segments across the cluster
                headers = dict(request.headers) if request is not None else {}
                long_job, job = job, None
                pieces = blocking(lambda: audio_source(pipeline, fanout, long_job, payload, upload, headers, None))
                if long_job.request.stream:
                    for piece in pieces:
                        yield engine.sample_rate, int16(piece)
                else:
                    audio = np.concatenate(list(pieces))
                    pipeline.keep(audio)
                    yield engine.sample_rate, int16(audio)
            elif job.request.stream:
                for chunk in pipeline.chunks(job):
                    yield engine.sample_rate, int16(chunk)
            else:
                audio = pipeline.synthesize(job)
                pipeline.encode_wav(audio)  # refuses silence the same way as the API
                pipeline.keep(audio)
                yield engine.sample_rate, int16(audio)
            outcome = "ok"
        except Exception as exc:
            failure = describe(exc)
            outcome = outcome_of(failure.status if failure else 500)
            if failure is None:
                raise
            raise gr.Error(failure.message[:1].upper() + failure.message[1:]) from None
        finally:
            pipeline.metrics.request("ui", outcome)
            if job is not None:
                pipeline.finish(job)

    # Gradio passes the request to a parameter annotated gr.Request; this module's annotations
    # are strings, and "gr" is not a global here, so the class itself goes in.
    generate.__annotations__["request"] = gr.Request

    with gr.Blocks(title="cosyvoice-lb", delete_cache=(3600, 3600)) as ui:
        gr.Markdown(f"## Text to speech\nEngine `{engine.name}` · instance on port {port}")
        text = gr.Textbox(
            label="Text", lines=4, max_length=limits.text_chars, placeholder="Type what to say (English or 中文)"
        )
        voice = gr.Dropdown(
            saved_voices(pipeline),
            value=None,
            label="Saved voice (instead of prompt audio; save one with POST /v1/audio/voices)",
            visible=has_voices,
            # (the list is read at each page load; a voice saved since is still taken by id)
            allow_custom_value=True,
        )
        mode = gr.Radio([(MODE_LABELS[m], m) for m in modes], value=modes[0], label="Mode", visible=len(modes) > 1)
        with gr.Row(visible=cloning):
            prompt_audio = gr.Audio(
                label=f"Prompt audio (3-{limits.max_prompt_seconds:g} s, 16 kHz or more)",
                type="filepath",
                sources=["upload", "microphone"],
            )
            with gr.Column():
                prompt_text = gr.Textbox(label="Prompt transcript (zero-shot: exactly what the prompt says)")
                instruct_text = gr.Textbox(label="Instruction (instruct mode, e.g. 'Speak slowly and warmly')")
        speaker = gr.Dropdown(engine.speakers(), value=None, label="Built-in speaker", visible=bool(engine.speakers()))
        with gr.Row():
            speed = gr.Slider(MIN_SPEED, MAX_SPEED, value=1.0, step=0.1, label="Speed (not with streaming)")
            seed = gr.Number(value=-1, precision=0, label="Seed (-1: random)")
            stream = gr.Checkbox(value=False, label="Stream", visible=can_stream)
        button = gr.Button("Generate", variant="primary")
        audio = gr.Audio(label="Speech", type="numpy", interactive=False, streaming=can_stream, autoplay=False)
        if cloning:
            button.click(
                generate,
                inputs=[text, mode, prompt_audio, prompt_text, instruct_text, speaker, speed, seed, stream, voice],
                outputs=audio,
                api_name="generate",
            )
        else:  # API callers of a non-cloning engine pass only what it uses: generate(text, speed, seed, stream)

            def speak(text, speed, seed, stream, request=None):
                yield from generate(text, modes[0], None, "", "", None, speed, seed, stream, None, request)

            speak.__annotations__["request"] = gr.Request

            button.click(speak, inputs=[text, speed, seed, stream], outputs=audio, api_name="generate")

        def refresh():
            """At each page load: what the loaded model offers (built-in speakers are only
            known once it is loaded)."""
            now = pipeline.modes
            return (
                gr.update(choices=[(MODE_LABELS[m], m) for m in now], value=now[0], visible=len(now) > 1),
                gr.update(choices=engine.speakers(), visible=bool(engine.speakers())),
                gr.update(choices=saved_voices(pipeline)),  # whichever instance saved them
            )

        ui.load(refresh, outputs=[mode, speaker, voice], api_name=False)

    return gr.mount_gradio_app(app, ui, path="/")
