"""The instance's objects, built from its command line: each is given what it needs when it is
built, and nothing is wired into one after.

The engine gets its metrics' observers; admission gets the router that publishes its every
change (``--board``, ``--slot``: routing by work); the pipeline gets its limits (no long texts
where there is no fan-out to send their segments to), its router and whether it is a model
roll-out's canary (``--canary``: its speech is measured, not gated); the fan-out
(``--balancer``) gets admission's clock, which its deadlines are on.

Instance side: the standard library and what the pipeline's parts import.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict

from cosyvoice_lb import __version__
from cosyvoice_lb.common.concurrency import concurrency
from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.sizes import parse_size
from cosyvoice_lb.instance.audio.outputs import Outputs
from cosyvoice_lb.instance.engines import create_engine
from cosyvoice_lb.instance.metrics import MISSING, Metrics
from cosyvoice_lb.instance.quality.checker import SpeechChecker
from cosyvoice_lb.instance.quality.isolated import Isolated
from cosyvoice_lb.instance.quality.recognizers import choose
from cosyvoice_lb.instance.quality.speaker import speaker_model_for
from cosyvoice_lb.instance.routing.board import Opener
from cosyvoice_lb.instance.routing.router import Router, SharedBoard
from cosyvoice_lb.instance.routing.rule import Rate
from cosyvoice_lb.instance.speech.admission import Admission, Clock, Phase
from cosyvoice_lb.instance.speech.fanout import Balancer, FanOut
from cosyvoice_lb.instance.speech.pipeline import Pipeline
from cosyvoice_lb.instance.speech.poison import Ledger
from cosyvoice_lb.instance.speech.validation import Limits
from cosyvoice_lb.instance.speech.voices import Registry

log = logging.getLogger("cosyvoice_lb.instance")


def routed_admission(
    slots: int,
    max_queue: int | None,
    slot: int,
    board: Callable[[], SharedBoard | None],
    clock: Clock = time.monotonic,
) -> tuple[Admission, Router]:
    """Admission and the router that publishes its every change, each given the other when
    built: the router reads the admission made right after it (its callables look it up
    then), and admission is made telling the router each change. ``slot``: this instance's
    row on the ``board``."""
    admission: Admission
    router = Router(
        slot,
        os.getpid(),
        lambda: admission.load(),
        lambda: admission.phase is Phase.READY,
        Rate(),
        clock,
        board,
        lambda seconds: admission.reserve(seconds),
    )
    admission = Admission(slots, max_queue, clock, on_change=router.publish)
    return admission, router


def fan_out(settings: Settings, args: argparse.Namespace, clock: Clock = time.monotonic) -> FanOut | None:
    """Where long texts' segments go (nginx, ``--balancer``; ``clock``: admission's), or None:
    nowhere, and texts past --max-chars are refused."""
    if not (args.balancer and settings.max_long_chars):
        return None
    key = ""
    if args.segment_key_file:
        with open(args.segment_key_file, encoding="utf-8") as handle:
            key = handle.read().strip()
    balancer = Balancer(args.balancer, args.peers, min(settings.segment_chars, settings.max_chars), key)
    return FanOut(balancer, clock)


def scratch_dir(outputs_dir: str, port: int) -> str:
    """Where prompt uploads are written for upstream as files; a killed run's leftovers go."""
    scratch = os.path.join(outputs_dir, ".prompts") if outputs_dir else tempfile.gettempdir()
    os.makedirs(scratch, exist_ok=True, mode=0o700)
    for stale in os.listdir(scratch):
        if stale.startswith(f"prompt-{port}-"):
            try:
                os.unlink(os.path.join(scratch, stale))
            except FileNotFoundError:
                pass
    return scratch


def build_pipeline(
    settings: Settings,
    port: int,
    ledger_dir: str = "",
    *,
    canary: bool = False,
    long_texts: bool = True,
    board: str = "",
    slot: int = -1,
    clock: Clock = time.monotonic,
) -> Pipeline:
    """The instance's pipeline for its settings (as parsed from its command line).

    ``canary``: a model roll-out's canary (its speech is measured, not gated); ``long_texts``:
    False where there is no fan-out (texts past --max-chars are refused then); ``board`` and
    ``slot``: the routing board and this instance's row on it (neither: it never declines);
    ``clock``: admission's, the router's."""
    # (the launcher passes a number; ``auto`` here: an instance started by hand, pinned to a
    # GPU when CUDA_VISIBLE_DEVICES names one)
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() not in ("", "-1")
    slots = concurrency(settings.instance_concurrency, settings.resolved_engine, settings.load_vllm, gpu)
    metrics = Metrics(settings.resolved_engine, __version__)  # (the engine's name)
    if not metrics.enabled:
        log.warning("no metrics: %s", MISSING)
    # an engine that times its first chunk's parts, or batches syntheses, tells the metrics
    hooks = {"on_first_chunk": metrics.first_chunk_parts, "on_batch": metrics.batched}
    options = {**asdict(settings), "concurrency": slots, "port": port, **hooks}
    engine = create_engine(settings.resolved_engine, **options)
    limits = Limits(
        max_chars=settings.max_chars,
        max_long_chars=settings.max_long_chars if long_texts else 0,
        max_prompt_seconds=settings.max_prompt_seconds,
        max_upload_bytes=parse_size(settings.max_upload),
    )
    outputs = Outputs(settings.outputs_dir, port, settings.outputs_max_age, parse_size(settings.outputs_max_size))
    router = None
    if board and slot >= 0:
        admission, router = routed_admission(slots, settings.max_queue, slot, Opener(board), clock)
    else:
        admission = Admission(slots, settings.max_queue, clock)
    make, unavailable, language = choose(settings.asr, settings.resolved_engine, settings.asr_model)
    speaker = speaker_model_for(settings.model_dir)  # upstream's campplus.onnx: the answers' speaker similarity
    isolated = functools.partial(Isolated, make) if make is not None else None  # (it holds the GIL: see isolated)
    speech = SpeechChecker(
        isolated, settings.asr_sample, settings.asr_max_error, language, unavailable=unavailable, speaker=speaker
    )
    return Pipeline(
        engine,
        admission,
        limits,
        outputs,
        scratch_dir(settings.outputs_dir, port),
        port=port,
        request_timeout=settings.request_timeout,
        ledger=Ledger(ledger_dir) if ledger_dir else None,
        registry=Registry(settings.voices_dir) if settings.voices_dir else None,
        metrics=metrics,
        speech=speech,
        check_prompt=(settings.canary_prompt, settings.canary_prompt_text),
        measured_only=canary,
        router=router,
    )


def build_instance(settings: Settings, args: argparse.Namespace) -> tuple[Pipeline, FanOut | None]:
    """The pipeline of the instance its command line describes (``args``: as
    ``instance_argv`` parses it), and its long-text fan-out (None: none)."""
    clock: Clock = time.monotonic  # admission's: the deadlines, the router's and the fan-out's
    fanout = fan_out(settings, args, clock)
    pipeline = build_pipeline(
        settings,
        args.port,
        args.ledger_dir,
        canary=args.canary,
        long_texts=fanout is not None,
        board=args.board,
        slot=args.slot,
        clock=clock,
    )
    return pipeline, fanout
