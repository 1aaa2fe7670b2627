"""The UI's "Long form" tab: a long text (pasted, or a .txt) becomes a background job of the
cluster's jobs API (``/v1/audio/jobs``, through the balancer), watched here until its audio
plays and downloads.

The instance calls the API as the UI's user: the page's request's credentials (the session
cookie, or a bearer token) travel with each call, as a long text's segments carry them
(``fanout.forwarded``), so the job's owner is that user and the tab lists that user's jobs
only. Leaving the page loses nothing: the job runs on, and the list finds it again.

The pure parts (a body, a progress line, a .txt read, a list's labels) are functions; the
HTTP client is :class:`JobsClient`; :func:`long_form_tab` lays out the tab inside the UI's
Blocks. Instance side: the standard library and httpx (which gradio brings).
"""

from __future__ import annotations

import html
import json
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cosyvoice_lb.instance.audio.formats import FORMATS
from cosyvoice_lb.instance.speech.fanout import forwarded

JOBS = "/v1/audio/jobs"
POLL_SECONDS = 2.0
# A .txt larger than this is refused before it is read whole (the API's own limit,
# --max-job-chars, 200,000 characters by default, is checked there: at most 4 bytes each)
MAX_TXT_BYTES = 1024 * 1024
# The formats a browser plays: the others (pcm) download only
PLAYABLE = frozenset({"mp3", "wav", "flac", "opus", "aac"})
ACTIVE = frozenset({"queued", "running"})
TIMEOUT = 30.0


class JobsError(Exception):
    """The jobs API refused, or could not be reached; the message says why (the API's own)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


def read_txt(path: str | os.PathLike[str] | None, max_bytes: int = MAX_TXT_BYTES) -> str:
    """The text of an uploaded .txt: UTF-8 (a byte-order mark dropped), at most ``max_bytes``;
    ValueError with what to do otherwise."""
    if not path:
        return ""
    with open(path, "rb") as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"the .txt is larger than {max_bytes // 1024} KiB: split it into several jobs")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"the .txt is not UTF-8 text (byte {exc.start} is not): save it as UTF-8 and upload it again"
        ) from None


def job_body(text: str, voice: str | None, response_format: str, speed: float, instructions: str = "") -> dict:
    """``POST /v1/audio/jobs``'s body for the tab's fields (empty ones left out: the API's
    defaults then hold)."""
    body: dict[str, Any] = {"input": text, "response_format": response_format or "mp3", "speed": float(speed)}
    if voice:
        body["voice"] = voice
    if instructions and instructions.strip():
        body["instructions"] = instructions.strip()
    return body


def fraction(job: Mapping[str, Any]) -> float:
    progress = job.get("progress") or {}
    total, done = int(progress.get("total") or 0), int(progress.get("done") or 0)
    if job.get("status") == "succeeded":
        return 1.0
    return min(1.0, done / total) if total > 0 else 0.0


def progress_text(job: Mapping[str, Any]) -> str:
    """One line on a job: its status, segments done of all, and the error when it failed."""
    progress = job.get("progress") or {}
    done, total = int(progress.get("done") or 0), int(progress.get("total") or 0)
    status = str(job.get("status") or "unknown")
    line = f"{job.get('id', '?')}: {status}, {done} of {total} segments ({round(100 * fraction(job))}%)"
    error = (job.get("error") or {}).get("message") if isinstance(job.get("error"), dict) else None
    return f"{line}: {error}" if error else line


def progress_html(job: Mapping[str, Any] | None) -> str:
    """The progress bar and its line, as HTML (escaped: the error quotes the text)."""
    if not job:
        return ""
    share = round(100 * fraction(job))
    return (
        f'<progress value="{share}" max="100" style="width:100%"></progress>'
        f"<div>{html.escape(progress_text(job))}</div>"
    )


def job_label(job: Mapping[str, Any]) -> str:
    """A job in the list: when it was made, its status and progress, its format."""
    created = job.get("created_at")
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(created)) if isinstance(created, (int, float)) else "?"
    progress = job.get("progress") or {}
    return (
        f"{when} · {job.get('status')} · {progress.get('done', 0)}/{progress.get('total', 0)} · "
        f"{job.get('response_format') or ''} · {job.get('id')}"
    )


def job_choices(page: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(label, id) of a list's jobs, newest first as the API gives them."""
    return [(job_label(job), str(job["id"])) for job in page.get("data") or [] if job.get("id")]


def message_of(status: int, body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"the jobs API answered HTTP {status}"


def voice_choices(saved: list[tuple[str, str]], speakers: list[str]) -> list[tuple[str, str]]:
    """The voices the other tabs offer: saved voices (by id) and the built-in speakers."""
    return list(saved) + [(f"{name} (built-in)", name) for name in speakers]


class JobsClient:
    """The jobs API through the balancer, as the caller whose ``headers`` these are."""

    def __init__(self, url: str, headers: Mapping[str, str], timeout: float = TIMEOUT, transport: Any = None):
        self.url = url.rstrip("/")
        self.headers = forwarded(headers)
        self.timeout, self.transport = timeout, transport

    def _client(self) -> Any:
        import httpx

        # trust_env off: a proxy from the environment must not carry loopback traffic
        return httpx.Client(trust_env=False, timeout=self.timeout, transport=self.transport)

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        import httpx

        try:
            with self._client() as client:
                answer = client.request(method, self.url + path, json=body, headers=self.headers)
        except httpx.HTTPError as exc:
            raise JobsError(f"the jobs API did not answer ({type(exc).__name__}): retry shortly") from None
        if answer.status_code >= 400:
            raise JobsError(message_of(answer.status_code, answer.content), answer.status_code)
        return answer.json()

    def create(self, body: dict) -> dict:
        return self._call("POST", JOBS, body)

    def get(self, job_id: str) -> dict:
        return self._call("GET", f"{JOBS}/{job_id}")

    def list(self, limit: int = 20) -> dict:
        return self._call("GET", f"{JOBS}?limit={limit}")

    def cancel(self, job_id: str) -> dict:
        return self._call("DELETE", f"{JOBS}/{job_id}")

    def download(self, job_id: str, folder: str, extension: str) -> str:
        """The job's audio, streamed to a new file under ``folder`` (a directory of its own, a
        random name: the file is served to this page only); its path."""
        import httpx

        target = Path(folder) / secrets.token_hex(16) / f"{job_id}.{extension}"
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self._client() as client, client.stream("GET", f"{self.url}{JOBS}/{job_id}/content",
                                                         headers=self.headers) as answer:  # fmt: skip
                if answer.status_code >= 400:
                    raise JobsError(message_of(answer.status_code, answer.read()), answer.status_code)
                with open(target, "wb") as handle:
                    for piece in answer.iter_bytes(1 << 20):
                        handle.write(piece)
        except httpx.HTTPError as exc:
            target.unlink(missing_ok=True)
            raise JobsError(f"the job's audio did not come ({type(exc).__name__}): retry") from None
        return str(target)


def extension_of(job: Mapping[str, Any]) -> str:
    fmt = str(job.get("response_format") or "mp3")
    return fmt if fmt in FORMATS else "bin"


def long_form_tab(gr: Any, ui: Any, balancer_url: str, voices: list[tuple[str, str]], folder: str) -> None:
    """The tab, laid out in the Blocks ``ui`` being built (``gr`` is gradio). ``balancer_url``: where
    the jobs API is ("" when this instance has no balancer: the tab says so); ``voices``:
    (label, value) choices; ``folder``: where results are downloaded for the page."""
    with gr.Tab("Long form"):
        if not balancer_url:
            gr.Markdown(
                "Long-form jobs need the cluster's balancer: this instance has none "
                "(started by hand without --balancer, or with --max-long-chars 0)."
            )
            return
        _layout(gr, ui, balancer_url, voices, folder)


def _layout(gr: Any, ui: Any, url: str, voices: list[tuple[str, str]], folder: str) -> None:
    private: dict[str, Any] = {"api_name": False}

    def client(request: Any) -> JobsClient:
        return JobsClient(url, request.headers if request is not None else {})

    def failed(exc: Exception) -> Exception:
        return gr.Error(str(exc)[:1].upper() + str(exc)[1:])

    def start(text: str, txt: str | None, voice: str | None, fmt: str, speed: float, request: Any) -> dict:
        try:
            typed = (text or "").strip() and text
            body = job_body(typed or read_txt(txt), voice, fmt, speed)
            if not body["input"].strip():
                raise ValueError("paste a text or upload a .txt first")
            return client(request).create(body)
        except (ValueError, JobsError) as exc:
            raise failed(exc) from None

    def fetch_job(job_id: str, request: Any) -> dict:
        if not job_id:
            raise gr.Error("pick a job first")
        try:
            return client(request).get(job_id)
        except JobsError as exc:
            raise failed(exc) from None

    def audio_of(job: dict, request: Any) -> str:
        try:
            return client(request).download(str(job["id"]), folder, extension_of(job))
        except JobsError as exc:
            raise failed(exc) from None

    def listed(request: Any) -> list[tuple[str, str]]:
        try:
            return job_choices(client(request).list())
        except JobsError as exc:
            raise failed(exc) from None

    def shown(job: dict, request: Any, held: str) -> tuple[Any, ...]:
        """The page's outputs for ``job``: the bar, the players, the error, the timer, the job's id
        and the id of the job whose audio the players hold (``held``: fetched once, then kept)."""
        status = job.get("status")
        play: Any = None
        path: Any = None
        if status == "succeeded" and held == job["id"]:
            play = path = gr.update()  # (the players already hold it)
        elif status == "succeeded":
            path = audio_of(job, request)
            play = path if extension_of(job) in PLAYABLE else None
        error = progress_text(job) if status in ("failed", "cancelled", "expired") else ""
        held = job["id"] if status == "succeeded" else ""
        return (progress_html(job), play, path, error, gr.Timer(active=status in ACTIVE), job["id"], held)

    def submit(text, txt, voice, fmt, speed, request):
        job = start(text, txt, voice, fmt, speed, request)
        return (*shown(job, request, ""), gr.update(choices=listed(request), value=job["id"]))

    def watch(job_id, held, request):
        return shown(fetch_job(job_id, request), request, held)

    def cancel(job_id, held, request):
        if not job_id:
            raise gr.Error("pick a job first")
        try:
            job = client(request).cancel(job_id)
        except JobsError as exc:
            raise failed(exc) from None
        if job.get("object") != "audio.job":  # (a finished job is removed by a DELETE)
            return ("", None, None, f"{job_id}: removed", gr.Timer(active=False), "", "")
        return shown(job, request, held)

    def refresh(request):
        try:
            return gr.update(choices=job_choices(client(request).list()))
        except JobsError as exc:  # (at a page load too: a warning, not a failed page)
            gr.Warning(f"Your jobs could not be listed: {exc}")
            return gr.update()

    # API callers (gradio_client): the job as JSON, the list, the audio's path
    def api_submit(text, txt, voice, fmt, speed, request) -> str:
        return json.dumps(start(text, txt, voice, fmt, speed, request))

    def api_status(job_id, request) -> str:
        return json.dumps(fetch_job(job_id, request))

    def api_jobs(request) -> str:
        try:
            return json.dumps(client(request).list())
        except JobsError as exc:
            raise failed(exc) from None

    def api_audio(job_id, request) -> str:
        job = fetch_job(job_id, request)
        if job.get("status") != "succeeded":
            raise gr.Error(progress_text(job))
        return audio_of(job, request)

    def api_cancel(job_id, request) -> str:
        try:
            return json.dumps(client(request).cancel(job_id))
        except JobsError as exc:
            raise failed(exc) from None

    for fn in (submit, watch, cancel, refresh, api_submit, api_status, api_jobs, api_audio, api_cancel):
        fn.__annotations__["request"] = gr.Request

    gr.Markdown("A long text (a chapter, a book) becomes a background job: it is made across the cluster, "
                "and it goes on when you leave this page. Come back and pick it from the list.")  # fmt: skip
    with gr.Row():
        text = gr.Textbox(label="Text", lines=8, placeholder="Paste a long text, or upload a .txt")
        txt = gr.File(label=f"or a .txt (UTF-8, at most {MAX_TXT_BYTES // 1024} KiB)", file_types=[".txt"],
                      type="filepath")  # fmt: skip
    with gr.Row():
        voice = gr.Dropdown(voices, value=None, allow_custom_value=True,
                            label="Voice (a saved voice, a built-in speaker, or an OpenAI name; empty: the default)")  # fmt: skip
        fmt = gr.Dropdown(list(FORMATS), value="mp3", label="Format")
        speed = gr.Slider(0.5, 2.0, value=1.0, step=0.1, label="Speed")
    submit_button = gr.Button("Submit job", variant="primary")
    with gr.Row():
        jobs = gr.Dropdown([], value=None, label="Your jobs (newest first)", interactive=True)
        refresh_button = gr.Button("Refresh list")
        cancel_button = gr.Button("Cancel job", variant="stop")
    bar = gr.HTML()
    error = gr.Markdown()
    audio = gr.Audio(label="Result", type="filepath", interactive=False)
    download = gr.File(label="Download", interactive=False)
    # (hidden textboxes, not gr.State: a State makes Gradio hold a heartbeat connection open
    # for every page, so a page never goes quiet)
    job_id = gr.Textbox(visible=False)
    held = gr.Textbox(visible=False)  # the id of the job whose audio the players hold
    timer = gr.Timer(POLL_SECONDS, active=False)
    outputs = [bar, audio, download, error, timer, job_id, held]
    submit_button.click(submit, inputs=[text, txt, voice, fmt, speed], outputs=[*outputs, jobs], **private)
    timer.tick(watch, inputs=[job_id, held], outputs=outputs, **private)
    jobs.input(watch, inputs=[jobs, held], outputs=outputs, **private)
    cancel_button.click(cancel, inputs=[job_id, held], outputs=outputs, **private)
    refresh_button.click(refresh, outputs=jobs, **private)
    # gradio_client's events (a hidden button's): a job id goes in a (hidden) textbox, not a State
    result, asked = gr.Textbox(visible=False), gr.Textbox(visible=False)
    hidden = gr.Button(visible=False)
    hidden.click(api_submit, inputs=[text, txt, voice, fmt, speed], outputs=result, api_name="long_form_submit")
    hidden.click(api_status, inputs=asked, outputs=result, api_name="long_form_status")
    hidden.click(api_jobs, outputs=result, api_name="long_form_jobs")
    hidden.click(api_audio, inputs=asked, outputs=download, api_name="long_form_audio")
    hidden.click(api_cancel, inputs=asked, outputs=result, api_name="long_form_cancel")
    # at each page load: the user's jobs (made here before, or by the API with the same login)
    ui.load(refresh, outputs=jobs, **private)
