"""The OpenAI-compatible routes in-process, on the simulated engine (fast, no speech): what
any JSON body gets (never a 5xx), and the request's mapping onto the pipeline."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cosyvoice_lb.instance.api.openai import OPENAI_FIELDS, speech_request, voice_target
from cosyvoice_lb.instance.engines.simulated import SimulatedEngine
from cosyvoice_lb.instance.server import build_app
from cosyvoice_lb.instance.speech.admission import Admission
from cosyvoice_lb.instance.speech.pipeline import Pipeline
from cosyvoice_lb.instance.speech.validation import BadRequest


@pytest.fixture(scope="module")
def client():
    admission = Admission(4, 64)
    admission.become_ready()
    pipeline = Pipeline(SimulatedEngine(simulated_ms_per_char=0), admission)
    with TestClient(build_app(pipeline, "simulated", 7860), raise_server_exceptions=False) as c:
        yield c


def test_the_request_maps_onto_the_pipeline():
    payload, fmt, sse = speech_request(
        {"model": "m", "input": "Hi.", "voice": "nova", "speed": 1.5, "instructions": "Calmly.", "seed": 3},
        {"nova": "narrator"},
        [],
    )
    assert (fmt, sse) == ("mp3", False)
    assert payload == {
        "text": "Hi.",
        "speed": 1.5,
        "stream": False,
        "instruct_text": "Calmly.",
        "mode": "instruct",
        "seed": 3,
        "voice": "narrator",
    }
    payload, fmt, sse = speech_request(
        {"input": "Hi.", "voice": "Alloy", "response_format": "pcm", "stream_format": "sse"}, {}, []
    )
    assert payload == {"text": "Hi.", "speed": 1.0, "stream": True} and (fmt, sse) == ("pcm", True)


def test_voice_names_resolve_in_order_map_then_openai_then_saved():
    mapping = {"alloy": "narrator", "custom": "voice_0123456789abcdef01234567"}
    assert voice_target("alloy", mapping) == "narrator"
    assert voice_target("ALLOY", mapping) == "narrator"
    assert voice_target("shimmer", mapping) == ""  # an OpenAI name: the model's default voice
    assert voice_target({"id": "voice_x"}, mapping) == "voice_x"
    assert voice_target("my-voice", mapping) == "my-voice"
    assert voice_target(None, mapping) == ""
    with pytest.raises(BadRequest):
        voice_target(["alloy"], mapping)


def test_a_built_in_speaker_name_is_a_speaker_not_a_saved_voice():
    payload, _, _ = speech_request({"input": "Hi.", "voice": "中文女"}, {}, ["中文女"])
    assert payload["speaker"] == "中文女" and "voice" not in payload


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=8,
)
bodies = st.fixed_dictionaries({}, optional={name: json_values for name in (*OPENAI_FIELDS, "mode", "seed")})


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies | json_values | st.builds(lambda extra: {"input": "Hello there.", **extra}, bodies))
def test_any_json_body_gets_audio_or_a_4xx_in_openais_shape(client, body):
    r = client.post("/v1/audio/speech", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 200 or 400 <= r.status_code < 500, (body, r.status_code, r.text[:300])
    if r.status_code == 200:
        assert r.content  # audio
    else:
        error = r.json()["error"]
        assert error["message"] and error["type"] and "param" in error and "code" in error
