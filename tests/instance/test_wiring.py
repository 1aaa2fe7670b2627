"""The instance's objects built from its command line, each given what it needs when built:
a model roll-out's canary measures its speech rather than being gated on it, an instance
with nowhere to send long texts' segments refuses them, one on a routing board publishes
each change of its admission there; with a balancer, long texts fan out on admission's clock."""

from __future__ import annotations

import os

from fastapi.testclient import TestClient

from cosyvoice_lb.common.instance_argv import parse_instance_args
from cosyvoice_lb.instance.quality.checker import Check
from cosyvoice_lb.instance.quality.score import Score
from cosyvoice_lb.instance.routing.board import Board
from cosyvoice_lb.instance.server import build_app
from cosyvoice_lb.instance.speech.fanout import Balancer
from cosyvoice_lb.instance.wiring import build_instance

# a live answer that said another text
MISHEARD = Check(
    "request", "hello there", "yellow chair", Score("wer", 1.0, "hello there", "yellow chair"), failed=True
)


def instance_args(tmp_path, *extra: str) -> list[str]:
    return [
        "--port",
        "7893",
        "--engine",
        "simulated",
        "--simulated-ms-per-char",
        "0",
        "--outputs-dir",
        str(tmp_path / "outputs"),
        "--no-ui",
        *extra,
    ]


def test_a_model_canary_without_a_fan_out_on_a_board_is_built_with_each_collaborator(tmp_path):
    board = Board.create(tmp_path / "routing.board")
    argv = instance_args(tmp_path, "--max-chars", "40", "--canary", "--board", str(tmp_path / "routing.board"))
    settings, args = parse_instance_args([*argv, "--slot", "2"])
    assert settings.max_long_chars > 40 and not args.balancer  # long texts allowed, nowhere to send them
    pipeline, fanout = build_instance(settings, args)

    assert fanout is None and pipeline.limits.max_long_chars == 0 and pipeline.limits.text_chars == 40
    assert pipeline.probe.measured_only  # a model canary: its speech is compared, not gated
    pipeline.heard(MISHEARD)
    assert not pipeline.watch.owed.is_set()  # (a serving instance owes a canary for it: below)
    router = pipeline.router
    assert router is not None and router.slot == 2 and router.pid == os.getpid()
    assert pipeline.rate is router.rate  # what the pipeline measures is what the router publishes

    assert board.row(2)[0] == 0  # nothing published yet
    pipeline.load()  # the warm-up, then ready: admission tells the router, which publishes it
    pid, _, _, ready, _ = board.row(2)
    assert pid == os.getpid() and ready
    with TestClient(build_app(pipeline, "simulated", args.port, fanout=fanout, ui=False)) as client:
        refused = client.post("/v1/tts", json={"text": "A sentence. " * 5})
        assert refused.status_code == 413
        message = refused.json()["error"]["message"]
        assert "60 characters, more than the limit of 40" in message and "--max-long-chars" in message
        assert client.post("/v1/tts", json={"text": "A sentence."}).status_code == 200
    pipeline.admission.drain()
    assert not board.row(2)[3]  # draining: published as not ready at once
    board.close()


def test_a_serving_instance_with_a_balancer_fans_long_texts_out_and_without_a_slot_never_declines(tmp_path):
    key = tmp_path / "segment-key"
    key.write_text("k3y\n")
    argv = instance_args(tmp_path, "--max-chars", "150", "--balancer", "http://127.0.0.1:8080", "--peers", "3")
    argv += ["--segment-key-file", str(key), "--board", str(tmp_path / "routing.board")]  # (no --slot)
    settings, args = parse_instance_args(argv)
    pipeline, fanout = build_instance(settings, args)

    assert fanout is not None and fanout.balancer == Balancer("http://127.0.0.1:8080", 3, 150, "k3y")
    assert fanout.clock is pipeline.admission.clock  # the deadlines it keeps are admission's
    assert pipeline.limits.max_long_chars == settings.max_long_chars > 150
    assert pipeline.router is None  # no row on the board: routed by least connections alone
    assert not pipeline.probe.measured_only
    pipeline.heard(MISHEARD)
    assert pipeline.watch.owed.is_set()  # a live answer failed its speech check: a canary is owed
