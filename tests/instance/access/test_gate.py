"""The gate in front of the whole instance app (API, Gradio and its own routes): what is open,
what needs a token or a session, the login form, and the way back after it."""

from __future__ import annotations

import pytest
from conftest import TOKEN, bcrypt_line
from fastapi.testclient import TestClient

from cosyvoice_lb.instance.access.auth import SESSION_COOKIE, Policy, PolicyFile, digest, read_htpasswd
from cosyvoice_lb.instance.access.gate import safe_next
from cosyvoice_lb.instance.engines import create_engine
from cosyvoice_lb.instance.server import build_app
from cosyvoice_lb.instance.speech.admission import Admission
from cosyvoice_lb.instance.speech.pipeline import Pipeline

BEARER = {"Authorization": f"Bearer {TOKEN}"}
JSON_TEXT = {"text": "Hello there."}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("gate") / "access.json"
    path.write_text(
        Policy(frozenset({digest(TOKEN)}), read_htpasswd(bcrypt_line("ann", "pw"), "u"), b"k" * 32).to_json()
    )
    admission = Admission()
    admission.become_ready()
    engine = create_engine("simulated", simulated_ms_per_char=0.0, simulated_base_ms=0.0)
    app = build_app(Pipeline(engine, admission), "simulated", 7860, policy=PolicyFile(str(path)))
    with TestClient(app, raise_server_exceptions=False, follow_redirects=False) as c:
        yield c


# Gradio's routes too: the page, its config and API info, the queue, uploads, files, gradio_client's calls.
CLOSED_ROUTES = [
    ("POST", "/v1/tts"),
    ("GET", "/"),
    ("GET", "/config"),
    ("GET", "/gradio_api/info"),
    ("POST", "/gradio_api/queue/join"),
    ("GET", "/gradio_api/queue/data"),
    ("POST", "/gradio_api/upload"),
    ("GET", "/gradio_api/file=/etc/passwd"),
    ("POST", "/gradio_api/call/generate"),
    ("POST", "/gradio_api/run/predict"),
    ("GET", "/openapi.json"),
    ("GET", "/gradio_api/heartbeat/abc"),
    # the OpenAI-compatible routes
    ("POST", "/v1/audio/speech"),
    ("GET", "/v1/models"),
    ("GET", "/v1/audio/voices"),
    ("POST", "/v1/audio/voices"),
    ("GET", "/v1/audio/voices/voice_0123456789abcdef01234567"),
    ("DELETE", "/v1/audio/voices/voice_0123456789abcdef01234567"),
]


@pytest.mark.parametrize("method,path", CLOSED_ROUTES)
def test_every_route_but_ping_and_login_needs_credentials(client, method, path):
    r = client.request(method, path, json=JSON_TEXT if method == "POST" else None)
    assert r.status_code == 401, (path, r.status_code, r.text[:200])
    assert r.headers["www-authenticate"] == 'Bearer realm="cosyvoice-lb"'
    assert "Authorization: Bearer" in r.json()["error"]["message"]


def test_a_wrong_token_is_told_apart_from_none(client):
    r = client.post("/v1/tts", json=JSON_TEXT, headers={"Authorization": "Bearer not-the-token-at-all"})
    assert r.status_code == 401 and 'error="invalid_token"' in r.headers["www-authenticate"]
    assert "not valid" in r.json()["error"]["message"]
    # OpenAI's shape, and a retry cannot help
    assert r.json()["error"]["type"] == "authentication_error" and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["x-should-retry"] == "false"


def test_ping_and_the_login_form_stay_open(client):
    assert client.get("/ping").status_code == 200 and client.get("/ping").json()["ready"] is True
    assert client.get("/ping/brief").json() == {"ready": True}
    page = client.get("/login?next=/somewhere")
    assert page.status_code == 200 and 'name="password"' in page.text and 'value="/somewhere"' in page.text


def test_the_instances_own_metrics_stay_open_on_loopback_and_refuse_what_came_through_nginx(client):
    # (Prometheus on this box scrapes the instance's loopback port; nginx stamps X-Request-Start)
    assert client.get("/metrics").status_code == 200 and "cosyvoice_requests_total" in client.get("/metrics").text
    assert client.get("/metrics", headers={"X-Request-Start": "1700000000.000"}).status_code == 404


def test_the_token_opens_the_api_and_gradios_routes(client):
    r = client.post("/v1/tts", json=JSON_TEXT, headers=BEARER)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    assert client.get("/gradio_api/info", headers=BEARER).status_code == 200
    assert client.get("/", headers=BEARER).status_code == 200


def test_a_browser_is_sent_to_the_login_and_back(client):
    r = client.get("/?view=api", headers={"Accept": "text/html,application/xhtml+xml"})
    assert r.status_code == 303 and r.headers["location"] == "/login?next=%2F%3Fview%3Dapi"


@pytest.mark.parametrize("user,password", [("ann", "pw"), ("", TOKEN)])
def test_a_login_sets_a_session_that_opens_everything(client, user, password):
    r = client.post("/login", data={"user": user, "password": password, "next": "/?view=api"})
    assert r.status_code == 303 and r.headers["location"] == "/?view=api"
    cookie = r.cookies[SESSION_COOKIE]
    assert "HttpOnly" in r.headers["set-cookie"] and "SameSite=Lax" in r.headers["set-cookie"]
    fresh = TestClient(client.app, follow_redirects=False)  # no cookies of its own
    fresh.cookies.set(SESSION_COOKIE, cookie)
    assert fresh.post("/v1/tts", json=JSON_TEXT).status_code == 200
    assert fresh.get("/gradio_api/info").status_code == 200
    out = fresh.get("/logout")
    assert out.status_code == 303 and "Max-Age=0" in out.headers["set-cookie"]


@pytest.mark.parametrize("user,password", [("ann", "wrong"), ("bob", "pw"), ("", "not-a-token"), ("", "")])
def test_a_failed_login_says_so_and_sets_nothing(client, user, password):
    r = client.post("/login", data={"user": user, "password": password})
    assert r.status_code == 401 and "Wrong user, password or token" in r.text and "set-cookie" not in r.headers


def test_a_forged_or_foreign_cookie_opens_nothing(client):
    forged = Policy(frozenset({digest(TOKEN)}), {}, b"x" * 32).session("t:" + digest(TOKEN), 0.0, seconds=1e10)
    fresh = TestClient(client.app, follow_redirects=False)
    fresh.cookies.set(SESSION_COOKIE, forged)
    assert fresh.post("/v1/tts", json=JSON_TEXT).status_code == 401


def test_a_huge_login_form_is_refused(client):
    assert client.post("/login", data={"password": "x" * 20000}).status_code == 413


@pytest.mark.parametrize(
    "target,expected",
    [
        ("/", "/"),
        ("/?view=api", "/?view=api"),
        ("//evil.example/x", "/"),
        ("https://evil.example", "/"),
        ("/\\evil.example", "/"),
        ("", "/"),
        ("javascript:alert(1)", "/"),
        ("/\t/evil.example", "/"),
        ("/\n/evil.example", "/"),
        ("/ /evil.example", "/"),  # browsers drop blanks
    ],
)
def test_after_the_login_only_paths_of_this_site(target, expected):
    assert safe_next(target) == expected


def test_without_a_policy_nothing_is_asked():
    admission = Admission()
    admission.become_ready()
    engine = create_engine("simulated", simulated_ms_per_char=0.0, simulated_base_ms=0.0)
    with TestClient(build_app(Pipeline(engine, admission), "simulated", 7860)) as open_client:
        assert open_client.post("/v1/tts", json=JSON_TEXT).status_code == 200
