"""The UI's "Long form" tab on a real cluster: supervisord, nginx, two instances of the
simulated engine, the jobs process; a UI login (``--ui-auth``). Driven with gradio_client, as
a browser's session: the UI user's cookie travels with each call, the instance calls the jobs
API through nginx with it, and the job is that user's (listed with the cookie, not with the
API token; the panel shows its owner's kind). A job is followed to its audio, another cancelled."""

from __future__ import annotations

import json
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import bcrypt
import pytest
import requests
import soundfile
from conftest import cli, free_port_block

pytestmark = pytest.mark.integration

SENTENCE = "Sentence {i} of the chapter is read aloud, and the next one follows it. "
TEXT = "".join(SENTENCE.format(i=i) for i in range(24))  # ~1,700 characters: about ten segments
SECONDS_PER_CHAR = 0.04  # the simulated engine's audio per character
POLL_SECONDS = 120


def session() -> requests.Session:
    s = requests.Session()
    s.trust_env = False
    return s


@pytest.fixture(scope="module")
def cluster():
    root = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    state_dir = root / "s"
    users = root / "users"
    users.write_text("ann:" + bcrypt.hashpw(b"ann's password", bcrypt.gensalt(4)).decode() + "\n")
    users.chmod(0o600)
    port, base = free_port_block(1), free_port_block(2)
    args = ["--engine", "simulated", "--simulated-ms-per-char", "1", "--simulated-base-ms", "50"]
    args += ["--instances", "2", "--port", str(port), "--base-port", str(base), "--state-dir", str(state_dir)]
    args += ["--ui-auth", str(users), "--segment-chars", "200", "--job-slots", "2"]
    done = cli("up", *args, timeout=300)
    url = f"http://127.0.0.1:{port}"
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        with session() as browser:
            login = browser.post(url + "/login", data={"user": "ann", "password": "ann's password", "next": "/"},
                                 allow_redirects=False)  # fmt: skip
            assert login.status_code == 303, login.text
            cookie = browser.cookies["cvlb_session"]
        yield {"url": url, "state_dir": state_dir, "cookie": cookie}
    finally:
        cli("down", "--state-dir", str(state_dir), timeout=120)
        shutil.rmtree(root, ignore_errors=True)


def ui(cluster):
    from gradio_client import Client

    # (a browser's cookies: the login's, and nginx's sticky route, which a Cookie header given
    # here would otherwise keep gradio_client from sending)
    cookies = f"cvlb_session={cluster['cookie']}; cvlb_route={secrets.token_hex(8)}"
    return Client(cluster["url"] + "/", verbose=False, headers={"Cookie": cookies})


def token(cluster, name: str) -> str:
    return (cluster["state_dir"] / name).read_text().splitlines()[-1]


def until_finished(client, job_id: str) -> dict:
    deadline = time.monotonic() + POLL_SECONDS
    while time.monotonic() < deadline:
        job = json.loads(client.predict(job_id, api_name="/long_form_status"))
        if job["status"] not in ("queued", "running"):
            return job
        time.sleep(1)
    raise AssertionError(f"{job_id} did not finish in {POLL_SECONDS} s: {job}")


def test_a_ui_users_job_is_made_watched_and_its_audio_fetched(cluster):
    client = ui(cluster)
    job = json.loads(client.predict(TEXT, None, "", "wav", 1.0, api_name="/long_form_submit"))
    assert job["status"] == "queued" and job["progress"]["total"] >= 8
    done = until_finished(client, job["id"])
    assert done["status"] == "succeeded", done
    assert done["progress"]["done"] == done["progress"]["total"]
    path = client.predict(job["id"], api_name="/long_form_audio")
    audio, rate = soundfile.read(path, dtype="float32")
    assert rate == 24000 and audio.size / rate > 0.8 * SECONDS_PER_CHAR * len(TEXT)
    listed = json.loads(client.predict(api_name="/long_form_jobs"))
    assert job["id"] in [j["id"] for j in listed["data"]]


def test_the_job_belongs_to_the_ui_user(cluster):
    client = ui(cluster)
    job = json.loads(
        client.predict("A short job. Of two sentences.", None, "", "mp3", 1.0, api_name="/long_form_submit")
    )
    url = cluster["url"] + "/v1/audio/jobs"
    with session() as s:
        mine = s.get(url, cookies={"cvlb_session": cluster["cookie"]}, timeout=10)
        assert mine.status_code == 200 and job["id"] in [j["id"] for j in mine.json()["data"]]
        other = s.get(url, headers={"Authorization": f"Bearer {token(cluster, 'api-token')}"}, timeout=10)
        assert other.status_code == 200 and job["id"] not in [j["id"] for j in other.json()["data"]]
        panel = s.get(cluster["url"] + "/admin/api/jobs", timeout=10,
                      headers={"Authorization": f"Bearer {token(cluster, 'admin-token')}"})  # fmt: skip
        assert panel.status_code == 200, panel.text
        (seen,) = [j for j in panel.json()["data"] if j["id"] == job["id"]]
        assert seen["owner"] == "user" and "ann" not in json.dumps(panel.json())


def test_a_job_is_cancelled_from_the_tab_and_a_bad_one_is_refused_in_the_apis_words(cluster):
    client = ui(cluster)
    job = json.loads(client.predict(TEXT * 4, None, "", "flac", 1.0, api_name="/long_form_submit"))
    cancelled = json.loads(client.predict(job["id"], api_name="/long_form_cancel"))
    assert cancelled["status"] == "cancelled"
    assert until_finished(client, job["id"])["status"] == "cancelled"
    with pytest.raises(Exception, match="No saved voice"):  # noqa: B017 - gradio_client's AppError
        client.predict(TEXT, None, "nobody-by-that-name", "wav", 1.0, api_name="/long_form_submit")


def test_a_txt_upload_becomes_the_jobs_text(cluster, tmp_path):
    from gradio_client import handle_file

    chapter = tmp_path / "chapter.txt"
    chapter.write_bytes("\ufeff".encode() + TEXT.encode())  # UTF-8 with a byte-order mark, as editors save it
    client = ui(cluster)
    job = json.loads(client.predict("", handle_file(str(chapter)), "", "wav", 1.0, api_name="/long_form_submit"))
    assert job["progress"]["total"] >= 8, job
    assert until_finished(client, job["id"])["status"] == "succeeded"
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\x00\x01\x02 not text" * 10)
    with pytest.raises(Exception, match="415"):  # noqa: B017 - gradio_client's httpx error
        client.predict("", handle_file(str(binary)), "", "wav", 1.0, api_name="/long_form_submit")
    with session() as s:  # the words a browser shows
        refused = s.post(cluster["url"] + "/gradio_api/upload", files={"files": ("binary.txt", binary.read_bytes())},
                         cookies={"cvlb_session": cluster["cookie"]}, timeout=30)  # fmt: skip
    assert refused.status_code == 415 and "UTF-8 .txt" in refused.json()["error"]["message"], refused.text


def test_the_tab_keeps_no_connection_open_on_a_quiet_page(cluster):
    """The tab holds its job in hidden fields, not in a gr.State: any State makes Gradio keep a
    heartbeat connection open per page, and a page that never goes quiet fails browsers' and
    monitors' "network idle" (and costs each visitor a connection through nginx)."""
    with session() as browser:
        browser.cookies.set("cvlb_session", cluster["cookie"])
        config = browser.get(cluster["url"] + "/config", timeout=30)
    assert config.status_code == 200, config.text
    assert "Long form" in config.text
    assert config.json()["connect_heartbeat"] is False
