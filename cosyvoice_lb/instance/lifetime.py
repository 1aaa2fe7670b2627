"""How an instance stops: on SIGTERM it drains (takes no new work, lets the syntheses in
flight finish, at most --drain-timeout), then uvicorn shuts down, then what the engine
started outside this process goes (vLLM's engine process), then the process leaves.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from cosyvoice_lb.instance.speech.admission import Admission

log = logging.getLogger("cosyvoice_lb.instance")


def outlive_uvicorns_signal() -> None:
    """uvicorn (0.29 and later) raises the stop signal again once it has shut down, under the
    handlers it found: with the default ones the process would die right there, before its
    last steps (the poison ledger, the engine's own processes) ran. Call before ``run``."""
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: None)


class Tally:
    """Work a drain waits for besides admission's syntheses (the long texts an instance is
    fanning out: their segments run elsewhere), counted while a ``with`` holds it, from the
    event loop and the UI's threads alike."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    def __enter__(self) -> Tally:
        with self._lock:
            self._count += 1
        return self

    def __exit__(self, *_: object) -> None:
        with self._lock:
            self._count -= 1

    def count(self) -> int:
        return self._count


def draining_server(
    config: Any, admission: Admission, drain_timeout: float, coordinating: Callable[[], int] = lambda: 0
) -> Any:
    """A uvicorn server that, on SIGTERM/SIGINT, first stops taking work and lets the
    syntheses in flight finish (at most ``drain_timeout``), then shuts down.

    Waiting for syntheses rather than for connections matters: a browser tab keeps
    Gradio's heartbeat stream open forever, and that must not hold a stop for the full
    drain time.

    Its answers leave whole: head and body in one write (``whole_responses``).
    """
    import uvicorn

    from cosyvoice_lb.instance.whole_responses import http_protocol

    config.http = http_protocol()  # (read when the server loads the config, in run)

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not admission.drain():  # a second signal: stop now
                return super().handle_exit(sig, frame)
            log.info(
                "stopping: draining %d synthesis(es) in flight (at most %gs)",
                admission.snapshot().inflight,
                drain_timeout,
            )

            def drain() -> None:
                deadline = time.monotonic() + drain_timeout
                # (and the long texts this instance coordinates: their segments run elsewhere)
                while (admission.snapshot().inflight or coordinating()) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if admission.snapshot().inflight or coordinating():
                    log.warning(
                        "drain timeout: %d synthesis(es) and %d long text(s) still running",
                        admission.snapshot().inflight,
                        coordinating(),
                    )
                super(DrainingServer, self).handle_exit(sig, frame)

            threading.Thread(target=drain, name="drain", daemon=True).start()

    return DrainingServer(config)


def close_engine(engine: Any) -> None:
    """Stop what the engine started outside this process (vLLM's engine process), if it
    says how; an error is logged, never raised (the instance is leaving)."""
    close = getattr(engine, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception:  # noqa: BLE001
        log.warning("the engine did not close cleanly", exc_info=True)
