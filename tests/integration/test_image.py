"""The image, built for real and run as a pod would run it: the embedded engine's image from
the Dockerfile on a Debian base made here, started with the command, environment, token files
and volumes `k8s render` gives its pod; served, logged to the container's output, drained on
`docker stop`. (The image with upstream's code: test_image_cosyvoice3.py.)"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml
from conftest import cli, free_port_block, wait_for
from docker_support import CA_MARKER, build, docker, image_size, require_engine

pytestmark = [pytest.mark.integration, pytest.mark.docker]

TAG = "cosyvoice-lb-test:embedded"
POD = "cosyvoice-lb-7c9f8d-x2k4q"
USER = 10001  # the image's user (Dockerfile)


@pytest.fixture(scope="module")
def image():
    require_engine()
    started = time.monotonic()
    build(TAG, {}, {})
    print(f"\nbuilt {TAG} in {time.monotonic() - started:.0f} s, {image_size(TAG) / 2**20:.0f} MiB")
    return TAG


def test_the_ca_bundle_stays_in_the_build_stage(image):
    """pip in the build stage trusted the bundle; no file of the image holds it."""
    container = docker("create", image).stdout.decode().strip()
    seen, found, last = 0, False, b""
    try:
        with subprocess.Popen(["docker", "export", container], stdout=subprocess.PIPE) as export:
            assert export.stdout is not None
            for chunk in iter(lambda: export.stdout.read(2**20), b""):
                found = found or CA_MARKER in last[-len(CA_MARKER) :] + chunk
                seen, last = seen + len(chunk), chunk
        assert export.returncode == 0
    finally:
        docker("rm", container)
    assert seen > 50 * 2**20  # the image's whole file system came out
    assert not found


def pod_of(tmp: Path) -> tuple[list[str], dict[str, str], list[tuple[str, str, bool]], int, dict[str, str]]:
    """What `k8s render` gives the pod: its command, its environment, its mounts, its grace
    period, and the Secret's files."""
    out = tmp / "k8s"
    done = cli("k8s", "render", "--out", str(out), "--image", TAG, "--instances", "2", "--engine", "espeak")
    assert done.returncode == 0, done.stderr
    deployment = yaml.safe_load((out / "deployment.yaml").read_text())
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {}
    for item in container["env"]:
        if "valueFrom" in item:
            assert item["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            env[item["name"]] = POD
        else:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], item["value"])
    mounts = [(m["name"], m["mountPath"], m.get("readOnly", False)) for m in container["volumeMounts"]]
    secret = yaml.safe_load((out / "secret.yaml").read_text())
    files = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    return container["command"], env, mounts, spec["terminationGracePeriodSeconds"], files


@pytest.fixture(scope="module")
def pod(image):
    tmp = Path(tempfile.mkdtemp(prefix="cvlb-pod-", dir="/tmp"))
    command, env, mounts, grace, secret = pod_of(tmp)
    volumes = {}
    for name, path, _ in mounts:
        volumes[name] = tmp / name
        volumes[name].mkdir()
        os.chown(volumes[name], USER, USER)
    for key, text in secret.items():  # as the Secret is mounted: group-readable by the pod's fsGroup
        (volumes["tokens"] / key).write_text(text)
        os.chown(volumes["tokens"] / key, 0, USER)
        os.chmod(volumes["tokens"] / key, 0o440)
    port = free_port_block(5)  # nginx, then the instances and room for parked ones
    base = port + 1
    # On the host's network: nginx on loopback (not --public's every address) and free ports,
    # for this test; the token files keep credentials on.
    env.update(
        COSYVOICE_LB_PUBLIC="0",
        COSYVOICE_LB_HOST="127.0.0.1",
        COSYVOICE_LB_PORT=str(port),
        COSYVOICE_LB_BASE_PORT=str(base),
    )
    name = f"cvlb-pod-{os.getpid()}"
    run = ["run", "-d", "--name", name, "--network", "host"]
    for key, value in env.items():
        run += ["-e", f"{key}={value}"]
    for volume, path, read_only in mounts:
        run += ["-v", f"{volumes[volume]}:{path}{':ro' if read_only else ''}"]
    started = time.monotonic()
    docker(*run, image, *command)
    url = f"http://127.0.0.1:{port}"
    session = requests.Session()
    session.trust_env = False

    def ready() -> bool:  # every instance up: the launcher stays in the foreground
        try:
            serving = session.get(url + "/ping", timeout=5).status_code == 200
        except requests.RequestException:
            return False
        return serving and "running in the foreground" in logs(name)

    try:
        if not wait_for(ready, timeout=240):
            raise AssertionError(f"the pod never answered /ping 200:\n{logs(name)[-3000:]}")
        print(f"\nthe pod served /ping 200 {time.monotonic() - started:.1f} s after docker run")
        token = secret["api-tokens"].split()[0]
        yield {"name": name, "url": url, "session": session, "token": token, "grace": grace, "volumes": volumes}
    finally:
        docker("rm", "-f", name, check=False)
        session.close()
        shutil.rmtree(tmp, ignore_errors=True)


def logs(name: str) -> str:
    done = docker("logs", name)
    return done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")


def test_the_pod_synthesizes_and_its_lines_reach_the_container_log(pod):
    session, url = pod["session"], pod["url"]
    refused = session.post(url + "/v1/tts", json={"text": "Hello"}, timeout=60)
    assert refused.status_code == 401  # a pod's listener is public: credentials are on
    auth = {"Authorization": f"Bearer {pod['token']}"}
    answer = session.post(url + "/v1/tts", json={"text": "Hello from a pod."}, headers=auth, timeout=60)
    assert answer.status_code == 200 and answer.content[:4] == b"RIFF", answer.text[:300]
    rid = answer.headers["X-Request-Id"]
    pattern = re.compile(rf"^\[{POD}\] (instance-\d) \| .*request api /v1/tts 200 .*rid={rid}", re.M)
    assert wait_for(lambda: pattern.search(logs(pod["name"])), timeout=10), logs(pod["name"])[-3000:]
    text = logs(pod["name"])
    assert re.search(rf"^\[{POD}\] nginx-access \| .*\"POST /v1/tts .* 200 .*rid={rid}", text, re.M)
    assert re.search(rf"^\[{POD}\] health \| ", text, re.M) and re.search(rf"^\[{POD}\] supervisord \| ", text, re.M)
    assert pod["token"] not in text  # a secret never lands in the log


def test_docker_stop_drains_the_requests_in_flight_and_exits_0(pod):
    session, url, name = pod["session"], pod["url"], pod["name"]
    auth = {"Authorization": f"Bearer {pod['token']}"}
    # A long text, streamed: its segments come one after another, so it is surely in flight
    # when the stop comes (its first bytes are here), and the drain must finish it.
    long_text = "A sentence the engine speaks, one of many in a long text. " * 50
    answers: list[tuple[int, bytes, float]] = []
    first = threading.Event()

    def send() -> None:
        with session.post(
            url + "/v1/tts", json={"text": long_text, "stream": True}, headers=auth, timeout=120, stream=True
        ) as answer:
            body = b""
            for chunk in answer.iter_content(4096):
                body += chunk
                first.set()
            answers.append((answer.status_code, body, time.monotonic()))
        first.set()

    sender = threading.Thread(target=send)
    sender.start()
    assert first.wait(60)
    stopped = time.monotonic()
    docker("stop", "-t", str(pod["grace"]), name, timeout=pod["grace"] + 60)
    took = time.monotonic() - stopped
    sender.join(timeout=120)
    assert answers, "the request in flight got no answer"
    code, body, answered = answers[0]
    assert code == 200 and body[:4] == b"RIFF" and len(body) > 24000 * 2 * 10  # all of it: minutes of audio
    assert answered > stopped  # it was in flight when the stop came, and was finished
    state = docker("inspect", "--format", "{{.State.ExitCode}} {{.State.OOMKilled}}", name).stdout.decode().split()
    assert state == ["0", "false"], logs(name)[-3000:]
    assert took < pod["grace"]  # docker would have SIGKILLed it at the grace period (exit 137)
    text = logs(name)
    assert "SIGTERM: draining and stopping the cluster" in text and "drained and stopped" in text
    print(f"\ndocker stop took {took:.1f} s (grace period {pod['grace']} s)")
