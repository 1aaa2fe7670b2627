"""Freed memory handed back to the system after a long text.

A long text passes hundreds of MB through an instance in blocks of a few MB (segment
answers, decoded segments, joined chunks). glibc serves blocks under its mmap threshold
(which grows to 32 MiB) from its heaps and keeps them there once freed, so the RSS stays
above what the instance uses (measured on one espeak instance at 205 MiB, after ten
20,000-character texts: 289 MiB without a trim, 250 MiB with one after each text).

Instance side: standard library only; a no-op where the C library has no ``malloc_trim``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger("cosyvoice_lb.instance")


def _trimmer() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return None


_TRIM = _trimmer()


def release() -> bool:
    """Return the free pages of every malloc arena to the system; False where it cannot."""
    if _TRIM is None:
        return False
    try:
        _TRIM(0)
    except OSError as exc:  # (never seen: the instance keeps serving either way)
        log.warning("malloc_trim failed: %s", exc)
        return False
    return True
