#!/usr/bin/env python3
"""A voice agent's reply, streamed in as it is written against sent whole: how soon the
listener hears it.

    python bench/speech_stream.py [--engine espeak] [--runs 10] [--piece 4] [--pace-ms 40]
    python bench/speech_stream.py --engine cosyvoice3 --model-dir DIR --cosyvoice-root CHECKOUT --python PY

One instance on 127.0.0.1 behind nginx. A simulated LLM writes a three-sentence reply,
``--piece`` characters every ``--pace-ms`` milliseconds (4 / 40: 100 characters a second).
Each run, in turns:

- **streamed**: the pieces go into ``/v1/audio/speech/stream`` as they are written;
- **whole**: the agent waits for the whole reply, then posts it to ``/v1/audio/speech``
  (``response_format`` pcm, streamed answer) — what a client without text streaming does.

Measured per run, from the client's clock: from the last character of the first sentence to
its first audio (what the listener waits for), from the end of the text (``input.text.done``,
or the POST) to the last audio, and from the first character to the first audio. Prints the
median and the spread (min..max) of ``--runs`` runs of each, side by side.

On cosyvoice3 (upstream's code) the session reads the text through upstream's bistream;
give a small model that ends as bistream wants (``tests/upstream/build_model.py
--bistream``) or a real CosyVoice3 model. ``--prompt``/``--prompt-text``: the voice (a saved
voice made from it serves both ways).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
from websockets.sync.client import connect

from cosyvoice_lb.launcher.cluster.ports import free_port_block

ROOT = Path(__file__).resolve().parent.parent
REPLY = (
    "Sure, I can help with that. "
    "Your order left our warehouse this morning and should arrive on Thursday afternoon. "
    "Is there anything else you would like to know about it?"
)
PROMPT = ROOT / "tests" / "fake_cosyvoice" / "asset" / "zero_shot_prompt.wav"
PROMPT_TEXT = "希望你以后能够做的比我还好呦。"


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    print("$ cosyvoice-lb " + " ".join(args), flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "cosyvoice_lb.launcher.cli", *args], capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        print((done.stdout + done.stderr).rstrip(), flush=True)
    return done


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def first_sentence_end(text: str) -> int:
    """How many characters of ``text`` are written when its first sentence is."""
    return text.index(". ") + 1


class Writer:
    """The simulated LLM: yields each piece at its time, and remembers when it wrote what."""

    def __init__(self, text: str, size: int, pace: float):
        self.text, self.size, self.pace = text, size, pace
        self.started = 0.0
        self.first_sentence_at = 0.0

    def __iter__(self):
        self.started = time.monotonic()
        written, end = 0, first_sentence_end(self.text)
        for n, piece in enumerate(pieces(self.text, self.size)):
            wait = self.started + n * self.pace - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            written += len(piece)
            if written >= end and not self.first_sentence_at:
                self.first_sentence_at = time.monotonic()
            yield piece


def streamed(url: str, voice: dict, writer: Writer) -> dict[str, float]:
    first = last = 0.0
    with connect(url, open_timeout=30, max_size=None) as ws:
        ws.send(json.dumps({"type": "session.config", **voice}))
        ws.recv(timeout=30)  # session.created

        def write() -> None:
            for piece in writer:
                ws.send(json.dumps({"type": "input.text.delta", "delta": piece}))
            ws.send(json.dumps({"type": "input.text.done"}))
            done.append(time.monotonic())

        done: list[float] = []
        thread = threading.Thread(target=write)
        thread.start()
        while True:
            frame = ws.recv(timeout=120)
            if isinstance(frame, bytes):
                first = first or time.monotonic()
                last = time.monotonic()
                continue
            event = json.loads(frame)
            if event["type"] in ("done", "error"):
                if event["type"] == "error":
                    raise RuntimeError(f"the session failed: {event['error']}")
                break
        thread.join()
    return times(writer, first, done[0], last)


def whole(url: str, voice: dict, writer: Writer) -> dict[str, float]:
    text = "".join(writer)  # the agent waits for its whole reply
    sent = time.monotonic()
    body = {"model": "tts-1", "input": text, "response_format": "pcm", **({"voice": voice["voice"]} if voice else {})}
    first = last = 0.0
    with requests.post(url, json=body, stream=True, timeout=300) as r:
        r.raise_for_status()
        for chunk in r.iter_content(chunk_size=None):
            if chunk:
                first = first or time.monotonic()
                last = time.monotonic()
    return times(writer, first, sent, last)


def times(writer: Writer, first: float, text_done: float, last: float) -> dict[str, float]:
    return {
        "sentence_to_audio": first - writer.first_sentence_at,
        "done_to_last": last - text_done,
        "start_to_audio": first - writer.started,
    }


def row(name: str, runs: list[dict[str, float]], key: str) -> str:
    values = [r[key] * 1000 for r in runs]
    return f"{name:<10} {statistics.median(values):>8.0f} ms  ({min(values):.0f}..{max(values):.0f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="espeak", choices=("espeak", "flite", "cosyvoice3"))
    parser.add_argument("--runs", type=int, default=10, help="runs of each way (in turns)")
    parser.add_argument("--piece", type=int, default=4, help="characters the LLM writes at a time")
    parser.add_argument("--pace-ms", type=float, default=40.0, help="milliseconds between pieces")
    parser.add_argument("--model-dir", default="")
    parser.add_argument("--cosyvoice-root", default="")
    parser.add_argument("--python", default="")
    parser.add_argument("--prompt", default=str(PROMPT))
    parser.add_argument("--prompt-text", default=PROMPT_TEXT)
    args = parser.parse_args()
    if args.engine == "cosyvoice3" and not args.model_dir:
        parser.error("--engine cosyvoice3 needs --model-dir (and --cosyvoice-root/--python for upstream's code)")
    state = Path(tempfile.mkdtemp(prefix="cvlb-bench-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(1)
    up = ["up", "--engine", args.engine, "--instances", "1", "--port", str(port), "--base-port", str(base)]
    up += ["--state-dir", str(state)]
    for flag in ("model_dir", "cosyvoice_root", "python"):
        if getattr(args, flag):
            up += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    if args.engine == "cosyvoice3":
        up += ["--canary-prompt", args.prompt, "--canary-prompt-text", args.prompt_text]
    try:
        if cli(*up).returncode != 0:
            return 1
        http = f"http://127.0.0.1:{port}"
        voice: dict = {}
        if args.engine == "cosyvoice3":  # one saved voice, spoken both ways
            with open(args.prompt, "rb") as prompt:
                made = requests.post(
                    f"{http}/v1/audio/voices",
                    files={"audio_sample": ("prompt.wav", prompt)},
                    data={"name": "bench", "prompt_text": args.prompt_text, "consent": "yes"},
                    timeout=120,
                )
            made.raise_for_status()
            voice = {"voice": made.json()["id"]}
        ws_url = f"ws://127.0.0.1:{port}/v1/audio/speech/stream"
        pace = args.pace_ms / 1000
        streamed(ws_url, voice, Writer(REPLY, args.piece, pace))  # (warm: the voice cached, the first run's costs)
        whole(f"{http}/v1/audio/speech", voice, Writer(REPLY, args.piece, pace))
        results: dict[str, list[dict[str, float]]] = {"streamed": [], "whole": []}
        for _ in range(args.runs):
            results["streamed"].append(streamed(ws_url, voice, Writer(REPLY, args.piece, pace)))
            results["whole"].append(whole(f"{http}/v1/audio/speech", voice, Writer(REPLY, args.piece, pace)))
        writing = len(pieces(REPLY, args.piece)) * args.pace_ms
        print(
            f"\n{args.engine}: a {len(REPLY)}-character reply written {args.piece} characters every "
            f"{args.pace_ms:g} ms ({writing:.0f} ms in all; the first sentence at "
            f"{(-(-first_sentence_end(REPLY) // args.piece) - 1) * args.pace_ms:.0f} ms), {args.runs} runs each, "
            "median (min..max)"
        )
        for title, key in (
            ("last character of the first sentence -> its first audio", "sentence_to_audio"),
            ("end of the text -> last audio", "done_to_last"),
            ("first character -> first audio", "start_to_audio"),
        ):
            print(f"\n{title}")
            for name in ("streamed", "whole"):
                print(row(name, results[name], key))
        return 0
    finally:
        cli("down", "--state-dir", str(state), timeout=120)
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
