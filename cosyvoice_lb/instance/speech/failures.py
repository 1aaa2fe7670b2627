"""The one table from exceptions to answers: every entry point of an instance (the API, the
OpenAI routes, the UI, a long text's segments) turns what went wrong into the same status,
message and headers through :func:`describe`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cosyvoice_lb.instance.audio.check import Fault
from cosyvoice_lb.instance.audio.prompts import PromptError
from cosyvoice_lb.instance.engines import EngineError, Unspeakable
from cosyvoice_lb.instance.speech.admission import Cancelled, NotReady, Overloaded, TimedOut
from cosyvoice_lb.instance.speech.fanout import SegmentFailed
from cosyvoice_lb.instance.speech.poison import Poisoned
from cosyvoice_lb.instance.speech.validation import BadRequest
from cosyvoice_lb.instance.speech.voices import VoiceNotFound


class NoAudio(ValueError):
    """The model said nothing for this text (e.g. punctuation only)."""


class BadAudio(RuntimeError):
    """The synthesis failed the audio check (``audio.check``): NaN, beyond ±1, silent, or a
    duration no voice has for its text. Answered 502, which nginx retries on another instance
    (and a long text's coordinator sends again): the client never gets the bad audio. The
    instance counts it and checks itself with a canary (see ``canary``)."""

    def __init__(self, fault: Fault, port: int = 0):
        where = f"instance {port}" if port else "this instance"
        super().__init__(
            f"{where} made bad audio for this request ({fault}): it was not sent; retry (another instance "
            "answers, and one that keeps making bad audio is restarted); when every try fails so, the model "
            "may not speak this text: reword it"
        )
        self.fault = fault


class Declined(RuntimeError):
    """Routing by work: another instance would start this request sooner. Answered 503 at
    once, and nginx tries an instance it has not tried yet (see ``routing``)."""


class StorageFailed(OSError):
    """A file the request needs (its prompt, its result) could not be written."""

    def __init__(self, what: str, directory: str, cause: OSError, setting: str = "--outputs-dir"):
        reason = cause.strerror or str(cause)
        super().__init__(
            f"{what} could not be written to {directory} ({reason}): the instance is fine, its disk is not, and "
            f"a retry fails the same way until the operator frees space there or points {setting} at a "
            "writable disk ('cosyvoice-lb status' shows it)"
        )


@dataclass(frozen=True)
class Failure:
    """What an entry point answers for an exception."""

    status: int
    message: str
    headers: dict[str, str] = field(default_factory=dict)
    level: int = logging.DEBUG  # how loudly the instance logs it
    param: str | None = None  # the request field at fault, if one is


# The one table from exceptions to answers; the first matching row wins.
ERRORS: tuple[tuple[type[BaseException], Callable[[Any], Failure]], ...] = (
    (BadRequest, lambda e: Failure(e.status, str(e), param=e.param)),
    (PromptError, lambda e: Failure(400, str(e))),
    (NotReady, lambda e: Failure(503, str(e), {"Retry-After": "2"})),
    (Overloaded, lambda e: Failure(503, str(e), {"Retry-After": "1"})),
    (Declined, lambda e: Failure(503, str(e), {"Retry-After": "1", "X-Cvlb-Declined": "1"})),
    (TimedOut, lambda e: Failure(504, str(e), level=logging.WARNING)),
    # (502: nginx's proxy_next_upstream http_502 tries another instance)
    (BadAudio, lambda e: Failure(502, str(e), level=logging.ERROR)),
    (NoAudio, lambda e: Failure(422, "the model produced no audio for this text: send words to speak")),
    # upstream checks its input with assert
    (AssertionError, lambda e: Failure(422, f"the model refused this input: {e}", level=logging.ERROR)),
    # (the same text crashes it again: x-should-retry false, as for every 4xx)
    (Unspeakable, lambda e: Failure(422, str(e), level=logging.WARNING)),
    (EngineError, lambda e: Failure(500, f"synthesis failed: {e}", level=logging.ERROR)),
    (StorageFailed, lambda e: Failure(507, str(e), level=logging.ERROR)),
    (Cancelled, lambda e: Failure(499, "the client went away", level=logging.INFO)),
    # (a retry cannot help: clients that honour x-should-retry stop here)
    (Poisoned, lambda e: Failure(422, str(e), {"x-should-retry": "false"}, level=logging.WARNING)),
    (VoiceNotFound, lambda e: Failure(404, str(e), param="voice")),
    # a long text's segment: its answer is the whole request's
    (SegmentFailed, lambda e: Failure(e.status, str(e), e.headers, level=logging.WARNING)),
)


def describe(exc: BaseException) -> Failure | None:
    """The answer for ``exc``, or None for an exception the pipeline does not expect."""
    for kind, make in ERRORS:
        if isinstance(exc, kind):
            return make(exc)
    return None
