"""Sizes in bytes, read and written the one way every flag and message uses."""

from __future__ import annotations

import re

GiB = 1024**3
MiB = 1024**2

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(?:IB|I|B)?|B)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "K": 1024, "M": MiB, "G": GiB, "T": 1024**4}


class SizeError(ValueError):
    """A size that cannot be read; the message says how to write one."""


def parse_size(text: str) -> int:
    """Bytes from ``24GiB``, ``24G``, ``24GB``, ``24576MiB`` or a plain byte count.

    Units are binary (``G`` = ``GiB``): GPU memory is reported in MiB by NVML and
    nvidia-smi, so ``24GB`` on a card's label means the same thing here.
    """
    match = _SIZE.match(str(text))
    if not match:
        raise SizeError(f"cannot read size {text!r}: write a number with a unit, e.g. 24GiB, 24G or 24576MiB")
    number, unit = match.groups()
    return int(float(number) * _UNIT[(unit or "").upper()])


def format_size(size: int) -> str:
    """``5.0 GiB`` / ``512 MiB``: the shortest readable binary form."""
    if size >= GiB:
        return f"{size / GiB:.1f} GiB"
    return f"{size / MiB:.0f} MiB"
