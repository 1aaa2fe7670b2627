"""Switching a running cluster between loopback and public, live, with real nginx: the
sockets nginx holds move where the config says (read from the OS, never by connecting to
a non-loopback address), credentials are in force whenever it listens beyond loopback
(sampled while `up` runs), `status` reports the real listeners, and the health loop's
reloads still reach nginx afterwards (a drained instance gets no requests)."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests
from conftest import cli, free_port_block, status, wait_for

INSTANCES = 2
TOKEN = "switch-test-token-0123456789abcdef"


def session() -> requests.Session:
    s = requests.Session()
    s.trust_env = False
    return s


def nginx_sockets(port: int) -> set[tuple[str, int]]:
    """The addresses nginx processes listen on for ``port``, from the OS socket table."""
    found = set()
    for proc in psutil.process_iter(["name"]):
        if "nginx" not in (proc.info["name"] or ""):
            continue
        try:
            conns = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        found |= {
            (c.laddr.ip, c.laddr.port)
            for c in conns
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
        }
    return found


@pytest.fixture(scope="module")
def cluster():
    root = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    tokens = root / "tokens"
    tokens.write_text(TOKEN + "\n")
    tokens.chmod(0o600)
    port, base = free_port_block(1), free_port_block(INSTANCES)
    args = [
        "--engine",
        "espeak",
        "--instances",
        str(INSTANCES),
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(root / "s"),
        "--probe-interval",
        "0.5",
    ]
    done = cli("up", *args, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    yield {
        "root": root,
        "state": root / "s",
        "port": port,
        "base": base,
        "args": args,
        "tokens": tokens,
        "url": f"http://127.0.0.1:{port}",
    }
    cli("down", "--state-dir", str(root / "s"), timeout=120)
    shutil.rmtree(root, ignore_errors=True)


def token_of(cluster, mode: str) -> str | None:
    if mode == "file":
        return TOKEN
    if mode == "generated":
        return (cluster["state"] / "api-token").read_text().splitlines()[-1]
    return None


class Sampler(threading.Thread):
    """While `up` runs: any moment nginx listens beyond loopback and a request without
    credentials is served (asked on 127.0.0.1, the listener checked before and after)."""

    def __init__(self, cluster):
        super().__init__(daemon=True)
        self.port, self.url = cluster["port"], cluster["url"]
        self.stop = threading.Event()
        self.open_wide: list[tuple[set, int]] = []
        self.samples = 0

    def run(self) -> None:
        with session() as http:
            while not self.stop.is_set():
                before = nginx_sockets(self.port)
                try:
                    code = http.get(self.url + "/v1/models", timeout=5).status_code
                except requests.RequestException:
                    code = 0
                after = nginx_sockets(self.port)
                wide = {a for a in before & after if a[0] not in ("127.0.0.1", "::1")}
                if wide and code == 200:
                    self.open_wide.append((wide, code))
                self.samples += 1
                time.sleep(0.02)


def switch(cluster, *extra: str):
    sampler = Sampler(cluster)
    sampler.start()
    try:
        done = cli("up", *cluster["args"], *extra, timeout=300)
    finally:
        sampler.stop.set()
        sampler.join(10)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sampler.samples > 5 and sampler.open_wide == []
    return done


def served_by(cluster, token: str | None, n: int = 8) -> list[str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    ports = []
    with session() as http:
        for i in range(n):
            answer = http.post(cluster["url"] + "/v1/tts", json={"text": f"Turn {i}."}, headers=headers, timeout=60)
            assert answer.status_code == 200, answer.text
            ports.append(answer.headers["X-Instance-Port"])
    return ports


def drained_gets_nothing(cluster, token: str | None) -> None:
    """The health loop's reload takes instance-1 out: nginx must have taken it."""
    state = str(cluster["state"])
    assert cli("drain", "instance-1", "--state-dir", state).returncode == 0
    try:
        assert wait_for(lambda: status(cluster["state"])[1]["instances"][1]["in_rotation"] is False, 20)
        time.sleep(1)  # (the reload's old workers finish the connections they had)
        assert set(served_by(cluster, token)) == {str(cluster["base"])}
    finally:
        assert cli("undrain", "instance-1", "--state-dir", state).returncode == 0
        assert wait_for(lambda: status(cluster["state"])[1]["instances"][1]["in_rotation"], 20)
    assert set(served_by(cluster, token)) == {str(cluster["base"]), str(cluster["base"] + 1)}


def check(cluster, public: bool, credentials: str) -> None:
    port = cluster["port"]
    host = "0.0.0.0" if public else "127.0.0.1"
    assert nginx_sockets(port) == {(host, port)}
    code, body = status(cluster["state"])
    assert code == 0, body["problems"]
    assert body["access"]["listen"] == f"{host}:{port}"
    assert body["access"]["public"] is public
    assert body["access"]["credentials"] is (credentials != "none")
    assert body["nginx"]["listening"] == [f"{host}:{port}"]
    token = token_of(cluster, credentials)
    with session() as http:
        bare = http.post(cluster["url"] + "/v1/tts", json={"text": "Hi."}, timeout=60)
    assert bare.status_code == (200 if token is None else 401)
    drained_gets_nothing(cluster, token)


# (in order: each switch starts from where the one before left the cluster)
STEPS = [
    ("loopback -> public, credentials turn on (generated)", ["--public"], True, "generated"),
    ("public -> loopback, credentials go", [], False, "none"),
    ("loopback -> public with a token file", ["--public", "--api-token-file", "TOKENS"], True, "file"),
    ("public -> loopback, the token file kept", ["--api-token-file", "TOKENS"], False, "file"),
    ("loopback with a token file -> public", ["--public", "--api-token-file", "TOKENS"], True, "file"),
    ("public with a token file -> loopback, credentials go", [], False, "none"),
]


def test_the_cluster_starts_on_loopback(cluster):
    check(cluster, public=False, credentials="none")


@pytest.mark.parametrize("what, extra, public, credentials", STEPS, ids=[s[0] for s in STEPS])
def test_switching_moves_the_sockets_and_the_rotation_still_reaches_nginx(cluster, what, extra, public, credentials):
    extra = [str(cluster["tokens"]) if arg == "TOKENS" else arg for arg in extra]
    done = switch(cluster, *extra)
    host = "0.0.0.0" if public else "127.0.0.1"
    # `up` says what changes before doing it; with reuseport a reload binds the new address
    # beside the old one, so the move takes no restart (and no refused connection)
    assert "nginx moves from" in done.stderr and f"to {host}:{cluster['port']}" in done.stderr
    assert "a reload cannot move its listener" not in done.stderr
    check(cluster, public=public, credentials=credentials)


def test_status_says_when_nginx_is_not_where_its_config_says(cluster):
    """A listener moved behind the launcher's back (the config on disk edited, nginx
    reloaded by hand): status reads the sockets and says so, never "ok"."""
    conf = cluster["state"] / "nginx" / "nginx.conf"
    text = conf.read_text()
    port = cluster["port"]
    other = free_port_block(1)
    conf.write_text(text.replace(f"listen 127.0.0.1:{port} reuseport;", f"listen 127.0.0.1:{other} reuseport;"))
    try:
        pid = json.loads(cli("status", "--json", "--state-dir", str(cluster["state"])).stdout)["nginx"]["pid"]
        psutil.Process(pid).send_signal(1)  # a reload: a new port can be bound beside the old
        assert wait_for(lambda: nginx_sockets(other) == {("127.0.0.1", other)}, 10)
        code, body = status(cluster["state"])
        assert code == 1
        assert any(f"not on 127.0.0.1:{port} as its config says" in p for p in body["problems"])
        # `up` with the same settings puts it back (and checks that it did)
        conf.write_text(text)
        assert cli("up", *cluster["args"], timeout=300).returncode == 0
        assert nginx_sockets(port) == {("127.0.0.1", port)} and nginx_sockets(other) == set()
        assert status(cluster["state"])[0] == 0
    finally:
        conf.write_text(text)


def test_a_failed_reload_is_a_problem_in_status_and_up_repairs_it(cluster):
    """A reload nginx refuses (as the health loop's would fail) leaves it on its old config:
    status says so, never "ok"; `up` with the same settings makes it take the config again."""
    conf = cluster["state"] / "nginx" / "nginx.conf"
    text = conf.read_text()
    try:
        conf.write_text(text + "\nnot_an_nginx_directive on;\n")
        pid = status(cluster["state"])[1]["nginx"]["pid"]
        psutil.Process(pid).send_signal(1)
        assert wait_for(
            lambda: any("older than the one on disk" in p for p in status(cluster["state"])[1]["problems"]), 30
        )
    finally:
        conf.write_text(text)
    done = cli("up", *cluster["args"], timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    code, body = status(cluster["state"])
    assert code == 0, body["problems"]
    drained_gets_nothing(cluster, None)
