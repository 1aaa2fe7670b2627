"""How a setting is declared (:func:`setting`): one dataclass field of
:class:`~cosyvoice_lb.common.settings.Settings` carrying its help, how its flag reads, the
check that refuses a value that cannot work, and whether it reaches the instances. Standard
library only: the instance imports it with the settings.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from cosyvoice_lb.common.checks import Check


def setting(
    default: Any,
    help: str,
    *,
    type: Any = None,
    is_flag: bool = False,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    check: Check | None = None,
    instance: bool | str = False,
    separator: str | None = None,
) -> Any:
    """One setting. ``check`` refuses values that cannot work; ``instance`` passes it to every
    instance's command line (a string: only to instances of that engine); ``separator`` makes
    it repeatable (the flag given once per value; the value, and its environment variable,
    hold them joined by the separator)."""
    return field(
        default=default,
        metadata={
            "help": help,
            "type": type,
            "is_flag": is_flag,
            "choices": choices,
            "metavar": metavar,
            "check": check,
            "instance": instance,
            "separator": separator,
        },
    )
