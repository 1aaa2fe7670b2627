"""A real browser (headless Chromium) uses the Gradio UI through nginx, as a person would."""

from __future__ import annotations

import os
import shutil
import time
import tempfile
from pathlib import Path

import pytest

from conftest import cli, free_port_block

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if not CHROMIUM:
    if os.environ.get("CVLB_REQUIRE_BROWSER"):
        raise RuntimeError("chromium is required here (CVLB_REQUIRE_BROWSER): apt-get install chromium")
    pytest.skip("chromium is not installed (./run.sh test installs it)", allow_module_level=True)

playwright = pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def cluster():
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(2)
    done = cli("up", "--instances", "2", "--host", "127.0.0.1", "--port", str(port),
               "--base-port", str(base), "--state-dir", str(state_dir), timeout=300)
    assert done.returncode == 0, done.stderr
    yield {"url": f"http://127.0.0.1:{port}/", "state_dir": state_dir}
    cli("down", "--state-dir", str(state_dir), timeout=120)
    shutil.rmtree(state_dir, ignore_errors=True)


def test_two_browsers_generate_speech_through_nginx(cluster):
    served_by = set()
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            for visitor in range(4):
                context = browser.new_context()
                page = context.new_page()
                page.goto(cluster["url"], wait_until="networkidle")
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


def test_down_does_not_wait_for_an_open_browser_tab(cluster):
    # An open tab keeps Gradio's heartbeat stream open forever; a stop must not wait on it.
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.goto(cluster["url"], wait_until="networkidle")
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
