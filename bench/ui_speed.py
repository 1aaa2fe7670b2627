#!/usr/bin/env python3
"""A long text through the Gradio UI in a real browser against the same text through the API.

    python bench/ui_speed.py [--chars 2284] [--instances 2] [--repeats 3] [--engine both|simulated|espeak]

Starts a cluster with the CLI on free 127.0.0.1 ports (a text past --max-chars 500 goes to
the cluster in segments, from the API and from the UI alike) and always takes it down again
(also on Ctrl-C and SIGTERM). Per repeat it sends the same text:

  api        POST /v1/tts through nginx, timing the whole WAV answer (streamed and not)
  ui         headless Chromium on the UI through nginx: fill the text, click Generate, time
             until the result's WAV has reached the page (its download button is shown and
             the file it links to is read), with Stream off and on

Prints a table (median of the repeats, min-max beside it) and each UI time over the API's
of the same kind, streamed or not (the target: <= 1.5). Needs chromium and playwright (./run.sh test installs them).

Two engines, side by side (``--engine both``, the default): ``simulated`` synthesizes at a
model's pace (4 ms a character, like a GPU-bound CosyVoice3 instance; the other benches'
load model), where the target is judged; ``espeak`` synthesizes the text in a fraction of a
second, so what the UI adds whatever the text's length (Gradio's queue and file hand-over,
the browser loading the player) shows as a ratio of its own, not judged.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import load  # noqa: E402  (bench/load.py: SIGTERM stops the run as Ctrl-C does)
from long_text import text_of  # noqa: E402

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]


class Cluster:
    def __init__(self, args: argparse.Namespace):
        self.state = Path(tempfile.mkdtemp(prefix="cvlb-ui-", dir="/tmp"))
        self.port = load.free_port_block(1)
        base = load.free_port_block(args.instances)
        self.command = [
            *load.cli_command(), "up", "--engine", args.engine_now, "--instances", str(args.instances),
            "--host", "127.0.0.1", "--port", str(self.port), "--base-port", str(base),
            "--state-dir", str(self.state), "--max-chars", "500", "--request-timeout", "600",
        ]  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Cluster:
        done = subprocess.run(self.command, capture_output=True, text=True, timeout=300, cwd=ROOT)
        if done.returncode != 0:
            self.__exit__()
            raise SystemExit(f"cosyvoice-lb up failed:\n{done.stdout}\n{done.stderr}")
        return self

    def __exit__(self, *_exc: object) -> None:
        with load.shielded():
            subprocess.run([*load.cli_command(), "down", "--state-dir", str(self.state)], capture_output=True,
                           timeout=120, cwd=ROOT)  # fmt: skip
            shutil.rmtree(self.state, ignore_errors=True)


def api_once(http: requests.Session, url: str, text: str, stream: bool = False) -> float:
    """Seconds until the whole answer is read."""
    t0 = time.monotonic()
    with http.post(url + "/v1/tts", json={"text": text, "stream": stream}, stream=True, timeout=600) as answer:
        answer.raise_for_status()
        for _ in answer.iter_content(1 << 16):
            pass
    return time.monotonic() - t0


def ui_once(browser, url: str, text: str, stream: bool) -> float:
    """Seconds from the click on Generate until the whole result's WAV is on the page."""
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(url + "/", wait_until="networkidle")
        page.get_by_label("Text").fill(text)
        if stream:
            page.get_by_label("Stream", exact=True).check()
        download = page.get_by_role("button", name="Download")
        t0 = time.monotonic()
        page.get_by_role("button", name="Generate").click()
        download.wait_for(timeout=600_000)
        # (the player links the file; reading it all is what the API's time includes too)
        link = page.locator("a[download]").first.get_attribute("href") or ""
        size = page.evaluate("async (u) => (await (await fetch(u)).arrayBuffer()).byteLength", link)
        took = time.monotonic() - t0
        if size < 44 or page.get_by_text("Error").count():
            raise SystemExit(f"the UI gave no audio ({size} bytes)")
        return took
    finally:
        context.close()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f}  ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chars", type=int, default=2284)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", default="both", choices=("both", "simulated", "espeak"))
    args = parser.parse_args()
    engines = ["simulated", "espeak"] if args.engine == "both" else [args.engine]
    load.stop_on_sigterm()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        raise SystemExit("chromium is not installed (./run.sh test installs it)")
    text = text_of(args.chars)
    http = requests.Session()
    http.trust_env = False
    kinds = ("api", "ui", "api, streamed", "ui, streamed")
    rows: dict[tuple[str, str], list[float]] = {(e, k): [] for e in engines for k in kinds}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            for engine in engines:
                args.engine_now = engine
                with Cluster(args) as cluster:
                    api_once(http, cluster.url, text)  # warm: connections, first segments
                    ui_once(browser, cluster.url, text[:200], False)
                    for _ in range(args.repeats):
                        rows[engine, "api"].append(api_once(http, cluster.url, text))
                        rows[engine, "ui"].append(ui_once(browser, cluster.url, text, False))
                        rows[engine, "api, streamed"].append(api_once(http, cluster.url, text, stream=True))
                        rows[engine, "ui, streamed"].append(ui_once(browser, cluster.url, text, True))
        finally:
            browser.close()
    # (each UI row against the API's answer of the same kind)
    against = {"api": "api", "ui": "api", "api, streamed": "api, streamed", "ui, streamed": "api, streamed"}
    print(f"\n$ python bench/ui_speed.py --chars {args.chars} --instances {args.instances} "
          f"--repeats {args.repeats} --engine {args.engine}")  # fmt: skip
    print(f"{len(text)} characters, {args.instances} instances; seconds, median (min-max) of {args.repeats}")
    print(f"{'engine':11}{'':16}{'seconds':>24}{'/ api of its kind':>20}")
    ratio = {(e, k): statistics.median(v) / statistics.median(rows[e, against[k]]) for (e, k), v in rows.items()}
    for (engine, kind), values in rows.items():
        print(f"{engine:11}{kind:16}{spread(values):>24}{ratio[engine, kind]:>20.2f}")
    judged = "simulated" if "simulated" in engines else engines[0]
    worst = max(ratio[judged, "ui"], ratio[judged, "ui, streamed"])
    print(f"\nslowest UI / API on {judged} (streamed against streamed) = {worst:.2f} (target <= 1.5)")
    return 0 if worst <= 1.5 else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (KeyboardInterrupt, load.Interrupted):
        sys.exit(130)
