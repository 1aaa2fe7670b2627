"""Shared helpers: the real CLI as a subprocess, free loopback ports, short state dirs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path

import bcrypt
import pytest
import requests
import yaml
from upstream_support import upstream, upstream_bistream, upstream_vllm  # noqa: F401 - the session fixtures

from cosyvoice_lb.launcher.cluster import ports
from cosyvoice_lb.launcher.cluster.ports import port_free  # noqa: F401 - the tests' port check

TESTS = Path(__file__).resolve().parent  # (the test files sit in folders below, by what they test)
ROOT = TESTS.parent


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any COSYVOICE_LB_* the caller may have set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE_LB_")}
    env.update(extra)
    return env


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180, check: bool = False
) -> subprocess.CompletedProcess:
    """Run ``cosyvoice-lb ARGS`` for real and capture what it prints."""
    done = subprocess.run(
        [sys.executable, "-m", "cosyvoice_lb.launcher.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else clean_env(),
        cwd=str(ROOT),
    )
    if check and done.returncode != 0:
        raise AssertionError(f"cosyvoice-lb {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def cli_here(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cosyvoice-lb ARGS`` in this process through click's runner: the same command, parsing
    and output as :func:`cli`, without a Python start per call (the quick loop runs dozens).
    ``env`` is a whole environment, as for :func:`cli`."""
    import contextlib

    from click.testing import CliRunner

    from cosyvoice_lb.launcher.cli import main

    target = env if env is not None else clean_env()
    overrides: dict[str, str | None] = {name: None for name in os.environ if name not in target}
    overrides.update({name: value for name, value in target.items() if os.environ.get(name) != value})
    with contextlib.chdir(ROOT):
        result = CliRunner().invoke(main, list(args), env=overrides, prog_name="cosyvoice-lb")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, result.stderr)


@pytest.fixture(scope="module")
def web():
    """A requests session for loopback: no proxy from the environment."""
    session = requests.Session()
    session.trust_env = False
    yield session
    session.close()


@pytest.fixture
def state_dir():
    # Short on purpose: the supervisord socket path must stay under 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextmanager
def http_server(handler: type) -> Iterator[int]:
    """A small threaded HTTP server on 127.0.0.1 answering with ``handler``; its port."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@contextmanager
def uvicorn_serving(app, uds: str | None = None) -> Iterator[str]:
    """An ASGI app on a real uvicorn on 127.0.0.1 (a client can go away for real), or on the
    unix socket ``uds``; its URL (or the socket's path)."""
    import uvicorn

    if uds is not None:
        config, where = uvicorn.Config(app, uds=uds, log_level="warning"), uds
    else:
        port = free_port_block(1)
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        where = f"http://127.0.0.1:{port}"
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start in 30 s"
    try:
        yield where
    finally:
        server.should_exit = True
        thread.join(10)


FAKE_COSYVOICE = TESTS / "fake_cosyvoice"
FAKE_V3 = TESTS / "fake_models" / "Fun-CosyVoice3-0.5B"
# `up`'s engine options for the CosyVoice3 contract fake (it yields torch tensors)
FAKE_COSYVOICE3 = ("--engine", "cosyvoice3", "--model-dir", str(FAKE_V3), "--cosyvoice-root", str(FAKE_COSYVOICE))


@contextmanager
def simulated_cluster(
    *args: str,
    instances: int = 2,
    env: dict[str, str] | None = None,
    engine: tuple[str, ...] = ("--engine", "simulated"),
    timeout: float = 240,
) -> Iterator[dict]:
    """A real cluster of ``instances`` instances of ``engine`` (the simulated one unless
    said: :data:`FAKE_COSYVOICE3`), `up` with ``args`` added, on free ports, in a fresh
    state dir under /tmp; always taken down and removed after."""
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))
    port, base = free_port_block(1), free_port_block(instances)
    command = ["up", *engine, "--instances", str(instances), "--port", str(port)]
    command += ["--base-port", str(base), "--state-dir", str(state_dir), *args]
    try:
        done = cli(*command, env=env, timeout=timeout)
        assert done.returncode == 0, done.stdout + done.stderr
        yield {"state_dir": state_dir, "url": f"http://127.0.0.1:{port}", "port": port, "base": base}
    finally:
        cli("down", "--state-dir", str(state_dir), timeout=120)
        shutil.rmtree(state_dir, ignore_errors=True)


def unexpected_tracebacks(log: str) -> list[str]:
    """The tracebacks in an instance log, less those of gr.Error: Gradio logs the error
    the UI shows the user (a refused input) with its traceback too."""
    found = []
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            last = next((rest for rest in lines[i + 1 :] if rest and not rest[0].isspace()), "")
            if not last.startswith("gradio.exceptions.Error"):
                found.append("\n".join(lines[max(i - 2, 0) : i + 60]))
    return found


# --- a running cluster ------------------------------------------------------------------


def instance_samples(cluster: dict, index: int) -> dict[tuple[str, tuple], float]:
    """An instance's /metrics as {(sample name, sorted labels): value}; ``cluster`` has the
    requests session ("http") and the first instance's port ("base")."""
    from prometheus_client.parser import text_string_to_metric_families

    text = cluster["http"].get(f"http://127.0.0.1:{cluster['base'] + index}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def status(state_dir: Path) -> tuple[int, dict]:
    done = cli("status", "--state-dir", str(state_dir), "--json")
    return done.returncode, json.loads(done.stdout)


def vanish(ws) -> None:
    """A WebSocket client (``websockets.sync``) that goes as a crashed process goes: no close
    frame, its socket shut. What had arrived is drained, so the library's reader thread, which
    waits for each message to be taken, ends too (else the test process cannot exit)."""
    import socket

    ws.socket.shutdown(socket.SHUT_RDWR)
    ws.socket.close()
    try:
        while True:
            ws.recv(timeout=5)
    except Exception:  # noqa: BLE001 - ConnectionClosed once drained (or a timeout: nothing came)
        pass


def wait_for(predicate, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


class Load:
    """Bounded API load through nginx: a few threads, at most ``limit`` requests or ``seconds``.
    ``send(url)``: one request (default: ``text`` to /v1/tts as JSON); ``judge(response)``: what
    is wrong with an answer's audio ("" when nothing), each such answer listed in ``bad``."""

    def __init__(
        self,
        url: str,
        threads: int = 3,
        limit: int = 2000,
        seconds: float = 60,
        text: str = "keep talking please",
        send: Callable[[str], requests.Response] | None = None,
        judge: Callable[[requests.Response], str] | None = None,
    ):
        self.url, self.limit, self.deadline, self.text = url, limit, time.monotonic() + seconds, text
        self.send = send or (lambda url: requests.post(url + "/v1/tts", json={"text": text}, timeout=60))
        self.judge = judge or (lambda response: "")
        self.ok, self.failures, self.ports, self.bad = 0, [], {}, []
        self.lock, self.stop_event = threading.Lock(), threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(threads)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=90)

    def run(self) -> None:
        while not self.stop_event.is_set() and time.monotonic() < self.deadline:
            with self.lock:
                if self.ok + len(self.failures) + len(self.bad) >= self.limit:
                    return
            try:
                r = self.send(self.url)
                outcome = r.status_code == 200 and r.headers["content-type"] == "audio/wav"
                detail = f"{r.status_code} {r.text[:120]}"
            except requests.RequestException as exc:
                outcome, detail = False, repr(exc)
            fault = self.judge(r) if outcome else ""
            with self.lock:
                if fault:
                    self.bad.append(fault)
                elif outcome:
                    self.ok += 1
                    port = r.headers.get("X-Instance-Port")
                    self.ports[port] = self.ports.get(port, 0) + 1
                else:
                    self.failures.append(detail)


# What each of the slowest integration files took (seconds, setup included, summed from
# `--durations=0` of a whole run on 2 cores and 2 workers, 2026-12-07), to start the longest
# first: the files are dealt out to the workers in this order, so no long file starts last
# while the other worker idles. A file not listed counts as UNLISTED (integration) or 0 (the
# quick ones, which fill the gaps at the end). Rough figures do: only the order matters.
FILE_SECONDS = {
    "test_capacity.py": 191,
    "test_vllm_cluster.py": 152,
    "test_listen_switch.py": 148,
    "test_canary_rollout.py": 144,
    "test_upstream_concurrency.py": 139,
    "test_jobs_cluster.py": 136,
    "test_cluster.py": 123,
    "test_up_errors.py": 118,
    "test_upstream_env.py": 93,
    "test_zero_loss.py": 92,
    "test_work_routing.py": 87,
    "test_gpu_bench_smoke.py": 79,
    "test_saved_voices.py": 75,
    "test_upstream_cluster.py": 75,
    "test_speech_cluster.py": 71,
    "test_jobs_faults.py": 68,
    "test_poison.py": 67,
    "test_browser.py": 66,
    "test_observability.py": 65,
    "test_whole_answers.py": 64,
    "test_code_rollout.py": 56,
    "test_alert_delivery.py": 56,
    "test_cosyvoice_cluster.py": 46,
    "test_bench_chaos.py": 44,
    "test_image.py": 44,
    "test_hostile_input.py": 40,
    "test_long_text_memory.py": 40,
    "test_speech_stream_cluster.py": 40,
    "test_foreground.py": 39,
    "test_service_boot.py": 39,
    "test_bad_audio.py": 34,
    "test_recycling.py": 33,
    "test_upstream_stream.py": 31,
    "test_jobs_yield.py": 30,
    "test_access.py": 28,
    "test_upload_privacy.py": 27,
    "test_fuzz.py": 26,
    "test_jobs_rate_limit.py": 22,
    "test_openai.py": 22,
    "test_upstream_contract.py": 21,
}
UNLISTED = 15


def expected_seconds(path: Path) -> int:
    if "integration" not in path.parts:
        return 0
    return FILE_SECONDS.get(path.name, UNLISTED)


def pytest_collection_modifyitems(config, items):
    """Everything under tests/integration/ starts real processes: marked, so that
    ``-m "not integration"`` is the quick loop. The files then run longest first (a stable
    sort: each file's own tests keep their order)."""
    for item in items:
        if "integration" in Path(str(item.fspath)).parts:
            item.add_marker(pytest.mark.integration)
    items.sort(key=lambda item: -expected_seconds(Path(str(item.fspath))))


QUICK_LOOP = "not integration"


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """A run of the whole suite, or of the quick loop (``-m "not integration"``), spreads over
    the cores: pytest-xdist's workers, a test file each at a time (its module fixtures built
    once), unless ``-n`` says otherwise (``-n 0``: one process). The quick loop takes up to 4
    workers; a run with the integration tests 2, as their clusters share the box with the
    other worker's (each picks its ports from its own stripes: :func:`free_port_block`).
    A run of named files stays in one process."""
    option = config.option
    if not config.pluginmanager.hasplugin("xdist"):
        return
    if getattr(option, "numprocesses", None) is not None or option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    quick = config.getoption("markexpr", "") == QUICK_LOOP
    if not quick and config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores > 1:
        option.numprocesses, option.dist = min(cores, 4 if quick else 2), "loadfile"


STRIPE = 500  # ports: each xdist worker picks its blocks from every n-th stripe of these


def free_port_block(count: int) -> int:
    """The first of ``count`` free loopback ports for a cluster of the tests (outside the
    ephemeral range: see ``cluster/ports.py``). Under xdist, worker k of n picks only where
    ``port // STRIPE % n == k``, so two workers never pick the same block between the check
    and their cluster's start."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or workers < 2:
        return ports.free_port_block(count)
    mine = int(worker[2:]) % workers

    def free(port: int) -> bool:
        return port // STRIPE % workers == mine and ports.port_free(port)

    return ports.free_port_block(count, free=free, tries=2000)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave the session's objects to the exiting process: the interpreter's last collections
    walk every Gradio app the tests built (seconds per run), and nothing is left to free."""
    import gc

    gc.freeze()


@contextmanager
def real_prometheus(config: Path, data: Path) -> Iterator[str]:
    """Debian's Prometheus on loopback with ``config``, its TSDB and log (prometheus.log) in
    ``data``; yields its API's base URL once it says it is ready, and stops it after. A skip
    that says why without the binary (a failure with CVLB_REQUIRE_BROWSER, as in CI)."""
    prometheus = installed("prometheus", "prometheus")
    port = free_port_block(1)
    log = data / "prometheus.log"
    with open(log, "w") as err:
        process = subprocess.Popen(
            [
                prometheus,
                f"--config.file={config}",
                f"--web.listen-address=127.0.0.1:{port}",
                f"--storage.tsdb.path={data / 'data'}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    api = f"http://127.0.0.1:{port}/api/v1"

    def ready() -> bool:
        try:
            return requests.get(f"http://127.0.0.1:{port}/-/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    try:
        assert wait_for(ready, 30, 0.2), log.read_text()[-3000:]
        yield api
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def installed(program: str, package: str) -> str:
    """Where ``program`` is; without it a skip that names the Debian package ``./run.sh test``
    installs, or a failure with CVLB_REQUIRE_BROWSER (CI must run what needs it)."""
    found = shutil.which(program)
    if found is None:
        if os.environ.get("CVLB_REQUIRE_BROWSER"):
            raise RuntimeError(f"{program} is required here (CVLB_REQUIRE_BROWSER): apt-get install {package}")
        pytest.skip(f"{program} is not installed (./run.sh test installs Debian's {package} package)")
    return found


@pytest.fixture
def promtool() -> str:
    return installed("promtool", "prometheus")


def document(files: dict[str, str], name: str) -> dict:
    (doc,) = [d for d in yaml.safe_load_all(files[name]) if d]
    return doc


TOKEN = "t0ken-for-the-tests-0123456789"


def bcrypt_line(user: str, password: str) -> str:
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
    return f"{user}:{hashed.replace('$2b$', '$2y$', 1)}"  # as `htpasswd -B` writes it
