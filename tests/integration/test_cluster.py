"""The whole launcher for real: supervisord, nginx, three espeak instances, the health loop.

One cluster serves the whole module (starting one costs seconds); the tests run in file
order and the last one takes it down and checks that nothing is left behind.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests
import soundfile
from conftest import Load, clean_env, cli, free_port_block, port_free, status, wait_for

INSTANCES = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import tempfile

    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port = free_port_block(1)
    base = free_port_block(INSTANCES)
    # Options through the environment on purpose: every option has its COSYVOICE_LB_* twin.
    env = clean_env(COSYVOICE_LB_PORT=str(port), COSYVOICE_LB_HOST="127.0.0.1")
    started = time.monotonic()
    done = cli(
        "up",
        "--engine",
        "espeak",
        "--instances",
        str(INSTANCES),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        env=env,
        timeout=300,
    )
    info = {
        "state_dir": state_dir,
        "port": port,
        "base": base,
        "url": f"http://127.0.0.1:{port}",
        "up": done,
        "up_seconds": time.monotonic() - started,
        "env": env,
    }
    yield info
    cli("down", "--state-dir", str(state_dir), timeout=120)  # whatever happened above
    import shutil

    shutil.rmtree(state_dir, ignore_errors=True)


def test_up_exits_zero_once_all_ready_and_prints_the_url(cluster):
    done = cluster["up"]
    assert done.returncode == 0, done.stderr + done.stdout
    assert cluster["url"] in done.stdout
    assert f"{INSTANCES} instance(s) ready" in done.stdout
    print(f"up -> all ready: {cluster['up_seconds']:.1f}s for {INSTANCES} instances")


def test_status_reports_every_part(cluster):
    code, body = status(cluster["state_dir"])
    assert code == 0, body
    assert [i["name"] for i in body["instances"]] == [f"instance-{i}" for i in range(INSTANCES)]
    assert body["nginx"]["state"] == "RUNNING" and body["nginx"]["port"] == cluster["port"]
    assert body["health"]["state"] == "RUNNING" and body["admin"]["state"] == "RUNNING"
    for i, inst in enumerate(body["instances"]):
        assert inst["port"] == cluster["base"] + i
        assert inst["ready"] and inst["in_rotation"] and inst["state"] == "RUNNING"
        assert inst["restarts"] == 0
        # pid is the serving process itself: it listens on the instance's port.
        proc = psutil.Process(inst["pid"])
        assert "app.py" in " ".join(proc.cmdline())
        listening = {c.laddr.port for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        assert inst["port"] in listening
        assert {c.laddr.ip for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN} == {"127.0.0.1"}
        assert proc.environ().get("CUDA_VISIBLE_DEVICES") == ""


def test_human_status_prints_a_table(cluster):
    done = cli("status", "--state-dir", str(cluster["state_dir"]))
    assert done.returncode == 0
    assert "instance-0" in done.stdout and "nginx" in done.stdout and "ok" in done.stdout
    assert f"access: nginx on 127.0.0.1:{cluster['port']} (this box only); credentials not required" in done.stdout


def test_ping_through_nginx(cluster):
    r = requests.get(cluster["url"] + "/ping", timeout=5)
    assert r.status_code == 200
    body = r.json()
    assert body["ready"] is True and body["engine"] == "espeak"
    assert {"inflight", "pid"} <= set(body)


def wav(response) -> tuple[np.ndarray, int]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "audio/wav"
    return soundfile.read(io.BytesIO(response.content), dtype="float32")


def test_tts_through_nginx_is_speech_that_grows_with_the_text(cluster):
    short, rate = wav(requests.post(cluster["url"] + "/v1/tts", json={"text": "Hello."}, timeout=30))
    long, _ = wav(
        requests.post(
            cluster["url"] + "/v1/tts",
            json={"text": "Hello. This sentence is a good deal longer than the first one, so it takes longer to say."},
            timeout=30,
        )
    )
    chinese, _ = wav(requests.post(cluster["url"] + "/v1/tts", json={"text": "你好，世界。今天天气很好。"}, timeout=30))
    assert rate == 22050
    assert len(long) > 3 * len(short)
    for audio in (short, long, chinese):
        assert np.sqrt(np.mean(audio**2)) > 0.01  # not silence
    slow, _ = wav(requests.post(cluster["url"] + "/v1/tts", json={"text": "Hello there.", "speed": 0.5}, timeout=30))
    fast, _ = wav(requests.post(cluster["url"] + "/v1/tts", json={"text": "Hello there.", "speed": 2.0}, timeout=30))
    assert len(slow) > 1.5 * len(fast)


def test_api_is_spread_over_all_instances(cluster):
    seen = set()
    for _ in range(4 * INSTANCES):
        r = requests.post(cluster["url"] + "/v1/tts", json={"text": "spread"}, timeout=30)
        assert r.status_code == 200
        seen.add(r.headers["X-Instance-Port"])
    assert seen == {str(cluster["base"] + i) for i in range(INSTANCES)}


@pytest.mark.parametrize(
    "body, content_type, status, words",
    [
        (b"", "application/json", 400, "no body"),
        (b"not json", "application/json", 400, "not valid JSON"),
        (b'{"text": "   "}', "application/json", 400, "empty"),
        (b'{"text": 12}', "application/json", 400, "must be a string"),
        (b'{"text": "hi", "speed": "fast"}', "application/json", 400, "speed"),
        (b'{"text": "hi", "speed": 7}', "application/json", 400, "between"),
        (b'{"speed": 1.0}', "application/json", 400, "missing"),
        (b'["text"]', "application/json", 400, "JSON object"),
        (json.dumps({"text": "x" * 20_001}).encode(), "application/json", 413, "limit of 20000"),
        (json.dumps({"text": "x" * 100_000}).encode(), "application/json", 413, "limit of 20000"),
    ],
)
def test_bad_input_gets_a_clear_4xx_and_the_instances_stay_up(cluster, body, content_type, status, words):
    r = requests.post(cluster["url"] + "/v1/tts", data=body, headers={"Content-Type": content_type}, timeout=30)
    assert r.status_code == status
    assert words in r.json()["error"]["message"]
    assert requests.get(cluster["url"] + "/ping", timeout=5).status_code == 200


def test_wrong_methods_paths_and_huge_bodies_get_json_errors_through_nginx(cluster):
    url = cluster["url"]
    get = requests.get(url + "/v1/tts", timeout=10)
    assert get.status_code == 405 and "POST" in get.json()["error"]["message"]
    unknown = requests.post(url + "/v1/speak", json={"text": "hi"}, timeout=10)
    assert unknown.status_code == 404 and "/v1/tts" in unknown.json()["error"]["message"]
    assert requests.head(url + "/ping", timeout=10).status_code == 200
    huge = requests.post(
        url + "/v1/tts", data=b"x" * (21 * 2**20), headers={"Content-Type": "application/json"}, timeout=60
    )
    assert huge.status_code == 413 and "larger than" in huge.json()["error"]["message"]
    # a 70 KB header: nginx's own refusal, as JSON too (it was nginx's HTML page)
    big = requests.post(url + "/v1/tts", json={"text": "hi"}, headers={"X-Padding": "x" * 70_000}, timeout=10)
    assert big.status_code == 431 and "headers" in big.json()["error"]["message"]
    assert requests.get(url + "/ping", timeout=5).status_code == 200


def test_render_refuses_to_touch_a_running_cluster(cluster):
    before = (cluster["state_dir"] / "run/cluster.json").read_text()
    done = cli("render", "--instances", "1", "--state-dir", str(cluster["state_dir"]))
    assert done.returncode != 0 and "a cluster runs in" in done.stderr
    assert (cluster["state_dir"] / "run/cluster.json").read_text() == before


def test_gradio_client_works_through_nginx_with_several_instances(cluster):
    from gradio_client import Client

    for _ in range(3):  # each client gets its own route cookie, so calls land on different instances
        client = Client(cluster["url"] + "/", verbose=False)
        for stream in (False, True, False):  # a WAV file either way (with ffmpeg, the page's stream is HLS)
            path = client.predict("Hello from the browser side.", 1.0, -1, stream, api_name="/generate")
            audio, rate = soundfile.read(path, dtype="float32")
            assert path.endswith(".wav") and rate == 22050 and len(audio) > rate // 2


def test_ui_has_a_primary_generate_button(cluster):
    page = requests.get(cluster["url"] + "/", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "cvlb_route=" in page.headers.get("set-cookie", "")
    config = requests.get(cluster["url"] + "/config", cookies=page.cookies, timeout=10).json()
    buttons = [c["props"] for c in config["components"] if c.get("type") == "button"]
    assert any(b.get("value") == "Generate" and b.get("variant") == "primary" for b in buttons)


def test_up_again_is_safe(cluster):
    before = {i["name"]: i["pid"] for i in status(cluster["state_dir"])[1]["instances"]}
    done = cli(
        "up",
        "--engine",
        "espeak",
        "--instances",
        str(INSTANCES),
        "--base-port",
        str(cluster["base"]),
        "--state-dir",
        str(cluster["state_dir"]),
        env=cluster["env"],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    after = {i["name"]: i["pid"] for i in status(cluster["state_dir"])[1]["instances"]}
    assert after == before  # nothing restarted


def test_up_again_with_new_settings_applies_them_without_restarting_instances(cluster):
    state_dir = cluster["state_dir"]
    _, before = status(state_dir)
    done = cli(
        "up",
        "--engine",
        "espeak",
        "--instances",
        str(INSTANCES),
        "--base-port",
        str(cluster["base"]),
        "--state-dir",
        str(state_dir),
        "--hang-timeout",
        "100",
        "--retries",
        "5",
        env=cluster["env"],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    _, after = status(state_dir)
    assert [i["pid"] for i in after["instances"]] == [i["pid"] for i in before["instances"]]
    assert after["health"]["pid"] != before["health"]["pid"]  # re-read the new settings
    assert json.loads((state_dir / "run/cluster.json").read_text())["settings"]["hang_timeout"] == 100
    assert "proxy_next_upstream_tries 5;" in (state_dir / "nginx/nginx.conf").read_text()
    assert requests.post(cluster["url"] + "/v1/tts", json={"text": "still here"}, timeout=30).status_code == 200


def instance(state_dir: Path, name: str) -> dict:
    return next(i for i in status(state_dir)[1]["instances"] if i["name"] == name)


def test_sigstopped_instance_is_replaced_while_the_others_serve(cluster):
    state_dir = cluster["state_dir"]
    victim = instance(state_dir, "instance-1")
    with Load(cluster["url"], threads=3, limit=3000, seconds=60) as load:
        time.sleep(1)
        os.kill(victim["pid"], signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            out = wait_for(lambda: not instance(state_dir, "instance-1")["in_rotation"], timeout=20, interval=0.3)
            out_after = time.monotonic() - stopped
            assert out, "the stopped instance stayed in rotation"

            def replaced():
                now = instance(state_dir, "instance-1")
                return now["pid"] != victim["pid"] and now["ready"] and now["in_rotation"]

            assert wait_for(replaced, timeout=40, interval=0.3), "the instance did not come back"
            back_after = time.monotonic() - stopped
        finally:
            try:
                os.kill(victim["pid"], signal.SIGCONT)
            except ProcessLookupError:
                pass
        time.sleep(2)  # some load on the replacement too
    print(
        f"SIGSTOP: out of rotation after {out_after:.1f}s, back serving after {back_after:.1f}s; "
        f"{load.ok} requests ok, {len(load.failures)} failed, per port {load.ports}"
    )
    assert load.failures == []
    assert load.ok > 20
    assert len(load.ports) == INSTANCES  # everyone served, the replacement included
    assert instance(state_dir, "instance-1")["restarts"] == 1
    assert not psutil.pid_exists(victim["pid"]) or psutil.Process(victim["pid"]).status() == psutil.STATUS_ZOMBIE


def test_crashed_instance_respawns_and_counts_a_restart(cluster):
    state_dir = cluster["state_dir"]
    victim = instance(state_dir, "instance-2")
    os.kill(victim["pid"], signal.SIGKILL)

    def back():
        now = instance(state_dir, "instance-2")
        return now["pid"] != victim["pid"] and now["ready"] and now["in_rotation"] and now

    now = wait_for(back, timeout=40)
    assert now, "the crashed instance did not come back"
    assert now["restarts"] == victim["restarts"] + 1


def test_restart_command_restarts_one_instance(cluster):
    state_dir = cluster["state_dir"]
    before = instance(state_dir, "instance-0")
    done = cli("restart", "instance-0", "--state-dir", str(state_dir))
    assert done.returncode == 0, done.stderr
    assert wait_for(
        lambda: (lambda i: i["pid"] != before["pid"] and i["ready"] and i["in_rotation"])(
            instance(state_dir, "instance-0")
        ),
        timeout=40,
    )
    assert instance(state_dir, "instance-0")["restarts"] == before["restarts"] + 1
    # it drained and left on its own (uvicorn raises the stop signal again after shutting
    # down: caught, so the instance's last steps ran and it exited 0, not by the signal)
    said = (state_dir / "logs" / "supervisord.log").read_text()
    assert "exited: instance-0 (exit status 0; expected)" in said, said[-3000:]
    assert "instance-0 (terminated by SIGTERM" not in said
    bad = cli("restart", "instance-9", "--state-dir", str(state_dir))
    assert bad.returncode != 0 and "no program named instance-9" in bad.stderr


def test_restart_all_is_rolling_and_loses_no_request(cluster):
    state_dir = cluster["state_dir"]
    before = {i["name"]: i for i in status(state_dir)[1]["instances"]}
    with Load(cluster["url"], threads=3, limit=3000, seconds=90) as load:
        done = cli("restart", "--all", "--rolling", "--state-dir", str(state_dir), timeout=180)
    assert done.returncode == 0, done.stderr
    code, after = status(state_dir)
    assert code == 0
    for inst in after["instances"]:
        assert inst["pid"] != before[inst["name"]]["pid"]
        assert inst["restarts"] == before[inst["name"]]["restarts"] + 1
    print(f"restart --all under load: {load.ok} ok, {len(load.failures)} failed")
    assert load.failures == [] and load.ok > 20
    # Each left nginx's rotation first, so it had nothing left to drain when it was stopped.
    for name in before:
        log = (state_dir / "logs" / f"{name}.log").read_text()
        assert "stopping: draining 0 synthesis(es) in flight" in log and "drain timeout" not in log
    assert (state_dir / "logs/health.log").read_text().count("restart requested: out of rotation") >= INSTANCES


def test_a_killed_nginx_comes_back_and_serves(cluster):
    state_dir = cluster["state_dir"]
    _, before = status(state_dir)
    os.kill(before["nginx"]["pid"], signal.SIGKILL)  # its workers live on, holding the port

    def serving_again():
        code, now = status(state_dir)
        return code == 0 and now["nginx"]["pid"] != before["nginx"]["pid"]

    assert wait_for(serving_again, timeout=40), status(state_dir)[1]["problems"]
    r = requests.post(cluster["url"] + "/v1/tts", json={"text": "back"}, timeout=30)
    assert r.status_code == 200


def test_status_notices_a_hung_health_loop(cluster):
    state_dir = cluster["state_dir"]
    pid = status(state_dir)[1]["health"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:

        def flagged():
            code, body = status(state_dir)
            return code == 1 and any("health loop has not reported" in p for p in body["problems"])

        assert wait_for(flagged, timeout=30)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert wait_for(lambda: status(state_dir)[0] == 0, timeout=20)


def test_logs_command_prints_an_instance_log(cluster):
    done = cli("logs", "instance-0", "--lines", "100000", "--state-dir", str(cluster["state_dir"]))
    assert done.returncode == 0 and "ready: engine espeak loaded" in done.stdout
    last = cli("logs", "instance-0", "-n", "3", "--state-dir", str(cluster["state_dir"])).stdout.splitlines()
    assert len(last) == 3 and last == done.stdout.splitlines()[-3:]
    health = cli("logs", "health", "--state-dir", str(cluster["state_dir"]))
    assert "out of rotation and restarting" in health.stdout
    missing = cli("logs", "nope", "--state-dir", str(cluster["state_dir"]))
    assert missing.returncode != 0 and "no log named 'nope'" in missing.stderr


def test_no_ready_instance_means_503_and_status_1(cluster):
    from cosyvoice_lb.launcher.render.cluster import Layout
    from cosyvoice_lb.launcher.state.supervision import Supervisor

    supervisor = Supervisor(Layout(cluster["state_dir"]))
    names = [f"instance-{i}" for i in range(INSTANCES)]
    try:
        for name in names:
            supervisor.stop(name)

        def none_ready():  # a list, since a 503 Response is falsy
            r = requests.get(cluster["url"] + "/ping", timeout=5)
            return [r] if r.status_code == 503 else []

        answered = wait_for(none_ready, timeout=20)
        assert answered, "nginx still answers /ping with 200 with every instance stopped"
        r = answered[0]
        assert r.json()["ready"] is False and "no instance is ready" in r.json()["error"]["message"]
        api = requests.post(cluster["url"] + "/v1/tts", json={"text": "anyone?"}, timeout=30)
        assert api.status_code == 503 and "error" in api.json()
        code, body = status(cluster["state_dir"])
        assert code == 1 and body["problems"]
    finally:
        for name in names:
            supervisor.start(name)
    assert wait_for(lambda: status(cluster["state_dir"])[0] == 0, timeout=60)


def test_down_stops_everything_and_frees_every_port(cluster):
    state_dir = cluster["state_dir"]
    from cosyvoice_lb.launcher.render.cluster import Layout
    from cosyvoice_lb.launcher.state.supervision import Supervisor

    root = Supervisor(Layout(state_dir)).pid()
    tree = [root] + [p.pid for p in psutil.Process(root).children(recursive=True)]
    assert len(tree) >= INSTANCES + 4  # supervisord, instances, health, admin, nginx (+ workers)
    done = cli("down", "--state-dir", str(state_dir), timeout=120)
    assert done.returncode == 0, done.stderr
    assert not (state_dir / "run/supervisor.sock").exists() and not (state_dir / "run/admin.sock").exists()
    alive = [pid for pid in tree if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    assert port_free(cluster["port"])
    assert all(port_free(cluster["base"] + i) for i in range(INSTANCES))
    code, body = status(state_dir)
    assert code == 3 and body["running"] is False
    again = cli("down", "--state-dir", str(state_dir))
    assert again.returncode == 0 and "not running" in again.stdout
