"""The UI's "Long form" tab: its pure parts (a .txt read, a job's body, progress, the list's
labels), its client against the real jobs API (SqliteStore, the gate's two owners, served by
uvicorn on loopback), and the tab built into the real UI in process."""

from __future__ import annotations

import json
import time

import pytest
from conftest import free_port_block, uvicorn_serving
from starlette.testclient import TestClient

from cosyvoice_lb.instance.access.auth import Policy, PolicyFile, digest
from cosyvoice_lb.instance.ui.long_form import (
    MAX_TXT_BYTES,
    JobsClient,
    JobsError,
    job_body,
    job_choices,
    long_form_tab,
    progress_html,
    progress_text,
    read_txt,
    voice_choices,
)
from cosyvoice_lb.jobs import model
from cosyvoice_lb.jobs.service import Config, build_app
from cosyvoice_lb.jobs.store import SqliteStore

ANN, BOB = "ann-token-0123456789abcdef", "bob-token-0123456789abcdef"
TEXT = " ".join(f"Sentence number {i} of a long text, told slowly." for i in range(30))


def test_a_txt_is_read_as_utf8_and_its_byte_order_mark_dropped(tmp_path):
    path = tmp_path / "chapter.txt"
    path.write_bytes("\ufeff第一章。A long text.".encode())
    assert read_txt(path) == "第一章。A long text."
    assert read_txt(None) == "" and read_txt("") == ""


def test_a_txt_that_is_not_utf8_says_where_and_what_to_do(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("Déjà vu".encode("latin-1"))
    with pytest.raises(ValueError, match=r"not UTF-8 text \(byte 1 is not\): save it as UTF-8"):
        read_txt(path)


def test_a_txt_past_the_bound_is_refused_before_it_is_read_whole(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(b"a" * 101)
    with pytest.raises(ValueError, match="larger than 0 KiB: split it"):
        read_txt(path, max_bytes=100)
    assert read_txt(path, max_bytes=101) == "a" * 101
    assert MAX_TXT_BYTES >= 4 * model.MAX_TEXT_CHARS  # (a whole job's text fits, in any script)


def test_the_body_leaves_empty_fields_to_the_apis_defaults():
    assert job_body("Hello.", None, "", 1) == {"input": "Hello.", "response_format": "mp3", "speed": 1.0}
    body = job_body("Hello.", "narrator", "flac", 1.5, "  Slowly. ")
    assert body == {"input": "Hello.", "response_format": "flac", "speed": 1.5, "voice": "narrator",
                    "instructions": "Slowly."}  # fmt: skip


def test_progress_says_status_segments_and_the_error_escaped():
    running = {"id": "job_a", "status": "running", "progress": {"done": 3, "total": 12}}
    assert progress_text(running) == "job_a: running, 3 of 12 segments (25%)"
    assert '<progress value="25" max="100"' in progress_html(running)
    failed = {**running, "status": "failed", "error": {"message": "segment 4 <b>refused</b>"}}
    assert progress_text(failed).endswith(": segment 4 <b>refused</b>")
    assert "&lt;b&gt;refused&lt;/b&gt;" in progress_html(failed) and "<b>" not in progress_html(failed)
    done = {"id": "job_a", "status": "succeeded", "progress": {"done": 12, "total": 12}}
    assert "(100%)" in progress_text(done) and progress_html(None) == ""
    assert "(0%)" in progress_text({"id": "job_b", "status": "queued", "progress": {"done": 0, "total": 0}})


def test_the_list_keeps_the_apis_order_and_names_each_job():
    page = {"data": [
        {"id": "job_new", "status": "running", "created_at": 1764680000, "progress": {"done": 1, "total": 4},
         "response_format": "mp3"},
        {"id": "job_old", "status": "succeeded", "created_at": 1764670000, "progress": {"done": 4, "total": 4},
         "response_format": "wav"},
    ]}  # fmt: skip
    choices = job_choices(page)
    assert [value for _, value in choices] == ["job_new", "job_old"]
    assert " · running · 1/4 · mp3 · job_new" in choices[0][0]
    assert job_choices({"data": []}) == []


def test_voices_are_the_saved_ones_then_the_built_in_speakers():
    assert voice_choices([("Narrator", "v1")], ["spk"]) == [("Narrator", "v1"), ("spk (built-in)", "spk")]


@pytest.fixture(scope="module")
def jobs_api(tmp_path_factory):
    """The real jobs API over a SqliteStore, behind the gate of two tokens, on loopback."""
    root = tmp_path_factory.mktemp("jobs")
    policy = root / "access.json"
    policy.write_text(Policy(frozenset({digest(ANN), digest(BOB)}), {}, b"s" * 32).to_json())
    store = SqliteStore(root / "jobs" / "jobs.sqlite3")
    app = build_app(store, Config(state_dir=root, max_chars=5000, segment_chars=200), PolicyFile(str(policy)))
    with uvicorn_serving(app) as url:
        yield url, store, root
    store.close()


def as_(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}", "x-request-id": "r1", "host": "dropped"}


def test_the_client_makes_lists_and_cancels_a_job_as_its_caller(jobs_api):
    url, _, _ = jobs_api
    ann = JobsClient(url, as_(ANN))
    assert ann.headers == {"authorization": f"Bearer {ANN}", "x-request-id": "r1"}  # (credentials only)
    job = ann.create(job_body(TEXT, None, "wav", 1.0))
    assert job["status"] == "queued" and job["progress"]["total"] > 1
    assert job["id"] in [value for _, value in job_choices(ann.list())]
    assert job["id"] not in [value for _, value in job_choices(JobsClient(url, as_(BOB)).list())]
    with pytest.raises(JobsError, match="no job") as missing:
        JobsClient(url, as_(BOB)).get(job["id"])
    assert missing.value.status == 404
    assert ann.cancel(job["id"])["status"] == "cancelled"


def test_the_apis_refusals_come_back_in_its_own_words(jobs_api):
    url, _, _ = jobs_api
    with pytest.raises(JobsError, match="Authorization") as refused:
        JobsClient(url, {}).create(job_body(TEXT, None, "mp3", 1.0))
    assert refused.value.status == 401
    with pytest.raises(JobsError, match="--max-job-chars 5000") as long:
        JobsClient(url, as_(ANN)).create(job_body("word " * 1001, None, "mp3", 1.0))
    assert long.value.status == 413
    with pytest.raises(JobsError, match="did not answer"):
        JobsClient(f"http://127.0.0.1:{free_port_block(1)}", as_(ANN), timeout=2).list()


def test_a_succeeded_jobs_audio_downloads_to_a_file_of_its_own(jobs_api, tmp_path):
    url, store, root = jobs_api
    ann = JobsClient(url, as_(ANN))
    job = ann.create(job_body("One sentence. And another.", None, "wav", 1.0))
    with pytest.raises(JobsError, match="is queued") as early:
        ann.download(job["id"], str(tmp_path), "wav")
    assert early.value.status == 409
    claimed = store.claim_next("w", 60, time.time())
    assert claimed is not None and claimed.id == job["id"]
    for i in range(claimed.segments_total):
        store.segment_done(claimed.id, i, time.time())
    audio = root / "jobs" / "results" / claimed.id / "audio.wav"
    audio.parent.mkdir(parents=True)
    audio.write_bytes(b"RIFF" + b"\0" * 2000)
    store.finish(claimed.id, "w", model.SUCCEEDED, time.time(), result=model.Result(str(audio), 2004))
    first, second = ann.download(job["id"], str(tmp_path), "wav"), ann.download(job["id"], str(tmp_path), "wav")
    assert first != second and first.endswith(f"/{job['id']}.wav")
    assert open(first, "rb").read() == audio.read_bytes()
    assert json.loads(json.dumps(ann.get(job["id"])))["bytes"] == 2004


@pytest.fixture(scope="module")
def ui_config(jobs_api):
    """The instance's real app with its UI, in process; segments (and jobs) go to ``jobs_api``."""
    from cosyvoice_lb.instance.engines.simulated import SimulatedEngine
    from cosyvoice_lb.instance.server import build_app as instance_app
    from cosyvoice_lb.instance.speech.admission import Admission
    from cosyvoice_lb.instance.speech.fanout import Balancer, FanOut
    from cosyvoice_lb.instance.speech.pipeline import Pipeline

    admission = Admission(1, 2)
    admission.become_ready()
    pipeline = Pipeline(SimulatedEngine(simulated_ms_per_char=0.1), admission, port=7860)
    fanout = FanOut(Balancer(jobs_api[0], 2, 200), admission.clock)
    with TestClient(instance_app(pipeline, "simulated", 7860, fanout=fanout)) as client:
        yield client.get("/config").json(), client.get("/gradio_api/info").json()


def labels(config: dict) -> list[str]:
    return [str(c.get("props", {}).get("label", "")) for c in config["components"]]


def test_the_ui_has_the_long_form_tab_and_its_api(ui_config):
    config, info = ui_config
    assert "Long form" in labels(config) and "Speech" in labels(config)
    assert any(label.startswith("Your jobs") for label in labels(config))
    named = set(info["named_endpoints"])
    assert {"/long_form_submit", "/long_form_status", "/long_form_jobs", "/long_form_audio",
            "/long_form_cancel", "/generate"} <= named  # fmt: skip


def test_without_a_balancer_the_tab_says_jobs_need_one(ui_config, tmp_path):
    import gradio as gr

    with gr.Blocks() as ui:
        long_form_tab(gr, ui, "", [], str(tmp_path))
    config = ui.get_config_file()
    notes = [str(c["props"].get("value", "")) for c in config["components"] if c.get("type") == "markdown"]
    assert any("need the cluster's balancer" in note for note in notes)
    assert "Long form" in labels(config) and not any(label.startswith("Your jobs") for label in labels(config))
