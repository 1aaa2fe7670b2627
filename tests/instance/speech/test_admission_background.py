"""Interactive requests first (cosyvoice_lb/instance/speech/admission.py): a request marked
background (a long-form job's segment) never takes an engine slot while an interactive one
waits, waits only so long, and never makes an interactive request refused; the marker from
the job sender through /v1/audio/speech to admission. A scripted clock; threads wait on the
admission's own change notices, never on sleeps."""

from __future__ import annotations

import http.server
import io
import threading

import numpy as np
import pytest
import soundfile
from fastapi.testclient import TestClient

from cosyvoice_lb.instance.engines.simulated import SimulatedEngine
from cosyvoice_lb.instance.server import build_app
from cosyvoice_lb.instance.speech.admission import (
    BACKGROUND_HEADER,
    Admission,
    Line,
    Overloaded,
    Ticket,
    Waiter,
    is_background,
)
from cosyvoice_lb.instance.speech.pipeline import Pipeline
from cosyvoice_lb.jobs.sender import Sender


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Watched:
    """An admission whose waiters run on threads; :meth:`until` waits for its change notices."""

    def __init__(self, **kwargs):
        self.changed = threading.Condition()
        self.admission = Admission(clock=Clock(), on_change=self.notify, **kwargs)
        assert self.admission.become_ready()
        self.got: list[tuple[str, Ticket]] = []
        self.refused: list[tuple[str, Exception]] = []
        self.threads: list[threading.Thread] = []

    def notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def until(self, predicate) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, timeout=5), "the admission never got there"

    def queue(self, name: str, **kwargs) -> None:
        """One request on its own thread; back once it waits in line (or got its answer)."""
        before = self.admission.snapshot().waiting

        def run() -> None:
            try:
                ticket = self.admission.admit(**kwargs)
            except Overloaded as exc:
                self.refused.append((name, exc))
            else:
                self.got.append((name, ticket))
            self.notify()

        thread = threading.Thread(target=run, daemon=True)
        self.threads.append(thread)
        thread.start()
        self.until(lambda: self.admission.snapshot().waiting > before or not thread.is_alive())

    def next_served(self, ticket: Ticket) -> tuple[str, Ticket]:
        """Release ``ticket`` (one slot): the waiter it goes to."""
        count = len(self.got)
        ticket.release(True)
        self.until(lambda: len(self.got) > count)
        assert len(self.got) == count + 1  # one slot came free: one waiter got it
        return self.got[-1]

    def join(self) -> None:
        for thread in self.threads:
            thread.join(5)
            assert not thread.is_alive()


# --- the line -------------------------------------------------------------------------------


def test_the_line_serves_interactive_first_and_each_kind_oldest_first():
    line = Line()
    waiters = [Waiter(1.0, True), Waiter(2.0), Waiter(3.0, True), Waiter(4.0)]
    for waiter in waiters:
        line.join(waiter)
    assert len(line) == 4 and line.costs() == [2.0, 4.0]  # routing weighs the interactive ones
    line.leave(waiters[2])  # (a background waiter that gave up)
    line.leave(waiters[2])  # (twice: nothing more happens)
    assert [line.next(), line.next(), line.next(), line.next()] == [waiters[1], waiters[3], waiters[0], None]


# --- slots ----------------------------------------------------------------------------------


def test_a_freed_slot_goes_to_every_waiting_interactive_request_before_any_background_one():
    w = Watched(concurrency=1, max_queue=4, background_queue=4)
    held = w.admission.admit(bounded=True)
    w.queue("job-1", bounded=True, background=True)  # (they came first)
    w.queue("job-2", bounded=True, background=True)
    w.queue("user-1", bounded=True)
    w.queue("user-2", bounded=True)
    assert w.admission.snapshot().waiting == 4 and not w.got
    order = []
    ticket = held
    for _ in range(4):
        name, ticket = w.next_served(ticket)
        order.append(name)
    assert order == ["user-1", "user-2", "job-1", "job-2"]
    ticket.release(True)
    w.join()
    assert w.admission.snapshot().idle and w.admission.snapshot().served == 5 and not w.refused


def test_an_interactive_request_arriving_later_still_goes_before_a_waiting_background_one():
    w = Watched(concurrency=1)
    held = w.admission.admit()
    w.queue("job", background=True)
    w.queue("user")  # arrives while the job's segment waits
    name, ticket = w.next_served(held)
    assert name == "user"
    name, ticket = w.next_served(ticket)
    assert name == "job"
    ticket.release(True)
    w.join()


def test_background_work_takes_a_free_slot_when_nobody_interactive_waits():
    w = Watched(concurrency=2)
    job = w.admission.admit(background=True)  # idle: at once
    user = w.admission.admit()  # the other slot
    assert w.admission.snapshot().inflight == 2
    w.queue("job-2", background=True)
    name, ticket = w.next_served(user)  # nobody interactive waits: the job's next segment
    assert name == "job-2"
    for t in (job, ticket):
        t.release(True)
    w.join()
    assert w.admission.snapshot().idle


# --- bounds and refusals --------------------------------------------------------------------


def test_waiting_background_work_never_makes_an_interactive_request_refused():
    w = Watched(concurrency=1, max_queue=1)
    held = w.admission.admit(bounded=True, cost=1.0)
    w.queue("job", bounded=True, background=True, cost=5.0)
    # routing sees only what an interactive request waits behind: the synthesis in flight
    assert w.admission.load().until == pytest.approx(101.0)
    w.queue("user", bounded=True, cost=0.5)  # the queue's one place is the user's: not refused
    assert not w.refused and w.admission.snapshot().waiting == 2
    with pytest.raises(Overloaded, match="1 synthesizing, 1 waiting"):
        w.admission.admit(bounded=True)  # the bound counts interactive waiters only
    name, ticket = w.next_served(held)
    name2, ticket2 = w.next_served(ticket)
    assert (name, name2) == ("user", "job")
    ticket2.release(True)
    w.join()


def test_background_work_that_finds_no_slot_in_its_time_is_a_503_not_a_504():
    clock = Clock()
    admission = Admission(concurrency=1, clock=clock, background_wait=0.0)
    admission.become_ready()
    held = admission.admit(cost=1.0)
    with pytest.raises(Overloaded, match="interactive requests go first"):
        admission.admit(background=True, cost=2.0)
    patient = Admission(concurrency=1, clock=clock)  # the default wait, but no request time left:
    patient.become_ready()
    other = patient.admit()
    with pytest.raises(Overloaded, match="interactive requests go first"):  # (a 504 is not retried)
        patient.admit(background=True, deadline=clock.now)
    for a in (admission, patient):
        assert a.snapshot().waiting == 0 and a.snapshot().inflight == 1  # it left the line
    held.release(True)
    other.release(True)
    admission.admit(background=True).release(True)  # a free slot: taken at once
    assert admission.snapshot().idle and admission.snapshot().served == 2


def test_background_work_past_its_own_queue_is_refused_at_once():
    w = Watched(concurrency=1, background_queue=1)
    held = w.admission.admit()
    w.queue("job-1", background=True)
    with pytest.raises(Overloaded, match="1 of them background work"):
        w.admission.admit(background=True)
    w.queue("user", bounded=True)
    assert not w.refused and w.admission.snapshot().waiting == 2
    name, ticket = w.next_served(held)
    assert name == "user"
    name, ticket = w.next_served(ticket)
    assert name == "job-1"
    ticket.release(True)
    w.join()


def test_the_marker_is_read_from_any_headers():
    assert is_background({"x-cvlb-background": "1"}) and is_background({BACKGROUND_HEADER: " 1 "})
    assert not is_background({}) and not is_background({"x-cvlb-background": "0"})


# --- the marker, end to end -----------------------------------------------------------------


def test_speech_with_the_marker_is_admitted_as_background_work():
    admission = Admission(1, max_queue=0, background_wait=0.0)
    admission.become_ready()
    p = Pipeline(SimulatedEngine(simulated_ms_per_char=0.1, simulated_base_ms=1.0), admission, port=7990)
    body = {"input": "Hello there.", "voice": "alloy", "response_format": "wav"}
    marked = {BACKGROUND_HEADER: "1"}
    with TestClient(build_app(p, p.engine.name, p.port, ui=False), raise_server_exceptions=False) as c:
        ok = c.post("/v1/audio/speech", json=body, headers=marked)  # a free slot: served
        assert ok.status_code == 200 and soundfile.info(io.BytesIO(ok.content)).frames > 0
        held = admission.admit()  # every slot busy
        plain = c.post("/v1/audio/speech", json=body)
        assert plain.status_code == 503 and "0 waiting): retry" in plain.json()["error"]["message"]
        background = c.post("/v1/audio/speech", json=body, headers=marked)  # not held to --max-queue 0
        assert background.status_code == 503 and background.headers["Retry-After"] == "1"
        assert "interactive requests go first" in background.json()["error"]["message"]
        held.release(None)
    assert admission.snapshot().idle and admission.snapshot().served == 1


def test_the_job_sender_marks_every_segment_background():
    seen: list[str | None] = []
    buffer = io.BytesIO()
    soundfile.write(buffer, np.full(240, 0.1, dtype=np.float32), 24000, format="WAV")
    wav = buffer.getvalue()

    class Balancer(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["content-length"]))
            seen.append(self.headers.get(BACKGROUND_HEADER))
            self.send_response(200)
            self.send_header("Content-Type", "audio/wav")
            self.send_header("Content-Length", str(len(wav)))
            self.end_headers()
            self.wfile.write(wav)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Balancer)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    sender = Sender(f"http://127.0.0.1:{server.server_address[1]}", {"Authorization": "Bearer t"}, timeout=5)
    try:
        assert sender({"voice": "alloy"}, "Hello.", 7) == wav
        assert sender.headers["Authorization"] == "Bearer t" and seen == ["1"]
    finally:
        sender.close()
        server.shutdown()
        server.server_close()
        thread.join(5)
