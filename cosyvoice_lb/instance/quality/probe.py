"""The instance's own checks of itself, the warm-up and the canary: what they say and the
verdict on it.

What they say: ``CHECK_TEXT`` in the engine's default mode. A model that only clones
(CosyVoice3 has no preset speakers) gets a prompt to speak with, the first of: the
operator's (``--canary-prompt WAV`` and ``--canary-prompt-text``), the first saved voice, the
model's own bundled prompt, the prompt this package ships (``assets/check_prompt.wav``:
made with Debian's flite, voice ``slt``, from two Harvard sentences; free to ship).

The verdict (:class:`Verdict`): the audio check first (NaN, clipping, silence, length),
then the speech check when there is a recogniser (``quality.checker``): an error above
``--asr-max-error`` is bad audio like any other. "Could not check" is never a pass: the
verdict then says ``unchecked`` and why, which ``/ping``, ``status`` and the panel show.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cosyvoice_lb.instance.audio.check import Fault
from cosyvoice_lb.instance.audio.prompts import PromptError
from cosyvoice_lb.instance.engines import CLONING, EngineError, SynthesisRequest
from cosyvoice_lb.instance.quality.checker import Check
from cosyvoice_lb.instance.speech.canary import take_out
from cosyvoice_lb.instance.speech.failures import BadAudio
from cosyvoice_lb.instance.speech.validation import BadRequest

log = logging.getLogger("cosyvoice_lb.instance")


CHECK_TEXT = "Hello, this is a short check of the voice."
SHIPPED_PROMPT = (
    str(Path(__file__).resolve().parent.parent / "assets" / "check_prompt.wav"),
    "The birch canoe slid on the smooth planks. Glue the sheet to the dark blue background.",
)


@dataclass(frozen=True)
class Verdict:
    """A warm-up's or canary's result: ``fault`` (bad audio, the speech check's included) or
    None; ``unchecked``: why the speech was not checked ("" when it was, and passed)."""

    fault: Fault | None = None
    unchecked: str = ""
    check: Check | None = None

    @property
    def state(self) -> str:
        return "failed" if self.fault else "unchecked" if self.unchecked else "passed"


def speaking_prompt(
    operator: tuple[str, str], voices: list[tuple[str, str]], bundled: tuple[str, str]
) -> tuple[str, str]:
    """(wav, transcript) a cloning model speaks the checks with: the operator's, else the
    first saved voice (``voices``: their wav paths and transcripts, oldest first), else the
    model's ``bundled`` prompt, else the one this package ships."""
    for wav, text in (operator, *voices[:1], bundled, SHIPPED_PROMPT):
        if wav and Path(wav).is_file():
            return wav, text
    return SHIPPED_PROMPT


def operator_prompt(wav: str, prepare: Callable[[bytes], tuple[str, list[str]]]) -> str:
    """``--canary-prompt``'s file prepared like any prompt (its path); a file that cannot be
    read or is no usable prompt fails the instance's load, saying which."""
    try:
        return prepare(Path(wav).read_bytes())[0]
    except (OSError, BadRequest, PromptError) as exc:
        raise EngineError(f"--canary-prompt {wav}: {exc}") from exc


def saved_prompts(registry: Any) -> list[tuple[str, str]]:
    """The saved voices' (wav, transcript), oldest first (none without a registry)."""
    return [(registry.audio_path(v), v.prompt_text) for v in registry.all()] if registry is not None else []


def bundled_prompt(engine: Any) -> tuple[str, str]:
    """The model's own prompt (upstream's asset), or ("", "")."""
    return getattr(engine, "default_prompt", lambda: ("", ""))()


def speech_fault(check: Check) -> Fault | None:
    """The speech check's failure as bad audio (None when it passed or could not check)."""
    if not check.failed or check.score is None:
        return None
    return Fault(
        "speech_error",
        f"the recogniser heard {check.transcript!r} for {check.text!r}: "
        f"{check.score.kind.upper()} {check.score.ratio:.2f}",
    )


def judged(check: Check | None, no_recognizer: str) -> Verdict:
    """The verdict on audio that passed the audio check, from its speech check (None: there
    is no speech check here, ``no_recognizer`` says why)."""
    if check is None:
        return Verdict(None, no_recognizer)
    return Verdict(speech_fault(check), check.unchecked, check)


class Probe:
    """The warm-up and the canary of one pipeline, and the verdict of the last of them."""

    def __init__(self, pipeline: Any, check_prompt: tuple[str, str] = ("", ""), measured_only: bool = False):
        self.pipeline = pipeline
        self.check_prompt = check_prompt  # --canary-prompt and its transcript
        self.verdict = Verdict(unchecked="not checked yet")
        # A model roll-out's canary (``--canary``) is measured, not gated, on what it says: its
        # speech failing the check is shown (/ping, the comparison), and it keeps its traffic.
        self.measured_only = measured_only

    def load(self) -> None:
        """Load the engine, run the warm-up, then turn ready (unless a drain came first: a
        drained instance never turns ready). A bad warm-up (its audio, or its speech) leaves
        it out, in the ``bad-audio`` phase (see ``speech.canary``)."""
        p, t0 = self.pipeline, time.monotonic()
        if self.check_prompt[0]:  # --canary-prompt, prepared once like any prompt
            self.check_prompt = (operator_prompt(self.check_prompt[0], p.prepare_prompt), self.check_prompt[1])
        p.engine.load()
        verdict = self.run("warm_up")
        if verdict.fault is not None:  # not ready: /ping says bad-audio, and the health loop restarts it
            take_out(p.admission, p.watch, verdict.fault, "warm_up")
            return
        p.watch.good()
        if verdict.unchecked:
            log.warning("warm-up: its audio passed the audio check; its speech is unchecked: %s", verdict.unchecked)
        if p.admission.become_ready():
            log.info(
                "ready: engine %s loaded and warmed up in %.1fs (modes: %s)",
                p.engine.name,
                time.monotonic() - t0,
                ", ".join(p.engine.modes),
            )

    def request(self) -> SynthesisRequest:
        """What the checks say: ``CHECK_TEXT``, with a prompt when the model clones by default."""
        p = self.pipeline
        request = SynthesisRequest(text=CHECK_TEXT)
        if p.modes[0] in CLONING:
            wav, text = speaking_prompt(self.check_prompt, saved_prompts(p.registry), bundled_prompt(p.engine))
            request = replace(request, prompt_wav=wav, prompt_text=text)
        return p.complete(request)

    def run(self, kind: str) -> Verdict:
        """The warm-up's or a canary's synthesis, never counted as served, and its verdict."""
        p, request = self.pipeline, self.request()
        try:
            audio = p.speak(request)
        except BadAudio as exc:
            self.verdict = Verdict(exc.fault)
            return self.verdict
        if audio.size == 0:
            raise EngineError(f"the {kind.replace('_', '-')} synthesis returned no audio")
        rate, prompt = p.engine.sample_rate, request.prompt_wav  # (its speaker is compared with the prompt's)
        check = p.speech.check_now(kind, CHECK_TEXT, audio, rate, prompt=prompt) if p.speech else None
        self.verdict = judged(check, "no speech check on this instance")
        fault = self.verdict.fault
        if self.measured_only and fault is not None and fault.reason == "speech_error":
            log.warning("the %s's speech fails the check, measured and kept in (a model canary): %s", kind, fault)
            return replace(self.verdict, fault=None)
        return self.verdict
