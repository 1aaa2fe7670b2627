"""The streaming sessions' share of the settings (``/v1/audio/speech/stream``: text in as a
voice agent writes it, audio out as it is made; see ``instance/api/speech_socket``).
Standard library only: the instance imports it with the settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from cosyvoice_lb.common.checks import above_zero, at_least
from cosyvoice_lb.common.declaration import setting


@dataclass(frozen=True)
class StreamSettings:
    """Limits of one streaming session; each one that is hit closes it with its own code."""

    stream_max_chars: int = setting(
        4000,
        "Most text one streaming session (/v1/audio/speech/stream) may send, in characters; "
        "past it the session is closed with code 4413.",
        type=int,
        check=at_least(1),
        instance=True,
    )
    stream_idle_timeout: float = setting(
        20.0,
        "Seconds a streaming session may go without a message from its client before its text "
        "is done; past it the session is closed with code 4408.",
        type=float,
        check=above_zero,
        instance=True,
    )
    stream_max_seconds: float = setting(
        120.0,
        "Longest a streaming session may last, from its start to its last audio; past it the "
        "session is closed with code 4408 (nginx's old workers wait as long after a reload).",
        type=float,
        check=above_zero,
        instance=True,
    )
