"""The Gradio UI at "/": an entry point onto the instance's pipeline.

The same modes, checks and errors as the API (``pipeline.describe`` words them), audio
streamed as it is made when ffmpeg is there to encode it. Gradio's own queue bounds what
waits here, so the UI's syntheses wait their turn instead of being refused.
"""

from __future__ import annotations

import inspect
import queue
import shutil
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_lb.common.error_body import error_body, error_headers
from cosyvoice_lb.instance.api.streams import audio_source
from cosyvoice_lb.instance.engines import clones
from cosyvoice_lb.instance.metrics import outcome_of
from cosyvoice_lb.instance.speech.failures import describe
from cosyvoice_lb.instance.speech.fanout import FanOut, blocking
from cosyvoice_lb.instance.speech.pipeline import Pipeline
from cosyvoice_lb.instance.speech.validation import MAX_SPEED, MIN_SPEED, BadRequest, prompt_span
from cosyvoice_lb.instance.ui.long_form import MAX_TXT_BYTES, long_form_tab, voice_choices
from cosyvoice_lb.instance.ui.owners import KEPT_SECONDS
from cosyvoice_lb.instance.ui.uploads import GradioFiles

MODE_LABELS = {
    "zero_shot": "Zero-shot clone (prompt audio + its transcript)",
    "cross_lingual": "Cross-lingual clone (prompt audio)",
    "instruct": "Instruct (style in words)",
    "sft": "Built-in speaker",
}

# The live player's largest piece: Gradio encodes each before asking for the next.
# The Voice agent tab: a page of its own (a frame in the tab: Gradio runs no script of a tab's
# HTML) that writes text into a streaming session and plays the audio as it comes.
DEMO_PATH = "/stream-demo"
DEMO_PAGE = Path(__file__).resolve().parent.parent / "assets" / "stream_demo.html"
LIVE_SLICE_SECONDS = 2
# An event the page calls but API clients do not see (gradio 6 reads it as api_visibility="private").
PRIVATE: dict[str, Any] = {"api_name": False}


def joined(pieces: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)


def int16(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio, -1, 1) * 32767).astype(np.int16)


def ahead(
    pieces: Iterator[np.ndarray], stop: threading.Event, most: int
) -> Iterator[tuple[np.ndarray | None, list[np.ndarray] | None]]:
    """``pieces`` read ahead by a thread, handed on in slices of at most ``most`` samples:
    (slice, None) as they come, and (None, all pieces) once, as soon as the last is read.
    The live player encodes as it goes; neither synthesis nor the whole file waits on it
    (small slices give control back often). Setting ``stop``, or leaving early, ends the
    reading at the next piece."""
    waiting: queue.Queue[Any] = queue.Queue()
    end = object()

    def read() -> None:
        try:
            for piece in pieces:
                waiting.put(piece)
                if stop.is_set():
                    break
            waiting.put(end)
        except BaseException as exc:  # raised where the pieces are taken
            waiting.put(exc)
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()  # (a long text's segments are cancelled, its connections closed)

    reader = threading.Thread(target=read, name="ui-pieces", daemon=True)
    reader.start()
    pending: deque[np.ndarray] = deque()
    everything: list[np.ndarray] = []
    finished = False
    try:
        while True:
            while not finished:  # take what has come; wait only when there is nothing to hand on
                try:
                    item = waiting.get(block=not pending)
                except queue.Empty:
                    break
                if isinstance(item, BaseException):
                    raise item
                if item is end:
                    finished = True
                    yield None, everything
                else:
                    pending.append(item)
                    everything.append(item)
            if not pending:
                return
            piece = pending.popleft()
            if piece.size > most:
                pending.appendleft(piece[most:])
                piece = piece[:most]
            yield piece, None
    finally:
        stop.set()
        reader.join(timeout=60)  # (at most one piece: the engine stops at its next chunk)


def no_download(gr: Any) -> dict[str, Any]:
    """gr.Audio's arguments for a player without a download button (gradio 6: ``buttons``,
    gradio 5: ``show_download_button``)."""
    params = inspect.signature(gr.Audio.__init__).parameters
    return {"buttons": []} if "buttons" in params else {"show_download_button": False}


def saved_voices(pipeline: Pipeline) -> list[tuple[str, str]]:
    """(label, id) of every saved voice, for the dropdown ([] where voices do not apply)."""
    if pipeline.registry is None or not clones(pipeline.engine):
        return []
    return [(voice.name, voice.id) for voice in pipeline.registry.all()]


def mount_ui(app: Any, pipeline: Pipeline, port: int, fanout: FanOut | None = None) -> Any:
    """Mount the UI on ``app`` (FastAPI) at "/" and return what Gradio returns. A text past
    --max-chars goes to the cluster in segments (``fanout``), as from the API."""
    import gradio as gr
    from fastapi.responses import HTMLResponse, JSONResponse
    from gradio.processing_utils import save_bytes_to_cache
    from gradio.utils import get_upload_folder

    engine, limits = pipeline.engine, pipeline.limits
    modes = pipeline.modes
    cloning = any(m in modes for m in ("zero_shot", "cross_lingual", "instruct"))
    has_voices = cloning and pipeline.registry is not None
    # Gradio encodes a streamed audio output with ffmpeg; without it the UI plays whole results.
    can_stream = shutil.which("ffmpeg") is not None
    unchanged = getattr(gr, "skip", gr.update)  # (an output left as it is; gr.update() before gr.skip)

    def read_upload(path: str | None) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as handle:
            data = handle.read(limits.max_upload_bytes + 1)
        if len(data) > limits.max_upload_bytes:
            raise BadRequest(f"the prompt audio is larger than {limits.max_upload_bytes // 2**20} MiB")
        return data

    def results(
        text, mode, prompt_audio, prompt_text, instruct_text, speaker, speed, seed, stream, voice=None, request=None
    ) -> Iterator[tuple[np.ndarray | None, str | None]]:
        """(chunk, None) for what was made since the last (Stream on), and once (None, WAV path):
        the whole result, encoded once, for the player that downloads it."""
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
            streamed = job.request.stream
            stop = threading.Event()
            if limits.long(job.request.text):  # segments across the cluster
                headers = dict(request.headers) if request is not None else {}
                long_job, job = job, None
                pieces: Any = blocking(lambda: audio_source(pipeline, fanout, long_job, payload, upload, headers, None))
            else:
                pieces = pipeline.chunks(job, cancelled=stop) if streamed else iter([pipeline.synthesize(job)])
            if not streamed:
                audio = joined(list(pieces))
                data = pipeline.encode_wav(audio)  # refuses silence the same way as the API
                pipeline.keep(audio)
                yield None, save_bytes_to_cache(data, "speech.wav", cache_dir=get_upload_folder())
            else:
                for chunk, everything in ahead(pieces, stop, most=LIVE_SLICE_SECONDS * engine.sample_rate):
                    if everything is not None:  # synthesis is over: the whole file now, the live player catching up
                        whole = pipeline.encode_wav(joined(everything))
                        yield None, save_bytes_to_cache(whole, "speech.wav", cache_dir=get_upload_folder())
                    else:
                        yield chunk, None
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

    def to_player(rows: Iterator[tuple[np.ndarray | None, str | None]]) -> Iterator[tuple[Any, Any]]:
        """The page's outputs: pieces to the live player, then the whole file to the result player
        (cleared at the first piece, then left as it is until the file comes)."""
        first = True
        for chunk, path in rows:
            yield (
                (None if chunk is None else (engine.sample_rate, int16(chunk))),
                path or (None if first else unchanged()),
            )
            first = False

    def to_file(rows: Iterator[tuple[np.ndarray | None, str | None]]) -> str:
        """gradio_client's output: the whole result as a WAV file, streamed or not."""
        path = ""
        for _, whole in rows:
            path = whole or path
        return path

    def clone(
        text, mode, prompt_audio, prompt_text, instruct_text, speaker, speed, seed, stream, voice=None, request=None
    ):
        args = (text, mode, prompt_audio, prompt_text, instruct_text, speaker, speed, seed, stream, voice)
        yield from to_player(results(*args, request=request))

    def clone_file(
        text, mode, prompt_audio, prompt_text, instruct_text, speaker, speed, seed, stream, voice=None, request=None
    ):
        args = (text, mode, prompt_audio, prompt_text, instruct_text, speaker, speed, seed, stream, voice)
        return to_file(results(*args, request=request))

    # API callers of a non-cloning engine pass only what it uses: generate(text, speed, seed, stream)
    def speak(text, speed, seed, stream, request):
        yield from to_player(results(text, modes[0], None, "", "", None, speed, seed, stream, None, request))

    def speak_file(text, speed, seed, stream, request):
        return to_file(results(text, modes[0], None, "", "", None, speed, seed, stream, None, request))

    generate, generate_file = (clone, clone_file) if cloning else (speak, speak_file)
    # Gradio passes the request to a parameter annotated gr.Request; this module's annotations
    # are strings, and "gr" is not a global here, so the class itself goes in.
    for fn in (generate, generate_file):
        fn.__annotations__["request"] = gr.Request

    with gr.Blocks(title="cosyvoice-lb", delete_cache=(KEPT_SECONDS, KEPT_SECONDS)) as ui:
        gr.Markdown(f"## Text to speech\nEngine `{engine.name}` · instance on port {port}")
        with gr.Tab("Speech"):
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
                    label=f"Prompt audio ({prompt_span(limits.max_prompt_seconds)}, 16 kHz or more)",
                    type="filepath",
                    sources=["upload", "microphone"],
                )
                with gr.Column():
                    prompt_text = gr.Textbox(label="Prompt transcript (zero-shot: exactly what the prompt says)")
                    instruct_text = gr.Textbox(label="Instruction (instruct mode, e.g. 'Speak slowly and warmly')")
            speaker = gr.Dropdown(
                engine.speakers(), value=None, label="Built-in speaker", visible=bool(engine.speakers())
            )
            with gr.Row():
                speed = gr.Slider(MIN_SPEED, MAX_SPEED, value=1.0, step=0.1, label="Speed (not with streaming)")
                seed = gr.Number(value=-1, precision=0, label="Seed (-1: random)")
                stream = gr.Checkbox(value=False, label="Stream", visible=can_stream)
            button = gr.Button("Generate", variant="primary")
            # Streamed pieces play here as they come (Gradio sends them as HLS when ffmpeg is there);
            # its own download would re-encode the stream, so the whole result gets a player of its own.
            live = gr.Audio(label="Speech, as it is made", interactive=False, streaming=True, visible=False,
                            **no_download(gr))  # fmt: skip
            audio = gr.Audio(label="Speech", type="filepath", interactive=False, autoplay=False)
            inputs = [text, mode, prompt_audio, prompt_text, instruct_text, speaker, speed, seed, stream, voice]
            if not cloning:
                inputs = [text, speed, seed, stream]
            if can_stream:
                stream.change(lambda on: gr.update(visible=on), inputs=stream, outputs=live, **PRIVATE)
            button.click(generate, inputs=inputs, outputs=[live, audio], **PRIVATE)
            # gradio_client's "/generate": one output, the whole WAV (a hidden button's event).
            gr.Button(visible=False).click(generate_file, inputs=inputs, outputs=audio, api_name="generate")
        long_form_tab(gr, ui, fanout.balancer.url if fanout else "", voice_choices(saved_voices(pipeline),
                      engine.speakers()), get_upload_folder())  # fmt: skip

        with gr.Tab("Voice agent (streaming)"):
            gr.HTML(
                f'<iframe src="{DEMO_PATH}" title="streaming session" style="width:100%;height:34rem;border:0"></iframe>'
            )

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

    @app.get(DEMO_PATH, include_in_schema=False)
    async def stream_demo():  # the Voice agent tab's page (static: it holds no secret)
        return HTMLResponse(DEMO_PAGE.read_text(encoding="utf-8"), headers={"Cache-Control": "no-store"})

    @app.get("/gradio_api/stream/{session}/{run}/{component}/playlist-file", include_in_schema=False)
    async def no_stream_download(session: str, run: str, component: str):
        # Gradio would re-encode the streamed segments here, and answers 200 audio with an
        # error body when that fails: the whole result has a player and a download of its own.
        body = error_body(
            404, "no download of a stream: use the download button of the Speech player (the whole result)"
        )
        return JSONResponse(body, status_code=404, headers=error_headers(404))

    app = gr.mount_gradio_app(app, ui, path="/")
    texts = MAX_TXT_BYTES if fanout else 0  # (the long-form tab's .txt, where the tab has a balancer)
    # Gradio deletes the files it made when the instance stops, but those a component keeps:
    # an upload is left to its records' hour (a restart keeps it for its sender).
    keep = next(iter(ui.blocks.values())).keep_in_cache
    app.add_middleware(
        GradioFiles,
        folder=get_upload_folder(),
        max_bytes=limits.max_upload_bytes,
        uploads=cloning,
        texts=texts,
        keep=keep,
    )
    return app
