"""An instance without the UI (--no-ui), in-process: the API and /ping as ever, no Gradio
imported, and a 404 that names the API where the UI would be. (A real instance process in a
Python where gradio cannot be imported, behind a real cluster: tests/integration/test_no_ui_cluster.py.)"""

from __future__ import annotations

import sys

import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from cosyvoice_lb.instance.engines.simulated import SimulatedEngine
from cosyvoice_lb.instance.server import build_app
from cosyvoice_lb.instance.speech.admission import Admission
from cosyvoice_lb.instance.speech.pipeline import Pipeline
from cosyvoice_lb.instance.ui.absent import NO_UI, no_ui_message


def no_ui_app(monkeypatch):
    # Gradio made unimportable while the app is built: building it must not need it.
    monkeypatch.setitem(sys.modules, "gradio", None)
    monkeypatch.delitem(sys.modules, "cosyvoice_lb.instance.ui.app", raising=False)
    admission = Admission(1, 2)
    admission.become_ready()
    pipeline = Pipeline(SimulatedEngine(simulated_ms_per_char=0.1), admission, port=7870)
    return build_app(pipeline, "simulated", 7870, ui=False)


@pytest.fixture
def client(monkeypatch):
    with TestClient(no_ui_app(monkeypatch), raise_server_exceptions=False) as c:
        yield c


def test_the_404_says_the_ui_is_off_and_names_the_api():
    assert no_ui_message("/") == NO_UI
    assert "--no-ui" in NO_UI and "POST /v1/audio/speech" in NO_UI
    other = no_ui_message("/gradio_api/upload")
    assert other.startswith("no such path /gradio_api/upload: ") and other.endswith(NO_UI)


def test_the_app_builds_without_gradio_and_never_imports_the_ui(monkeypatch):
    no_ui_app(monkeypatch)
    assert "cosyvoice_lb.instance.ui.app" not in sys.modules


@pytest.mark.parametrize("method", ["GET", "HEAD", "POST"])
def test_the_root_is_a_404_in_the_one_error_shape(client, method):
    r = client.request(method, "/")
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"
    assert r.headers["x-should-retry"] == "false"
    if method != "HEAD":
        assert r.json()["error"] == {
            "message": NO_UI,
            "type": "not_found_error",
            "param": None,
            "code": None,
            "status": 404,
        }


@pytest.mark.parametrize("path", ["/gradio_api/upload", "/config", "/favicon.ico"])
def test_the_ui_paths_are_404s_naming_the_flag(client, path):
    r = client.post(path) if path.endswith("upload") else client.get(path)
    assert r.status_code == 404 and r.json()["error"]["message"] == no_ui_message(path)


def test_the_api_and_ping_serve_as_ever(client):
    assert client.get("/ping").json()["ready"] is True
    r = client.post("/v1/tts", json={"text": "Hello there."})
    assert r.status_code == 200 and r.content[:4] == b"RIFF"
    assert client.get("/v1/models").status_code == 200
    unknown = client.get("/v1/nothing")  # the API's own catch-all still answers its part
    assert unknown.status_code == 404 and "no endpoint /v1/nothing" in unknown.json()["error"]["message"]
    assert client.get("/v1/tts").status_code == 405


def test_a_websocket_where_the_ui_was_is_closed_with_the_reason(client):
    with pytest.raises(WebSocketDisconnect) as closed:
        with client.websocket_connect("/queue/join"):
            pass
    assert closed.value.code == 1008 and "--no-ui" in closed.value.reason
