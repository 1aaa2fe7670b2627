"""Access through the real cluster: tokens, the UI login (a session good on every instance),
gradio_client behind the token, rate limits, body limits, the public /ping, and secrets that
stay out of command lines, logs and readable files. Loopback only: a cluster that asks for
credentials on 127.0.0.1 (--ui-auth) behaves as a public one does."""

from __future__ import annotations

import concurrent.futures
import http.client
import io
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import bcrypt
import psutil
import pytest
import requests
import soundfile
from conftest import cli, free_port_block, status

TOKEN_A = "first-team-token-0123456789abcdef"
TOKEN_B = "second-team-token-0123456789abcdef"
INSTANCES = 2


def session() -> requests.Session:
    s = requests.Session()
    s.trust_env = False
    return s


def private(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def cluster():
    root = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    state_dir = root / "s"
    users = private(root / "users", "ann:" + bcrypt.hashpw(b"ann's password", bcrypt.gensalt(4)).decode() + "\n")
    port, base = free_port_block(1), free_port_block(INSTANCES)
    args = [
        "--engine",
        "espeak",
        "--instances",
        str(INSTANCES),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        "--ui-auth",
        str(users),
        "--rate-limit",
        "10r/s",
        "--rate-burst",
        "4",
        "--max-upload",
        "1MiB",
        "--max-body",
        "2MiB",
    ]
    done = cli("up", *args, timeout=300)
    info = {
        "root": root,
        "state_dir": state_dir,
        "url": f"http://127.0.0.1:{port}",
        "up": done,
        "args": args,
        "base": base,
        "port": port,
    }
    yield info
    cli("down", "--state-dir", str(state_dir), timeout=120)
    shutil.rmtree(root, ignore_errors=True)


def generated(cluster) -> str:
    return (cluster["state_dir"] / "api-token").read_text().splitlines()[-1]


def valid_token(cluster) -> str:
    """A token that works now: the token file's, once a test gave one, else the generated one."""
    tokens = cluster["root"] / "tokens"
    return tokens.read_text().split()[-1] if tokens.exists() else generated(cluster)


def tts(url: str, token: str | None = None, text: str = "Hello there.", **kw) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with session() as s:
        return s.post(url + "/v1/tts", json={"text": text}, headers=headers, timeout=60, **kw)


def test_up_says_how_to_get_in_and_never_prints_the_token(cluster):
    done = cluster["up"]
    assert done.returncode == 0, done.stderr
    token_file = cluster["state_dir"] / "api-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert f"generated into {token_file}" in done.stdout and "/login" in done.stdout
    assert generated(cluster) not in done.stdout + done.stderr


def test_status_says_credentials_are_required(cluster):
    done = cli("status", "--state-dir", str(cluster["state_dir"]))
    assert f"access: nginx on 127.0.0.1:{cluster['port']} (this box only); credentials required" in done.stdout
    assert status(cluster["state_dir"])[1]["access"] == {
        "listen": f"127.0.0.1:{cluster['port']}",
        "public": False,
        "credentials": True,
        "admin": f"http://127.0.0.1:{cluster['port']}/admin",
        "admin_token_file": str(Path(cluster["state_dir"]).resolve() / "admin-token"),
    }
    assert f"control panel: http://127.0.0.1:{cluster['port']}/admin" in done.stdout


def test_the_api_needs_a_token_and_says_so(cluster):
    none = tts(cluster["url"])
    assert none.status_code == 401 and none.headers["WWW-Authenticate"] == 'Bearer realm="cosyvoice-lb"'
    assert "Authorization: Bearer" in none.json()["error"]["message"]
    wrong = tts(cluster["url"], "not-the-token-0123456789")
    assert wrong.status_code == 401 and 'error="invalid_token"' in wrong.headers["WWW-Authenticate"]
    for answer in (none, wrong):
        assert answer.headers["X-Content-Type-Options"] == "nosniff" and answer.headers["X-Frame-Options"]
    good = tts(cluster["url"], generated(cluster))
    assert good.status_code == 200
    audio, rate = soundfile.read(io.BytesIO(good.content))
    assert len(audio) > rate // 4 and good.headers["Referrer-Policy"] == "same-origin"


def test_gradio_client_is_no_way_around_the_token(cluster):
    from gradio_client import Client

    with pytest.raises(Exception):  # noqa: B017 - gradio_client raises its own kinds for a 401
        Client(cluster["url"] + "/", verbose=False).predict("Sneaking in.", 1.0, api_name="/generate")
    client = Client(cluster["url"] + "/", verbose=False, headers={"Authorization": f"Bearer {generated(cluster)}"})
    audio, rate = soundfile.read(client.predict("Hello with a token.", 1.0, api_name="/generate"))
    assert len(audio) > rate // 4


def test_a_browser_logs_in_once_and_the_session_holds_on_every_instance(cluster):
    url = cluster["url"]
    with session() as browser:
        first = browser.get(url + "/", headers={"Accept": "text/html"}, allow_redirects=False)
        assert first.status_code == 303 and first.headers["Location"].startswith("/login?next=")
        form = browser.get(url + first.headers["Location"])
        assert form.status_code == 200 and 'type="password"' in form.text
        bad = browser.post(url + "/login", data={"user": "ann", "password": "guess"}, allow_redirects=False)
        assert bad.status_code == 401 and "cvlb_session" not in browser.cookies
        good = browser.post(
            url + "/login", data={"user": "ann", "password": "ann's password", "next": "/"}, allow_redirects=False
        )
        assert good.status_code == 303 and good.headers["Location"] == "/"
        page = browser.get(url + "/", headers={"Accept": "text/html"})
        assert page.status_code == 200 and "<html" in page.text.lower()
        cookie = browser.cookies["cvlb_session"]
    for i in range(INSTANCES):  # signed with the secret every instance shares
        direct = f"http://127.0.0.1:{cluster['base'] + i}/gradio_api/info"
        with session() as s:
            assert s.get(direct, cookies={"cvlb_session": cookie}, timeout=10).status_code == 200
            assert s.get(direct, timeout=10).status_code == 401


def test_new_tokens_apply_on_up_without_a_restart(cluster):
    state_dir = cluster["state_dir"]
    before = {i["name"]: i["pid"] for i in status(state_dir)[1]["instances"]}
    tokens = private(cluster["root"] / "tokens", f"# team A\n{TOKEN_A}\n")
    done = cli("up", *cluster["args"], "--api-token-file", str(tokens), timeout=120)
    assert done.returncode == 0, done.stderr
    assert tts(cluster["url"], TOKEN_A).status_code == 200
    assert tts(cluster["url"], generated(cluster)).status_code == 401  # the token file replaces it
    private(tokens, f"{TOKEN_B}\n")
    assert cli("up", *cluster["args"], "--api-token-file", str(tokens), timeout=120).returncode == 0
    assert tts(cluster["url"], TOKEN_B).status_code == 200 and tts(cluster["url"], TOKEN_A).status_code == 401
    assert {i["name"]: i["pid"] for i in status(state_dir)[1]["instances"]} == before


def test_a_burst_past_the_rate_limit_gets_429_with_retry_after(cluster):
    token = valid_token(cluster)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: tts(cluster["url"], token, text="Hi."), range(40)))
    codes = [a.status_code for a in answers]
    limited = [a for a in answers if a.status_code == 429]
    assert limited and all(a.headers["Retry-After"] == "1" for a in limited), codes
    assert "--rate-limit 10r/s" in limited[0].json()["error"]["message"]
    assert set(codes) <= {200, 429, 503}, codes  # 503: every instance's queue full, never a server fault


def test_a_body_over_max_body_is_a_json_413(cluster):
    r = tts(cluster["url"], valid_token(cluster), text="x" * (3 * 2**20))
    assert r.status_code == 413 and "--max-body" in r.json()["error"]["message"]


def test_public_ping_is_ready_or_not_without_process_details(cluster):
    def ping(source: str) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", cluster["port"], timeout=10, source_address=(source, 0))
        conn.request("GET", "/ping")
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())

    code, brief = ping("127.0.0.2")  # any address but this box's own 127.0.0.1
    assert code == 200 and brief == {"ready": True}
    code, details = ping("127.0.0.1")
    assert code == 200 and {"pid", "engine", "inflight"} <= set(details)


def test_no_secret_in_a_command_line_a_log_or_a_readable_file(cluster):
    state_dir = cluster["state_dir"]
    secrets = [generated(cluster), TOKEN_A, TOKEN_B, "ann's password"]
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if str(state_dir) in line:
            assert not any(s in line for s in secrets), line
    for path in state_dir.rglob("*"):
        if not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", "replace")
        holds = [s for s in secrets if s in text]
        if holds:  # only the generated token's own file, readable by its owner only
            assert path == state_dir / "api-token" and holds == [generated(cluster)], path
        if path.name in ("access.json", "api-token"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((state_dir / "run").stat().st_mode) == 0o700  # supervisord's socket too
    assert os.stat(state_dir / "run/supervisor.sock")
