"""The image with upstream's code inside: built from the Dockerfile with upstream's source and
its requirements (torch from them), run as a pod with the small random-weight CosyVoice3
model the upstream tests build mounted as its model volume, answering a synthesis.

Several GB of torch and upstream's packages: it skips unless CVLB_COSYVOICE3_IMAGE=1 (and
CVLB_UPSTREAM names upstream's checkout), e.g.
``CVLB_COSYVOICE3_IMAGE=1 CVLB_UPSTREAM=~/CosyVoice ./run.sh test -m cosyvoice3_image -s``."""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import soundfile
from conftest import ROOT, free_port_block, wait_for
from docker_support import build, docker, image_size, require_engine

pytestmark = [
    pytest.mark.integration,
    pytest.mark.docker,
    pytest.mark.upstream,
    pytest.mark.cosyvoice3_image,
    pytest.mark.skipif(
        not os.environ.get("CVLB_COSYVOICE3_IMAGE"),
        reason="the cosyvoice3 image (several GB of torch and upstream's requirements) is built only with "
        "CVLB_COSYVOICE3_IMAGE=1",
    ),
]

TAG = "cosyvoice-lb-test:cosyvoice3"
USER = 10001
MODEL = "/models/Fun-CosyVoice3-0.5B"  # where the model volume is mounted (--model-dir)
# What the upstream tests run upstream's code with on a CPU (torch from PyPI, upstream's pins).
REQUIREMENTS = ROOT / "tests" / "upstream" / "requirements.txt"
PROMPT = ROOT / "tests" / "fake_cosyvoice" / "asset" / "zero_shot_prompt.wav"
TRANSCRIPT = "希望你以后能够做的比我还好呦。"


@pytest.fixture(scope="module")
def image(upstream):
    require_engine()
    started = time.monotonic()
    build(
        TAG,
        {"UPSTREAM": "docker/CosyVoice", "COSYVOICE_REQUIREMENTS": "docker/requirements-cpu.txt"},
        {"docker/CosyVoice": upstream.root, "docker/requirements-cpu.txt": REQUIREMENTS.read_bytes()},
    )
    print(f"\nbuilt {TAG} in {time.monotonic() - started:.0f} s, {image_size(TAG) / 2**30:.2f} GiB")
    return TAG


def test_a_container_of_it_synthesizes_with_the_model_on_a_volume(image, upstream):
    tmp = Path(tempfile.mkdtemp(prefix="cvlb-cv3-", dir="/tmp"))
    state = tmp / "state"
    state.mkdir()
    os.chown(state, USER, USER)
    port = free_port_block(2)  # nginx, then the instance
    base = port + 1
    name = f"cvlb-cv3-{os.getpid()}"
    env = {
        "COSYVOICE_LB_PUBLIC": "0",
        "COSYVOICE_LB_HOST": "127.0.0.1",
        "COSYVOICE_LB_PORT": str(port),
        "COSYVOICE_LB_BASE_PORT": str(base),
        "COSYVOICE_LB_INSTANCES": "1",
        "COSYVOICE_LB_ENGINE": "cosyvoice3",
        "COSYVOICE_LB_MODEL_DIR": MODEL,
        "COSYVOICE_LB_COSYVOICE_ROOT": "/opt/cosyvoice",  # the code in the image
        "COSYVOICE_LB_PYTHON": "/opt/cosyvoice-lb/bin/python",
        "POD_NAME": "cosyvoice-lb-cv3-test",
    }
    run = ["run", "-d", "--name", name, "--network", "host", "-v", f"{state}:/var/lib/cosyvoice-lb"]
    model = tmp / "model"  # the volume as a pod's user reads it (the cache's copy may be its owner's only)
    shutil.copytree(upstream.model_dir, model)
    for path in [model, *model.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    run += ["-v", f"{model}:{MODEL}:ro"]
    for key, value in env.items():
        run += ["-e", f"{key}={value}"]
    http = requests.Session()
    http.trust_env = False
    started = time.monotonic()
    docker(*run, image, "cosyvoice-lb", "up", "--foreground")
    try:

        def ready() -> bool:
            try:
                return http.get(f"http://127.0.0.1:{port}/ping", timeout=5).status_code == 200
            except requests.RequestException:
                return False

        def logs() -> str:
            done = docker("logs", name, check=False)
            return done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")

        assert wait_for(ready, timeout=600), logs()[-4000:]
        print(f"\nthe cosyvoice3 pod served /ping 200 {time.monotonic() - started:.1f} s after docker run")
        answer = http.post(
            f"http://127.0.0.1:{port}/v1/tts",
            data={"text": "八百标兵奔北坡。", "mode": "zero_shot", "prompt_text": TRANSCRIPT},
            files={"prompt_audio": ("prompt.wav", PROMPT.read_bytes(), "audio/wav")},
            timeout=300,
        )
        assert answer.status_code == 200, answer.text[:500]
        audio, rate = soundfile.read(io.BytesIO(answer.content), dtype="float32")
        assert rate == 24000 and audio.size > 0 and np.isfinite(audio).all()
        assert f"loading CosyVoice3 from {MODEL}" in logs()  # upstream's code in the image loaded it
    finally:
        docker("rm", "-f", name, check=False)
        http.close()
        shutil.rmtree(tmp, ignore_errors=True)
