"""Bad audio on an instance: what it found (:class:`AudioWatch`), and the canary that checks
the instance itself while it is idle (:class:`CanaryLoop`).

Every synthesis is judged by the audio check (``audio.check``) before it is answered. A bad
answer to a request is never sent (the request is retried elsewhere), but it may be the
request's own doing (a prompt the model cannot speak) or the instance's (a model that makes
NaN for everything: TensorRT with fp16 on some cards). The canary tells them apart: a
standard text (``quality.probe``: what it says, and how it is judged), synthesized at once after a bad answer (it takes the next free engine slot:
a busy instance may never be idle, and one that fails every request must not wait for a
quiet moment to be found out), and every ``--canary-interval`` seconds (0: never) of an
idle instance that checked no audio meanwhile. Bad canary audio (or a bad warm-up) takes
the instance out: its phase turns ``bad-audio`` (``/ping`` 503 with the reason), and the
health loop restarts it; good canary audio after a bad answer says the request was at fault,
and the instance serves on.

The periodic canary runs only while the instance holds nothing (no synthesis in flight, none
waiting), off-peak; a request that arrives meanwhile waits for it, one short synthesis at
most. No canary is counted as served. The loop takes its clock, sleep and synthesis in:
tested without sleeping.

Instance side: standard library only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from cosyvoice_lb.instance.audio.check import Fault
from cosyvoice_lb.instance.speech.admission import Admission, Clock, Phase, Snapshot

log = logging.getLogger("cosyvoice_lb.instance")

POLL_SECONDS = 1.0  # how often an idle instance looks whether a canary is due
OWED_POLL_SECONDS = 0.02  # after a bad answer: how soon it runs one
WHERE = {"warm_up": "the warm-up synthesis", "canary": "a canary synthesis"}


class AudioWatch:
    """The bad audio an instance found, by reason (``/ping``'s ``bad_audio``), when audio
    last passed the check, and whether a canary is owed (a request's audio was bad).
    ``record(reason, during)``: the metrics' counter."""

    def __init__(self, clock: Clock = time.monotonic, record: Callable[[str, str], None] = lambda r, d: None):
        self.clock, self.record = clock, record
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self.last_good = clock()  # (on the admission clock)
        self.owed = threading.Event()

    def good(self) -> None:
        self.last_good = self.clock()

    def bad(self, fault: Fault, during: str) -> None:
        """Count bad audio found ``during`` a request, the warm-up or a canary; a request's
        owes a canary."""
        with self._lock:
            self._counts[fault.reason] = self._counts.get(fault.reason, 0) + 1
        self.record(fault.reason, during)
        if during == "request":
            self.owed.set()

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def take_out(admission: Admission, watch: AudioWatch, fault: Fault, during: str) -> None:
    """The warm-up or a canary made bad audio: counted, and the instance out until restarted."""
    watch.bad(fault, during)
    what = WHERE.get(during, during)
    if admission.bad_audio(f"{what} made bad audio: {fault}"):
        log.error("%s made bad audio (%s): out of rotation until the health loop restarts it", what, fault)


def canary_due(now: float, snapshot: Snapshot, last_checked: float, interval: float, owed: bool) -> bool:
    """Whether to run a canary now, on a ready instance: owed after a bad answer (busy or
    not), or, holding nothing, ``interval`` seconds (0: never) after audio last passed the
    check."""
    if snapshot.phase is not Phase.READY:
        return False
    return owed or (snapshot.idle and interval > 0 and now - last_checked >= interval)


class CanaryLoop:
    """Runs a canary when one is due. ``synthesize``: one canary synthesis, its fault or None
    (it raises for anything but bad audio); ``on_bad``: what bad canary audio does (the
    instance out, see :func:`take_out`)."""

    def __init__(
        self,
        interval: float,
        watch: AudioWatch,
        snapshot: Callable[[], Snapshot],
        synthesize: Callable[[], Fault | None],
        on_bad: Callable[[Fault], None],
        clock: Clock = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        unchecked: Callable[[], str] = lambda: "",
    ):
        self.interval, self.watch, self.snapshot = interval, watch, snapshot
        self.unchecked = unchecked  # why the last canary's speech was not checked ("" when it was)
        self.synthesize, self.on_bad = synthesize, on_bad
        self.clock, self.sleep = clock, sleep
        self.runs = 0  # canaries run
        self.last_run = clock()

    def step(self) -> float:
        """Run a canary if one is due; the seconds until the next look."""
        owed = self.watch.owed.is_set()
        now = self.clock()
        if not canary_due(now, self.snapshot(), max(self.watch.last_good, self.last_run), self.interval, owed):
            return OWED_POLL_SECONDS if owed else POLL_SECONDS
        self.watch.owed.clear()
        self.last_run, self.runs = now, self.runs + 1
        try:
            fault = self.synthesize()
        except Exception as exc:  # noqa: BLE001  (not bad audio: the requests' own failures will say it)
            log.warning("canary synthesis failed: %s: %s", type(exc).__name__, exc)
            return POLL_SECONDS
        if fault is None:
            self.watch.good()
            why = self.unchecked()
            if owed and why:  # (could not check: never called a pass)
                log.warning(
                    "canary after a bad answer: its audio passed the audio check; its speech unchecked: %s", why
                )
            elif owed:  # (a periodic pass is not worth a line)
                log.info("canary after a bad answer: it passed its checks (the request's own fault)")
        else:
            self.on_bad(fault)
        return POLL_SECONDS

    def run(self, stopping: Callable[[], bool] = lambda: False) -> None:
        while not stopping():
            self.sleep(self.step())


def start_canary(
    interval: float,
    admission: Admission,
    watch: AudioWatch,
    synthesize: Callable[[], Fault | None],
    unchecked: Callable[[], str] = lambda: "",
) -> CanaryLoop:
    """The instance's canary loop, in a daemon thread of its own."""
    loop = CanaryLoop(
        interval,
        watch,
        admission.snapshot,
        synthesize,
        lambda fault: take_out(admission, watch, fault, "canary"),
        clock=admission.clock,
        unchecked=unchecked,
    )
    threading.Thread(target=loop.run, name="canary", daemon=True).start()
    return loop
