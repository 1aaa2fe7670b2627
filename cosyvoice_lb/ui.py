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

from .pipeline import Pipeline, describe
from .validation import MAX_SPEED, MIN_SPEED, BadRequest

MODE_LABELS = {
    "zero_shot": "Zero-shot clone (prompt audio + its transcript)",
    "cross_lingual": "Cross-lingual clone (prompt audio)",
    "instruct": "Instruct (style in words)",
    "sft": "Built-in speaker",
}


def int16(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio, -1, 1) * 32767).astype(np.int16)


def mount_ui(app: Any, pipeline: Pipeline, port: int) -> Any:
    """Mount the UI on ``app`` (FastAPI) at "/" and return what Gradio returns."""
    import gradio as gr

    engine, limits = pipeline.engine, pipeline.limits
    modes = pipeline.modes
    cloning = any(m in modes for m in ("zero_shot", "cross_lingual", "instruct"))
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
        text, mode, prompt_audio, prompt_text, instruct_text, speaker, speed, seed, stream
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
        job = None
        try:
            job = pipeline.prepare(payload, read_upload(prompt_audio))
            for notice in job.notices:
                gr.Info(notice)
            if job.request.stream:
                for chunk in pipeline.chunks(job):
                    yield engine.sample_rate, int16(chunk)
            else:
                audio = pipeline.synthesize(job)
                pipeline.encode_wav(audio)  # refuses silence the same way as the API
                pipeline.keep(audio)
                yield engine.sample_rate, int16(audio)
        except Exception as exc:
            failure = describe(exc)
            if failure is None:
                raise
            raise gr.Error(failure.message[:1].upper() + failure.message[1:]) from None
        finally:
            if job is not None:
                pipeline.finish(job)

    with gr.Blocks(title="cosyvoice-lb", delete_cache=(3600, 3600)) as ui:
        gr.Markdown(f"## Text to speech\nEngine `{engine.name}` · instance on port {port}")
        text = gr.Textbox(
            label="Text", lines=4, max_length=limits.max_chars, placeholder="Type what to say (English or 中文)"
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
                inputs=[text, mode, prompt_audio, prompt_text, instruct_text, speaker, speed, seed, stream],
                outputs=audio,
                api_name="generate",
            )
        else:  # API callers of a non-cloning engine pass only what it uses: generate(text, speed, seed, stream)

            def speak(text, speed, seed, stream):
                yield from generate(text, modes[0], None, "", "", None, speed, seed, stream)

            button.click(speak, inputs=[text, speed, seed, stream], outputs=audio, api_name="generate")

        def refresh():
            """At each page load: what the loaded model offers (built-in speakers are only
            known once it is loaded)."""
            now = pipeline.modes
            return (
                gr.update(choices=[(MODE_LABELS[m], m) for m in now], value=now[0], visible=len(now) > 1),
                gr.update(choices=engine.speakers(), visible=bool(engine.speakers())),
            )

        ui.load(refresh, outputs=[mode, speaker], api_name=False)

    return gr.mount_gradio_app(app, ui, path="/")
