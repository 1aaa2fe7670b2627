"""The per-value checks the settings' declarations carry (``setting(check=...)``).

Each takes the flag a value came from and the value, and returns what is wrong with it
("" when nothing), so :func:`cosyvoice_lb.common.setting_errors.setting_errors` can name every bad
setting at once. Standard library only: the instance imports these too.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Callable
from typing import Any

from cosyvoice_lb.common.sizes import parse_size

Check = Callable[[str, Any], str]


def finite(flag: str, value: Any) -> str:
    return "" if math.isfinite(value) else f"{flag} must be a finite number, got {value}"


def above_zero(flag: str, value: Any) -> str:
    return finite(flag, value) or ("" if value > 0 else f"{flag} must be above 0 seconds, got {value}")


def not_negative(flag: str, value: Any) -> str:
    return finite(flag, value) or ("" if value >= 0 else f"{flag} cannot be negative, got {value}")


def at_least(least: int) -> Check:
    def check(flag: str, value: Any) -> str:
        return "" if value >= least else f"{flag} must be at least {least}, got {value}"

    return check


def fraction(flag: str, value: Any) -> str:
    """0 (left to the planner) or a share strictly between 0 and 1."""
    return finite(flag, value) or (
        "" if 0 <= value < 1 else f"{flag} must be above 0 and below 1 (or 0: planned), got {value}"
    )


def concurrency(flag: str, value: Any) -> str:
    """``auto`` or a whole number of at least 1."""
    text = str(value).strip()
    if text == "auto" or (text.isdigit() and int(text) >= 1):
        return ""
    return f"{flag} must be auto or a whole number of at least 1, got {value!r}"


def tcp_port(flag: str, value: Any) -> str:
    return "" if 1 <= value <= 65535 else f"{flag} {value} is not a TCP port (1-65535)"


def size(flag: str, value: Any) -> str:
    if value == "":
        return ""
    try:
        parse_size(value)
    except ValueError as exc:
        return f"{flag}: {exc}"
    return ""


def rate(flag: str, value: Any) -> str:
    if value == "" or re.fullmatch(r"[1-9][0-9]{0,6}r/[sm]", value):
        return ""
    return f"{flag} {value!r} is not a rate: write requests per second or minute, e.g. 10r/s or 120r/m"


def private_file(flag: str, value: Any) -> str:
    """A secrets file: there, and readable by its owner only (as ssh asks of a key)."""
    if value == "":
        return ""
    try:
        mode = os.stat(os.path.expanduser(value)).st_mode
    except OSError as exc:
        return f"{flag} {value}: {exc.strerror or exc}"
    if not stat.S_ISREG(mode):
        return f"{flag} {value} is not a file"
    if mode & 0o077:
        return f"{flag} {value} is readable by others (mode {stat.S_IMODE(mode):04o}): run chmod 600 {value}"
    return ""


def percentage(flag: str, value: Any) -> str:
    return "" if 0 <= value <= 100 else f"{flag} must be 0..100 (percent), got {value}"


def prompt_seconds(least: float) -> Check:
    """Prompt audio of ``least`` seconds at least (the settings' ``MIN_PROMPT_SECONDS``), and at
    most the 30 that upstream accepts."""

    def check(flag: str, value: Any) -> str:
        if least <= value <= 30:
            return ""
        return (
            f"{flag} must be at least {least:g} (shorter prompts are refused) and at most 30 "
            f"(upstream refuses longer prompts), got {value}"
        )

    return check


def parsed_by(parse: Callable[[Any], object], joiner: str = ": ") -> Callable[[str, Any], str]:
    """The check of a setting whose value ``parse`` reads: the ValueError it raises, after the flag."""

    def check(flag: str, value: Any) -> str:
        try:
            parse(value)
        except ValueError as exc:
            return f"{flag}{joiner}{exc}"
        return ""

    return check


def voice_map(flag: str, value: Any) -> str:
    return parsed_by(parse_voice_map)(flag, value)


def parse_voice_map(value: str) -> dict[str, str]:
    """``alloy=narrator,nova=voice_...`` -> {"alloy": "narrator", "nova": "voice_..."}."""
    mapping: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, target = (x.strip() for x in item.partition("="))
        if not sep or not name or not target:
            raise ValueError(f"{item!r} is not NAME=VOICE (e.g. alloy=narrator)")
        mapping[name] = target
    return mapping
