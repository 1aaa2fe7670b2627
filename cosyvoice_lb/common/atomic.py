"""The one atomic file writer: a reader sees the old file or the new one, never half of either,
and a failed write (a full disk, a read-only one) leaves nothing behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: str | bytes | memoryview, mode: int = 0o644, durable: bool = True) -> None:
    """Write ``data`` to ``path`` through a temp file beside it, renamed into place.

    ``mode`` is the file's from the start (the temp file is created 0600, then set).
    ``durable`` syncs the data to disk before the rename, so a crash of the box leaves the old
    file or the new one; state files want that, bulk audio does not pay for it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=str(path.parent), prefix=f".{path.name}.", suffix=".tmp")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(raw)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
