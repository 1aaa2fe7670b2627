"""`cosyvoice-lb prepare-model --load-trt` for real in upstream's Python: where it sees no GPU it
is refused, saying so, with nothing written. (A TensorRT engine itself needs a GPU: its render
is tested in tests/launcher/k8s/test_k8s_prepare.py. The vLLM export is made and loaded for real by
tests/integration/test_vllm_cluster.py, whose cluster runs on a prepared read-only model.)"""

from __future__ import annotations

import shutil

import pytest
from test_vllm_cluster import prepare, read_only_copy, writable_again

pytestmark = [pytest.mark.integration, pytest.mark.upstream]


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
