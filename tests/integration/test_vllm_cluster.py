"""Upstream's vLLM path, for real: `up --load-vllm` on upstream's code in a Python with a CPU
build of vLLM (tests/upstream/requirements-vllm.txt), the small model with an LLM 128 wide
(head dim 64, which vLLM's CPU attention takes), one instance at 6 syntheses, through nginx,
loading what `cosyvoice-lb prepare-model --load-vllm` made from a read-only copy of the model
(as a pod does): the copy is left as it was and the load writes into neither.

What the instance promises holds on it: syntheses share vLLM's engine steps and the flow and
HiFT runs; streams keep their chunk schedule; a saved voice speaks from the speaker cache; a
seed gives the same audio again, also while others run; a client that leaves takes its
request out of the engine; a SIGKILLed instance leaves no engine process behind; `down`
drains what runs and leaves no process; a load error is logged with its traceback.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import signal
import stat
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests
import soundfile
from conftest import ROOT, clean_env, cli, free_port_block, instance_samples, unexpected_tracebacks, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.upstream, pytest.mark.vllm]

PROMPT = ROOT / "tests" / "fake_cosyvoice" / "asset" / "zero_shot_prompt.wav"
TRANSCRIPT = "希望你以后能够做的比我还好呦。"
RATE = 24000
AT_ONCE = 6


def up(upstream, state_dir: Path, model_dir: Path, *extra: str):
    port, base = free_port_block(1), free_port_block(1)
    done = cli(
        "up",
        "--engine",
        "cosyvoice3",
        "--load-vllm",
        "--no-ui",
        "--model-dir",
        str(model_dir),
        "--cosyvoice-root",
        str(upstream.root),
        "--python",
        str(upstream.python),
        "--instances",
        "1",
        "--instance-concurrency",
        str(AT_ONCE),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
        "--max-chars",
        "400",
        "--token2wav-batch",  # (auto is 1 on a CPU, where it buys nothing: batched here to test it)
        str(AT_ONCE),
        # a synthesis at the flow or HiFT waits this long for the others inside token2wav: the
        # random-weight model's syntheses end their LLM at scattered steps, and 20 ms let a
        # loaded CI box run all six apart (6 flow runs, 0 shared, in one run of many)
        "--token2wav-window",
        "1000",
        *extra,
        env=clean_env(),
        timeout=600,
    )
    return done, port, base


def read_only_copy(model_dir: Path, into: Path) -> Path:
    """The model as a read-only volume holds it: no export of an earlier load, nothing writable."""
    shutil.copytree(model_dir, into, ignore=shutil.ignore_patterns("vllm", "*.plan"))
    for path in [into, *into.rglob("*")]:
        path.chmod(stat.S_IMODE(path.stat().st_mode) & ~0o222)
    return into


def writable_again(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod(stat.S_IMODE(path.stat().st_mode) | 0o200)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: its mode, size, mtime and (a file's) content digest."""
    found = {}
    for path in sorted([root, *root.rglob("*")]):
        info = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        found[str(path.relative_to(root))] = (info.st_mode, info.st_size, info.st_mtime_ns, digest)
    return found


def prepare(upstream, model: Path, out: Path, *flags: str):
    return cli(
        "prepare-model", "--model-dir", str(model), "--out", str(out), *flags,
        "--python", str(upstream.python), "--cosyvoice-root", str(upstream.root), timeout=900,
    )  # fmt: skip


@pytest.fixture(scope="module")
def prepared(upstream_vllm, tmp_path_factory):
    """The small model as a pod mounts it (a read-only copy) and the dir `prepare-model
    --load-vllm` made from it: what the cluster here loads, as on Kubernetes."""
    root = tmp_path_factory.mktemp("vllm-model")
    model = read_only_copy(upstream_vllm.model_dir, root / "ro" / "cv3")
    before = snapshot(model)
    out = root / "prepared" / "cv3"
    done = prepare(upstream_vllm, model, out, "--load-vllm")
    assert done.returncode == 0, done.stdout + done.stderr
    yield {"model": model, "before": before, "out": out, "done": done, "made": snapshot(out)}
    writable_again(root / "ro")


@pytest.fixture(scope="module")
def cluster(upstream_vllm, prepared):
    state_dir = Path(tempfile.mkdtemp(prefix="cvvl-", dir="/tmp"))
    done, port, base = up(upstream_vllm, state_dir, prepared["out"])
    http = requests.Session()
    http.trust_env = False
    yield {
        "up": done,
        "url": f"http://127.0.0.1:{port}",
        "instance": f"http://127.0.0.1:{base}",
        "base": base,
        "state_dir": state_dir,
        "http": http,
        "upstream": upstream_vllm,
    }
    cli("down", "--state-dir", str(state_dir), timeout=180)
    shutil.rmtree(state_dir, ignore_errors=True)


def log_of(cluster) -> str:
    return next((cluster["state_dir"] / "logs").glob("instance-0*.log")).read_text(errors="replace")


def tts(cluster, fields: dict, **kw) -> requests.Response:
    files = {"prompt_audio": ("prompt.wav", PROMPT.read_bytes(), "audio/wav")}
    return cluster["http"].post(cluster["url"] + "/v1/tts", data=fields, files=files, timeout=300, **kw)


def decoded(response: requests.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    audio, rate = soundfile.read(io.BytesIO(response.content), dtype="float32")
    assert rate == RATE and audio.ndim == 1 and np.isfinite(audio).all() and np.abs(audio).max() <= 1.0
    return audio


def engine_processes(pid: int) -> list[psutil.Process]:
    """vLLM's engine process(es) of the instance ``pid`` (it names itself VLLM::EngineCore)."""
    return [c for c in psutil.Process(pid).children(recursive=True) if "EngineCore" in " ".join(c.cmdline())]


def instance_pid(cluster) -> int:
    return cluster["http"].get(cluster["instance"] + "/ping", timeout=10).json()["pid"]


def batches(cluster, stage: str) -> tuple[float, float]:
    """(group runs of ``stage``, of which had more than one synthesis) from the instance's metrics."""
    found = instance_samples(cluster, 0)
    total = found[("cosyvoice_batch_size_count", (("stage", stage),))]
    alone = found[("cosyvoice_batch_size_bucket", (("le", "1.0"), ("stage", stage)))]
    return total, total - alone


def test_up_loads_upstreams_vllm_path_with_an_engine_process_of_its_own(cluster):
    done = cluster["up"]
    assert done.returncode == 0, done.stdout + done.stderr
    log = log_of(cluster)
    assert "load_vllm=True" in log and "NameError" not in log
    assert "flow and HiFT run batched: up to 6 syntheses a run" in log
    assert "runs through cosyvoice-lb's layer" in log
    pid = instance_pid(cluster)
    assert len(engine_processes(pid)) == 1
    # its KV cache as planned for a CPU slot (vLLM's own default would be 4 GiB)
    assert psutil.Process(pid).environ()["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_a_read_only_model_prepared_for_vllm_loads_and_speaks_and_stays_untouched(cluster, prepared):
    """`prepare-model` wrote the export beside links into the read-only model, which it left
    as it was; the instance loads from the prepared dir and writes into neither; a second
    run finds it up to date and redoes nothing."""
    model, out, done = prepared["model"], prepared["out"], prepared["done"]
    assert f"prepared {out}" in done.stdout and f"--model-dir {out}" in done.stdout
    export = out / "vllm"
    assert (export / "config.json").is_file() and any(export.glob("*.safetensors")) and not export.is_symlink()
    for entry in out.iterdir():  # the rest: links into the model
        if entry.name not in ("vllm", ".cosyvoice-lb-prepared.json"):
            assert entry.is_symlink() and entry.resolve().parent == model.resolve(), entry
    assert sorted(p.name for p in out.parent.iterdir()) == [".cv3.lock", "cv3"]  # (no temp dir)

    audio = decoded(tts(cluster, {"text": "Spoken from a prepared model dir.", "mode": "cross_lingual"}))
    assert audio.size > 0.5 * RATE
    assert f"from {out}" in log_of(cluster)
    # the read-only copy: not a byte, not a mode, not a time changed; the load wrote into neither
    assert snapshot(model) == prepared["before"] and snapshot(out) == prepared["made"]

    started = time.monotonic()
    again = prepare(cluster["upstream"], model, out, "--load-vllm")
    assert again.returncode == 0 and "is up to date" in again.stdout, again.stdout + again.stderr
    assert time.monotonic() - started < 30 and snapshot(out) == prepared["made"]  # nothing redone or rewritten


def test_concurrent_syntheses_share_engine_steps_and_flow_and_hift_runs(cluster):
    before = {stage: batches(cluster, stage) for stage in ("llm", "flow", "hift")}
    results: list = [None] * AT_ONCE

    def speak(i: int) -> None:
        results[i] = tts(
            cluster, {"text": f"Number {i} speaks, beside five others, in one batch.", "mode": "cross_lingual"}
        )

    threads = [threading.Thread(target=speak, args=(i,)) for i in range(AT_ONCE)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    lengths = [decoded(r).size for r in results]
    assert all(n > 0.5 * RATE for n in lengths)
    for stage in ("llm", "flow", "hift"):
        runs, shared = (a - b for a, b in zip(batches(cluster, stage), before[stage]))
        assert runs > 0 and shared > 0, (stage, runs, shared)  # some runs held several syntheses


def first_chunks(log: str, text: str) -> list[float]:
    """The seconds of each chunk upstream yielded for ``text`` (its log), in order."""
    lines = log.splitlines()
    start = max(i for i, line in enumerate(lines) if "synthesis text" in line and text in line)
    said = []
    for line in lines[start + 1 :]:
        if "synthesis text" in line:
            break
        if "yield speech len" in line:
            said.append(float(line.split("yield speech len")[1].split(",")[0]))
    return said


def test_streams_come_in_chunks_on_each_ones_own_schedule(cluster):
    texts = [f"Stream {n}: several chunks of audio, one after another, on vLLM." for n in ("one", "two")]
    for text in texts:
        with tts(cluster, {"text": text, "mode": "cross_lingual", "stream": "true"}, stream=True) as r:
            assert r.status_code == 200 and "content-length" not in r.headers
            body = b"".join(r.iter_content(chunk_size=None))
        assert np.frombuffer(body[44:], dtype="<i2").size > 0.5 * RATE
    chunks = [first_chunks(log_of(cluster), text) for text in texts]
    assert all(len(c) >= 3 for c in chunks), chunks
    # each starts from the first hop (25 tokens and the prompt's pad), then a longer one
    assert abs(chunks[0][0] - chunks[1][0]) < 0.2 and all(c[1] > c[0] for c in chunks), chunks


def test_a_saved_voice_speaks_from_the_speaker_cache(cluster):
    with open(PROMPT, "rb") as prompt:
        r = cluster["http"].post(
            cluster["url"] + "/v1/audio/voices",
            timeout=120,
            files={"audio_sample": ("me.wav", prompt)},
            data={"name": "narrator", "prompt_text": TRANSCRIPT, "consent": "yes"},
        )
    assert r.status_code == 200, r.text
    voice = r.json()["id"]
    for _ in range(2):
        decoded(
            cluster["http"].post(cluster["url"] + "/v1/tts", json={"text": "你好，世界。", "voice": voice}, timeout=300)
        )
    found = instance_samples(cluster, 0)
    assert found[("cosyvoice_voice_cache_misses_total", ())] == 1
    assert found[("cosyvoice_voice_cache_hits_total", ())] >= 1


def test_a_seed_gives_the_same_audio_again_also_while_others_run(cluster):
    fields = {"text": "Same seed, same voice, on vLLM.", "mode": "cross_lingual", "seed": "42"}
    alone = decoded(tts(cluster, fields))
    assert np.array_equal(alone, decoded(tts(cluster, fields)))
    others = [
        threading.Thread(
            target=tts, args=(cluster, {"text": f"Unseeded {i}, running beside.", "mode": "cross_lingual"})
        )
        for i in range(3)
    ]
    for thread in others:
        thread.start()
    beside = decoded(tts(cluster, fields))
    for thread in others:
        thread.join(300)
    assert np.array_equal(alone, beside)  # (vLLM samples it with its seed; it runs alone)
    assert not np.array_equal(alone[: 2 * RATE], decoded(tts(cluster, {**fields, "seed": "43"}))[: 2 * RATE])


def test_clients_that_leave_take_their_requests_out_of_the_engine(cluster):
    text = "A long text that the client will not wait for, so the engine must let it go. " * 4
    responses = [tts(cluster, {"text": text, "mode": "cross_lingual", "stream": "true"}, stream=True) for _ in range(4)]
    for r in responses:
        assert r.status_code == 200
        next(r.iter_content(chunk_size=1024))  # the first chunk came: the LLM is still on the rest
    for r in responses:
        r.close()
    assert wait_for(lambda: log_of(cluster).count("left vLLM's engine") >= 1, timeout=30), log_of(cluster)[-3000:]
    ping = lambda: cluster["http"].get(cluster["instance"] + "/ping", timeout=10).json()  # noqa: E731
    assert wait_for(lambda: ping()["inflight"] == 0, timeout=30)


def test_a_killed_instance_leaves_no_engine_process_behind(cluster):
    pid = instance_pid(cluster)
    (engine,) = engine_processes(pid)
    os.kill(pid, signal.SIGKILL)
    gone, _alive = psutil.wait_procs([engine], timeout=15)
    assert gone, f"vLLM's engine process {engine.pid} outlived its instance"
    assert wait_for(lambda: instance_pid(cluster) != pid and cluster["http"].get(cluster["url"] + "/ping").ok, 300)
    assert len(engine_processes(instance_pid(cluster))) == 1


def test_down_drains_what_runs_and_leaves_no_process(cluster):
    pid = instance_pid(cluster)
    (engine,) = engine_processes(pid)
    answers: list = []

    def speak() -> None:
        text = "Finish me while the cluster goes down, every word of me. " * 5
        answers.append(tts(cluster, {"text": text, "mode": "cross_lingual"}))

    talking = threading.Thread(target=speak)
    talking.start()
    inflight = lambda: cluster["http"].get(cluster["instance"] + "/ping").json()["inflight"]  # noqa: E731
    assert wait_for(lambda: inflight() == 1, 30, interval=0.02)
    done = cli("down", "--state-dir", str(cluster["state_dir"]), timeout=180)
    talking.join(120)
    assert done.returncode == 0, done.stderr
    decoded(answers[0])
    assert not psutil.pid_exists(engine.pid) and not psutil.pid_exists(pid)
    log = log_of(cluster)
    assert "vLLM's engine stopped" in log and unexpected_tracebacks(log) == []
    assert "stopped: instance-0 (exit status 0)" in (cluster["state_dir"] / "logs" / "supervisord.log").read_text()


def test_a_load_error_is_logged_with_where_it_happened(upstream_vllm):
    """An export for vLLM whose weights are not weights (a disk that failed under it): vLLM
    fails inside upstream's load_vllm; `up` fails, and the instance's log has the traceback
    down to upstream's frame."""
    state_dir = Path(tempfile.mkdtemp(prefix="cvvl-", dir="/tmp"))
    model = state_dir / "model"
    model.mkdir()
    for item in upstream_vllm.model_dir.iterdir():
        if item.name != "vllm":
            (model / item.name).symlink_to(item)
    (model / "vllm").mkdir()
    shutil.copy(upstream_vllm.model_dir / "vllm" / "config.json", model / "vllm" / "config.json")
    (model / "vllm" / "model.safetensors").write_bytes(b"not weights at all")
    try:
        done, _port, _base = up(upstream_vllm, state_dir, model, "--start-retries", "0", "--startup-timeout", "240")
        assert done.returncode != 0
        log = log_of({"state_dir": state_dir})
        assert "engine cosyvoice3 failed to load" in log and "Traceback (most recent call last)" in log
        assert "in load_vllm" in log  # (upstream's frame: cosyvoice/cli/model.py)
        assert not [p for p in psutil.process_iter(["cmdline"]) if "EngineCore" in " ".join(p.info["cmdline"] or [])]
    finally:
        cli("down", "--state-dir", str(state_dir), timeout=180)
        shutil.rmtree(state_dir, ignore_errors=True)
