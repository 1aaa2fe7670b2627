"""A real browser (headless Chromium) uses the Gradio UI through nginx, as a person would."""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from conftest import cli, free_port_block

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if not CHROMIUM:
    if os.environ.get("CVLB_REQUIRE_BROWSER"):
        raise RuntimeError("chromium is required here (CVLB_REQUIRE_BROWSER): apt-get install chromium")
    pytest.skip("chromium is not installed (./run.sh test installs it)", allow_module_level=True)

playwright = pytest.importorskip("playwright.sync_api")


def open_ui(page, url: str) -> None:
    """Load the UI and wait until its text box is there. Not until the network is idle:
    Gradio's client may open a second event stream for a page's load events after the
    first one already brought their results (seen through nginx under CPU load, once in
    about 40 loads), and that stream stays open with heartbeats, so idle never comes. (90 s:
    the first page of a fresh cluster on a loaded 2-core CI box took over 30 s to appear.)"""
    page.goto(url, wait_until="load", timeout=90000)
    page.get_by_label("Text").wait_for(timeout=90000)


@pytest.fixture(scope="module")
def cluster():
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(2)
    done = cli(
        "up",
        "--instances",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    yield {"url": f"http://127.0.0.1:{port}/", "state_dir": state_dir}
    cli("down", "--state-dir", str(state_dir), timeout=120)
    shutil.rmtree(state_dir, ignore_errors=True)


def test_two_browsers_generate_speech_through_nginx(cluster):
    served_by = set()
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            for visitor in range(4):
                context = browser.new_context()
                page = context.new_page()
                open_ui(page, cluster["url"])
                page.get_by_label("Text").fill(f"Hello from visitor {visitor}. 你好。")
                page.get_by_role("button", name="Generate").click()
                # The audio player appears with the result (a download button comes with it).
                page.get_by_role("button", name="Download").wait_for(timeout=30000)
                assert page.get_by_text("Error").count() == 0
                cookies = {c["name"]: c["value"] for c in context.cookies()}
                assert "cvlb_route" in cookies  # the sticky route nginx handed out
                served_by.add(page.get_by_text("instance on port").inner_text())
                context.close()
        finally:
            browser.close()
    # Each visitor's page, queue join, event stream and file download went to one instance.
    upstreams: dict[str, set[str]] = {}
    for line in (cluster["state_dir"] / "logs" / "nginx-access.log").read_text().splitlines():
        if "/gradio_api/" in line and "route=" in line:
            route = line.split("route=")[1].split()[0]
            upstreams.setdefault(route, set()).add(line.split("upstream=")[1].split()[0])
    assert len(upstreams) >= 4
    assert all(len(servers) == 1 for servers in upstreams.values()), upstreams
    print(f"browser visitors served by: {sorted(served_by)}")


def test_the_voice_agent_tab_plays_speech_before_the_text_is_written(cluster):
    """The tab's page writes text into a streaming session piece by piece and plays each
    piece of audio as it comes: the first sentence is heard before the text is done."""
    text = "This first sentence is short. " + "The rest of the reply is written more slowly, piece by piece. " * 3
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--no-first-run", "--autoplay-policy=no-user-gesture-required"],
        )
        try:
            page = browser.new_page()
            open_ui(page, cluster["url"])
            page.get_by_role("tab", name="Voice agent (streaming)").click()
            demo = page.frame_locator("iframe[title='streaming session']")
            demo.locator("#text").fill(text)
            demo.locator("#pace").fill("40")
            demo.get_by_role("button", name="Speak as it is written").click()
            frame = next(f for f in page.frames if f.url.endswith("/stream-demo"))
            frame.wait_for_function("document.body.dataset.closed !== undefined", timeout=60000)
            seen = frame.evaluate("({...document.body.dataset})")
            log = frame.locator("#log").inner_text()
        finally:
            browser.close()
    assert seen["closed"] == "1000", log
    assert int(seen["done"]) >= 4 and int(seen["played"]) >= 4, log  # each sentence played as it came
    assert int(seen["firstAudio"]) < int(seen["textDone"]), log  # heard before the text was written
    assert int(seen["bytes"]) > 24000 * 2, log  # more than a second of speech
    print(f"voice agent tab: {log!r}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_download_button_gives_the_whole_result_as_a_wav(cluster, tmp_path, stream):
    """What the page plays, its download gives whole: a WAV that decodes, as long as the
    API's answer for the same text, streamed or not (with ffmpeg, Gradio streams as HLS)."""
    import requests
    import soundfile

    text = "The whole result, downloaded. It has two sentences."
    api = requests.post(cluster["url"] + "v1/tts", json={"text": text}, timeout=60)
    assert api.status_code == 200, api.text
    expected = soundfile.info(io.BytesIO(api.content)).frames
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_context(accept_downloads=True).new_page()
            open_ui(page, cluster["url"])
            page.get_by_label("Text").fill(text)
            if stream:
                page.get_by_label("Stream", exact=True).check()
            page.get_by_role("button", name="Generate").click()
            download = page.get_by_role("button", name="Download")
            download.wait_for(timeout=30000)
            assert download.count() == 1  # the live player has none: its stream is not a file
            assert page.get_by_text("Speech, as it is made").is_visible() == stream
            with page.expect_download() as got:
                download.click()
            saved = tmp_path / got.value.suggested_filename
            got.value.save_as(saved)
        finally:
            browser.close()
    audio, rate = soundfile.read(saved, dtype="float32")
    assert saved.suffix == ".wav" and rate == 22050
    assert abs(len(audio) - expected) <= rate // 10, (len(audio), expected)
    assert float(abs(audio).max()) > 0.01  # speech, not silence


@pytest.fixture(scope="module")
def closed_cluster():
    """A cluster that asks for credentials (an API token is generated: --ui-auth needs one)."""
    import bcrypt

    root = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    users = root / "users"
    users.write_text("ann:" + bcrypt.hashpw(b"ann's password", bcrypt.gensalt(4)).decode() + "\n")
    users.chmod(0o600)
    port, base = free_port_block(1), free_port_block(2)
    done = cli(
        "up",
        "--instances",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(root / "s"),
        "--ui-auth",
        str(users),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    token = (root / "s/api-token").read_text().splitlines()[-1]
    yield {"url": f"http://127.0.0.1:{port}/", "token": token}
    cli("down", "--state-dir", str(root / "s"), timeout=120)
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("user,password", [("ann", "ann's password"), ("", "token")])
def test_a_browser_logs_in_and_then_generates_speech(closed_cluster, user, password):
    password = closed_cluster["token"] if password == "token" else password
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.goto(closed_cluster["url"], wait_until="networkidle", timeout=90000)
            assert "/login" in page.url  # sent to the login, not to the UI
            page.get_by_label("User").fill(user)
            page.get_by_label("Password or API token").fill(password)
            page.get_by_role("button", name="Log in").click()
            page.get_by_label("Text").wait_for(timeout=90000)  # (the UI, once logged in: see open_ui)
            page.get_by_label("Text").fill("Hello after logging in.")
            page.get_by_role("button", name="Generate").click()
            page.get_by_role("button", name="Download").wait_for(timeout=30000)
            assert page.get_by_text("Error").count() == 0
        finally:
            browser.close()


def test_the_control_panel_lists_the_instances_and_restarts_one_drained(cluster):
    """The panel behind its login: the instances listed, a restart button restarts one
    drained (out of rotation first): requests sent meanwhile all get their audio."""
    import json
    import threading

    import requests

    state = cluster["state_dir"]
    token = (state / "admin-token").read_text().splitlines()[-1]

    def pid() -> int:
        done = cli("status", "--json", "--state-dir", str(state))
        return next(i["pid"] for i in json.loads(done.stdout)["instances"] if i["name"] == "instance-0")

    before, statuses, stop = pid(), [], threading.Event()

    def load() -> None:  # bounded: at most 300 requests or 150 s
        session, deadline = requests.Session(), time.monotonic() + 150
        session.trust_env = False
        while not stop.is_set() and len(statuses) < 300 and time.monotonic() < deadline:
            statuses.append(
                session.post(cluster["url"] + "v1/tts", json={"text": "During the restart."}, timeout=60).status_code
            )

    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        loader = threading.Thread(target=load)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 900})
            page.goto(cluster["url"] + "admin", wait_until="networkidle")
            assert page.url.endswith("/admin/login")  # never open without the token
            page.get_by_label("Admin token").fill(token)
            page.get_by_role("button", name="Log in").click()
            page.wait_for_url("**/admin")
            rows = page.locator("#instances tbody tr")
            rows.nth(1).wait_for(timeout=10000)
            assert rows.locator("td:first-child").all_inner_texts() == ["instance-0", "instance-1"]
            assert page.locator("#instances").get_by_text("RUNNING").count() == 2
            assert page.locator("#problems").inner_text() == "all instances serve"
            page.on("dialog", lambda dialog: dialog.accept())  # "Restart instance-0?"
            loader.start()
            page.locator('tr[data-name="instance-0"] button[data-action="restart"]').click()
            note = page.locator('tr[data-name="instance-0"] td.action')
            note.filter(has_text="restart: done").wait_for(timeout=120000)
            log = page.locator("#log")
            page.locator("#log-name").select_option("health")
            log.filter(has_text="restart requested").wait_for(timeout=10000)
            if os.environ.get("CVLB_SCREENSHOT"):  # the picture in docs/observability.md
                page.screenshot(path=os.environ["CVLB_SCREENSHOT"], full_page=True)
        finally:
            stop.set()
            if loader.is_alive() or loader.ident:
                loader.join(90)
            browser.close()
    assert pid() != before
    ordered = json.loads((state / "run" / "health.json").read_text())["instances"]["instance-0"]["ordered"]
    assert ordered == {"requested": 1}  # a drained restart, as `restart` does
    assert statuses and set(statuses) == {200}, statuses


def test_down_does_not_wait_for_an_open_browser_tab(cluster):
    # An open tab keeps Gradio's heartbeat stream open forever; a stop must not wait on it.
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            open_ui(page, cluster["url"])
            page.get_by_label("Text").fill("Still here.")
            page.get_by_role("button", name="Generate").click()
            page.get_by_role("button", name="Download").wait_for(timeout=30000)
            started = time.monotonic()
            done = cli("down", "--state-dir", str(cluster["state_dir"]), timeout=120)
            took = time.monotonic() - started
        finally:
            browser.close()
    assert done.returncode == 0, done.stderr
    print(f"down with a tab open: {took:.1f}s")
    assert took < 15, f"down waited {took:.0f}s on an idle browser tab (drain timeout is 30 s)"
