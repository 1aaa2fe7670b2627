"""`cosyvoice-lb prepare-model` for real: upstream's own export, in upstream's Python with a CPU
build of vLLM, from a read-only copy of the small model into a dir of its own; the copy is
left as it was, a second run does nothing, and `up --load-vllm` loads from the prepared dir,
writes nothing into either, and speaks. --load-trt where the model's Python sees no GPU is
refused, saying so, with nothing written. (A TensorRT engine itself needs a GPU: its render is
tested in tests/test_k8s_prepare.py.)"""

from __future__ import annotations

import hashlib
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest
import requests
from conftest import cli
from test_vllm_cluster import decoded, log_of, tts, up

pytestmark = [pytest.mark.integration, pytest.mark.upstream]


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


@pytest.mark.vllm
def test_a_read_only_model_prepared_for_vllm_loads_and_speaks_and_stays_untouched(upstream_vllm, tmp_path):
    model = read_only_copy(upstream_vllm.model_dir, tmp_path / "ro" / "cv3")
    before = snapshot(model)
    out = tmp_path / "prepared" / "cv3"
    try:
        done = prepare(upstream_vllm, model, out, "--load-vllm")
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"prepared {out}" in done.stdout and f"--model-dir {out}" in done.stdout
        assert snapshot(model) == before  # the read-only copy: not a byte, not a mode, not a time changed
        export = out / "vllm"
        assert (export / "config.json").is_file() and any(export.glob("*.safetensors")) and not export.is_symlink()
        for entry in out.iterdir():  # the rest: links into the model
            if entry.name not in ("vllm", ".cosyvoice-lb-prepared.json"):
                assert entry.is_symlink() and entry.resolve().parent == model.resolve(), entry
        assert sorted(p.name for p in (tmp_path / "prepared").iterdir()) == [".cv3.lock", "cv3"]  # (no temp dir)

        made = snapshot(out)
        started = time.monotonic()
        again = prepare(upstream_vllm, model, out, "--load-vllm")
        assert again.returncode == 0 and "is up to date" in again.stdout, again.stdout + again.stderr
        assert time.monotonic() - started < 30 and snapshot(out) == made  # nothing redone, nothing rewritten

        state_dir = Path(tempfile.mkdtemp(prefix="cvpm-", dir="/tmp"))
        try:
            started_up, port, base = up(upstream_vllm, state_dir, out)
            assert started_up.returncode == 0, started_up.stdout + started_up.stderr
            http = requests.Session()
            http.trust_env = False
            cluster = {"url": f"http://127.0.0.1:{port}", "http": http, "state_dir": state_dir}
            audio = decoded(tts(cluster, {"text": "Spoken from a prepared model dir.", "mode": "cross_lingual"}))
            assert audio.size > 0.5 * 24000
            log = log_of(cluster)
            assert "load_vllm=True" in log and f"from {out}" in log
        finally:
            cli("down", "--state-dir", str(state_dir), timeout=180)
            shutil.rmtree(state_dir, ignore_errors=True)
        assert snapshot(model) == before and snapshot(out) == made  # the load wrote into neither
    finally:
        writable_again(tmp_path / "ro")


def test_trt_where_the_models_python_sees_no_gpu_is_refused_saying_so(upstream, tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this box has a GPU: the refusal is for a box without one")
    model = read_only_copy(upstream.model_dir, tmp_path / "ro" / "cv3")
    writable_again(model)
    (model / "flow.decoder.estimator.fp32.onnx").write_bytes(b"onnx")  # (the small model has none)
    out = tmp_path / "prepared" / "cv3"
    done = prepare(upstream, model, out, "--load-trt")
    assert done.returncode == 2, done.stdout + done.stderr
    said = " ".join(done.stderr.split())
    assert "--load-trt builds a TensorRT engine for the GPU it runs on" in said and "sees none" in said
    assert "initContainer gets the pod's GPU" in said and "nothing was changed" in said
    assert not out.exists() and [p.name for p in out.parent.iterdir()] == [".cv3.lock"]
