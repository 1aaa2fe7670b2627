"""The launcher's user-facing error: the CLI prints its message and exits non-zero."""

from __future__ import annotations


class ClusterError(RuntimeError):
    """A user-facing failure: the message says what went wrong and what to do."""
