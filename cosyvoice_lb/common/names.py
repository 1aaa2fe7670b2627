"""``StrEnum``: an enum whose members are their values as strings, for states and kinds that
are written somewhere (a file, a database, JSON, a metric's label, an HTTP answer) -- the
written text is the value, whatever the member is called in code.

The standard library's from Python 3.11; the same behaviour on 3.10 (``str()`` and formatting
give the value, as ``json.dumps``, SQLite and Redis already do for any ``str``).
"""

from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover (3.10)

    class StrEnum(str, enum.Enum):
        """An enum of strings whose ``str()`` and format are its value."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)


__all__ = ["StrEnum"]
