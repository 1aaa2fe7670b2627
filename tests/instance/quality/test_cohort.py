"""The requests a model roll-out compares, instance side (``quality/cohort.py`` and
``quality/compared.py``): which are recorded and how, the copy nginx hangs up on made whole,
the speech check of every compared answer, and the context reaching the synthesis threads."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from test_speech_check import Heard

from cosyvoice_lb.instance.quality.checker import NO_TAP, SpeechChecker
from cosyvoice_lb.instance.quality.cohort import Cohort, deaf, mount_cohort
from cosyvoice_lb.instance.quality.compared import ContextPool, Sample, comparing, current

SEGMENT = "X-Cvlb-Segment"


def app_for(cohort: Cohort, seen: list) -> Starlette:
    async def speech(request: Request):
        seen.append(current())
        body = await request.json()
        if body.get("bad"):
            return JSONResponse({"error": "bad audio"}, status_code=502)
        if body.get("busy"):
            return JSONResponse({"error": "busy"}, status_code=503)

        async def chunks():
            for _ in range(3):
                await asyncio.sleep(0.02)
                yield b"\0" * 100

        return StreamingResponse(chunks(), media_type="audio/wav")

    app = Starlette(
        routes=[Route("/v1/tts", speech, methods=["POST"]), Route("/v1/audio/speech", speech, methods=["POST"])]
    )
    mount_cohort(app, cohort, SEGMENT)
    return app


@pytest.fixture
def serving():
    cohort, seen = Cohort("serving"), []
    with TestClient(app_for(cohort, seen)) as client:
        yield client, cohort, seen


def test_a_serving_instance_records_only_what_nginx_marked(serving):
    client, cohort, seen = serving
    client.post("/v1/tts", json={})  # ordinary traffic
    client.post("/v1/tts", json={}, headers={"X-Cvlb-Cohort": "serving"})
    client.post("/v1/audio/speech", json={}, headers={"X-Cvlb-Cohort": "serving", SEGMENT: "1/2"})  # a segment
    assert seen[0] is None and isinstance(seen[1], Sample) and seen[2] is None
    [sample] = cohort.samples
    assert sample.outcome == "ok"
    assert 0 < sample.first_chunk < sample.total and sample.total >= 0.05  # (its three chunks, 20 ms apart)


def test_outcomes_bad_audio_apart_from_refusals(serving):
    client, cohort, _ = serving
    mark = {"X-Cvlb-Cohort": "serving"}
    client.post("/v1/tts", json={"bad": True}, headers=mark)
    client.post("/v1/tts", json={"busy": True}, headers=mark)
    assert [s.outcome for s in cohort.samples] == ["bad_audio", "refused"]
    assert all(s.unchecked == "no audio to check" for s in cohort.samples)


def test_a_canary_records_everything_and_cohort_is_served_on_loopback_only():
    cohort = Cohort("canary")
    with TestClient(app_for(cohort, [])) as client:
        client.post("/v1/tts", json={})
        client.post("/v1/audio/speech", json={}, headers={"X-Cvlb-Cohort": "canary"})
        answer = client.get("/cohort").json()
        assert answer["role"] == "canary" and [s["outcome"] for s in answer["samples"]] == ["ok", "ok"]
        assert client.get("/cohort", headers={"X-Request-Start": "1"}).status_code == 404  # (through nginx)


def test_a_copy_never_hears_that_its_client_left():
    said = [{"type": "http.request", "body": b"{}", "more_body": False}, {"type": "http.disconnect"}]

    async def receive():
        return said.pop(0)

    async def run():
        heard = deaf(receive)
        first = await heard()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(heard(), 0.1)  # (the disconnect is never handed on)
        return first

    assert asyncio.run(run())["body"] == b"{}"


def test_work_in_the_pool_runs_in_the_submitters_context():
    probe: contextvars.ContextVar[str] = contextvars.ContextVar("probe", default="none")
    probe.set("request 7")
    with ContextPool(max_workers=2) as pool:
        assert pool.submit(probe.get).result() == "request 7"
        assert pool.submit(lambda: threading.current_thread().name).result() != threading.current_thread().name


def test_a_compared_answer_is_always_checked_and_told_what_was_heard():
    checker = SpeechChecker(lambda: Heard("hello there"), sample=0.0)
    assert checker.tap("hello there", 16000) is NO_TAP  # (--asr-sample 0: ordinary answers are not)
    sample = Sample(at=time.time())
    token = comparing.set(sample)
    try:
        tap = checker.tap("hello there friend", 16000)
    finally:
        comparing.reset(token)
    assert tap is not NO_TAP
    tap.add(np.ones(1600, dtype=np.float32))
    tap.done()
    deadline = time.monotonic() + 5
    while sample.unchecked == "not checked yet" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sample.error == pytest.approx(1 / 3) and sample.unchecked == ""


def test_a_compared_answer_no_recogniser_hears_says_so():
    checker = SpeechChecker(None, unavailable="no recogniser named")
    sample = Sample(at=time.time())
    token = comparing.set(sample)
    try:
        assert checker.tap("hello", 16000) is NO_TAP
    finally:
        comparing.reset(token)
    assert sample.error is None and sample.unchecked == "no recogniser named"


def test_the_wait_for_the_engine_is_told_to_the_compared_request_once():
    from cosyvoice_lb.instance.quality.compared import compared_wait

    compared_wait(1.0)  # (no request compared: nothing to tell)
    sample = Sample(at=0.0)
    token = comparing.set(sample)
    try:
        compared_wait(0.25)
        compared_wait(3.0)  # (a retry's second admission: the first wait stands)
    finally:
        comparing.reset(token)
    assert sample.queued == 0.25 and sample.as_dict()["queued"] == 0.25
