"""Checks before anything starts: the tools `up` needs, the instances' Python and its
packages, the model dir, the ports, and the memory limit the plan must fit in. Each refusal
says what to install or change; nothing here starts or writes anything.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from cosyvoice_lb.common.setting_errors import setting_errors
from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.plan import vllm_env
from cosyvoice_lb.launcher.plan.host_memory import CGROUP_ROOT, cgroup_memory_limit, limit_problem, per_instance
from cosyvoice_lb.launcher.plan.planner import Slot
from cosyvoice_lb.launcher.state import processes


def find_nginx(name: str) -> str:
    found = shutil.which(name) or (
        shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin") if "/" not in name else None
    )
    if not found:
        raise ClusterError(
            f"nginx not found ({name!r} is not on PATH or in /usr/sbin): install it with "
            "'sudo apt-get install -y nginx', or point --nginx at the binary"
        )
    return found


ALERTMANAGERS = ("prometheus-alertmanager", "alertmanager")  # Debian's name, upstream's


def alertmanager_binary() -> str:
    """Alertmanager's path, Debian's name first ("" when neither is on PATH)."""
    return next((found for name in ALERTMANAGERS if (found := shutil.which(name))), "")


# Run by the instances' Python: import what an instance imports, for real (a package whose
# uninstall left files behind is only a namespace, which find_spec calls found), and check
# that its gradio can read the API schema its pydantic writes (gradio 5.4 cannot read
# pydantic >= 2.11's: the web UI then answers 500).
ENV_PROBE = """
import importlib, importlib.util, json, sys
sys.path[:0] = [p for p in sys.argv[2:] if p]
missing, broken, versions, schema = [], {}, {}, ""
for name in sys.argv[1].split(","):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        lacking = exc.name or name
        top = lacking.split(".")[0]
        if "." in lacking and top != name.split(".")[0] and importlib.util.find_spec(top) is not None:
            broken[name] = f"{type(exc).__name__}: {exc} ({top} is there: a version that lacks it)"[:300]
        elif lacking not in missing:
            missing.append(lacking)
    except Exception as exc:
        broken[name] = f"{type(exc).__name__}: {exc}"[:300]
    else:
        if getattr(module, "__file__", None) is None and "." not in name:
            missing.append(name)
try:
    import typing, pydantic, gradio, gradio_client.utils
    versions = {"gradio": gradio.__version__, "pydantic": pydantic.VERSION}
    read, adapter = getattr(gradio_client.utils, "json_schema_to_python_type", None), getattr(pydantic, "TypeAdapter", None)
except Exception:
    read = adapter = None
if read is not None and adapter is not None:
    written = adapter(typing.Dict[str, typing.Any]).json_schema()
    try:
        read(written)
    except Exception as exc:
        schema = f"{type(exc).__name__}: {exc}"[:300]
report = {"missing": missing, "broken": broken, "python": sys.version.split()[0], "versions": versions, "schema": schema}
"""
PRINT_REPORT = "print(json.dumps(report))\n"
UPSTREAM_MODULE = "cosyvoice.cli.cosyvoice"
# module -> what to pip install
INSTANCE_NEEDS = {
    "numpy": "numpy",
    "soundfile": "soundfile",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "gradio": "gradio",
    "multipart": "python-multipart",
    # /metrics (an instance without it would serve, but Prometheus could not scrape it)
    "prometheus_client": "prometheus_client",
}
ENGINE_NEEDS = {"espeak": {"pypinyin": "pypinyin"}, "flite": {}, "cosyvoice3": {"torch": "torch"}, "simulated": {}}
# What upstream CosyVoice imports under another name than its package's (its requirements.txt)
UPSTREAM_PACKAGES = {"whisper": "openai-whisper", "yaml": "pyyaml", "hydra": "hydra-core", "hyperpyyaml": "HyperPyYAML"}


def env_problem(report: dict, needs: dict[str, str], python: str) -> str:
    """What the probe's report says is wrong with the instances' Python ("" when nothing),
    with the command that fixes it. ``needs``: module -> the package that brings it."""
    where = f"the instances' Python ({python}, Python {report.get('python', '?')})"
    missing = [m for m in report.get("missing", []) if not m.startswith("cosyvoice")]
    if missing:  # the instance's own packages, or what importing upstream CosyVoice needed
        names = {**UPSTREAM_PACKAGES, **needs}
        packages = " ".join(sorted({names.get(m.split(".")[0], m.split(".")[0]) for m in missing}))
        upstreams = [m for m in missing if m not in needs]
        hint = " (upstream CosyVoice's requirements.txt pins what it needs)" if upstreams else ""
        return f"{where} lacks {', '.join(missing)}: install with '{python} -m pip install {packages}'{hint}"
    if report.get("missing"):  # cosyvoice itself: not on the path
        return (
            f"{where} cannot import upstream CosyVoice ({UPSTREAM_MODULE}): pass --cosyvoice-root with the "
            "checkout that holds cosyvoice/ and third_party/Matcha-TTS"
        )
    broken = report.get("broken") or {}
    if broken:
        name, why = next(iter(broken.items()))
        what = "upstream CosyVoice" if name == UPSTREAM_MODULE else name
        return f"{where} cannot import {what}: {why}"
    if report.get("schema"):
        versions = report.get("versions", {})
        return (
            f"{where}: gradio {versions.get('gradio', '?')} cannot read the API schema that pydantic "
            f"{versions.get('pydantic', '?')} writes ({report['schema']}), so the web UI would answer 500: install "
            f"the pydantic upstream CosyVoice pins with '{python} -m pip install pydantic==2.7.0' (any before "
            "2.11 works) or a gradio that reads it"
        )
    return ""


def check_instance_env(settings: Settings, gpu: bool = True, cpuinfo: str = "") -> dict:
    """Ask the instances' Python what it lacks; refuse with the exact install command (for
    vLLM, the one for this box: ``gpu``, and the CPU's ``/proc/cpuinfo``)."""
    engine = settings.resolved_engine
    vllm = engine == "cosyvoice3" and settings.load_vllm
    needs = {
        **{m: p for m, p in INSTANCE_NEEDS.items() if not (settings.no_ui and m == "gradio")},  # (--no-ui: none)
        **ENGINE_NEEDS[engine],
        **({"bcrypt": "bcrypt"} if settings.ui_auth else {}),
        **({"httpx": "httpx"} if settings.max_long_chars else {}),  # long texts' segments (gradio brings it)
    }
    modules = list(needs) + ([UPSTREAM_MODULE] if engine == "cosyvoice3" else []) + (["vllm"] if vllm else [])
    script = ENV_PROBE + (vllm_env.VLLM_PROBE if vllm else "") + PRINT_REPORT
    roots = []
    if settings.cosyvoice_root:
        root = Path(settings.cosyvoice_root)
        roots = [str(root), str(root / "third_party" / "Matcha-TTS")]
    try:  # from a neutral dir: with -c the current one is on sys.path, and could shadow a package
        done = subprocess.run(
            [settings.python, "-c", script, ",".join(modules), *roots],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
            cwd=tempfile.gettempdir(),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"--python {settings.python} could not be run to check its packages ({exc})") from None
    try:
        report = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        said = " ".join(done.stderr.strip().splitlines()[-3:]) or "nothing on stderr"
        raise ClusterError(
            f"--python {settings.python} failed while importing what an instance needs (exit {done.returncode}: "
            f"{said}): run it by hand with those imports to see why (nothing was started)"
        ) from None
    if settings.no_ui:  # (no UI: whatever its gradio makes of pydantic's schema does not matter)
        report.pop("schema", None)
    problem = vllm_problem(report, settings.python, gpu, cpuinfo) if vllm else ""
    problem = problem or env_problem(report, needs, settings.python)
    if problem:
        raise ClusterError(f"{problem} (nothing was started or changed)")
    return report


def vllm_problem(report: dict, python: str, gpu: bool, cpuinfo: str) -> str:
    """What keeps --load-vllm from working in the instances' Python ("" when nothing)."""
    where = f"--load-vllm: the instances' Python ({python})"
    if "vllm" in report.get("missing", []):
        return f"{where} lacks vllm: {vllm_env.install_advice(python, gpu, cpuinfo)}"
    broken = (report.get("broken") or {}).get("vllm")
    if broken:
        return f"{where} cannot import vllm ({broken}): {vllm_env.install_advice(python, gpu, cpuinfo)}"
    found = vllm_env.platform_problem(report.get("vllm") or {}, python, gpu)
    return f"{where}: {found}" if found else ""


def check_settings(settings: Settings) -> None:
    """Refuse settings that cannot work (each setting's own check, then combinations)."""
    found = setting_errors(settings)
    if found:
        raise ClusterError("; ".join(found))


def check_state_dir(path: Path) -> None:
    """The state dir is a dir this user can write (made if missing)."""
    if path.exists() and not path.is_dir():
        raise ClusterError(f"--state-dir {path} is a file, not a directory: choose a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ClusterError(
            f"--state-dir {path} cannot be created ({exc.strerror or exc}): choose a directory you can write"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ClusterError(f"--state-dir {path} is not writable by this user: choose a directory you can write")


def check_tools(settings: Settings) -> None:
    """Everything `up` needs before it starts anything."""
    check_settings(settings)
    check_state_dir(Path(settings.state_dir).expanduser().resolve())
    find_nginx(settings.nginx)
    if settings.alertmanager and not alertmanager_binary():
        raise ClusterError(
            "--alertmanager: Alertmanager not found on PATH; install it with "
            "'sudo apt-get install -y prometheus-alertmanager' (then 'sudo systemctl disable --now "
            "prometheus-alertmanager': the cluster runs its own)"
        )
    if not Path(settings.python).exists():
        raise ClusterError(f"--python {settings.python} does not exist: name the Python that runs instances")
    if settings.resolved_engine == "espeak" and not shutil.which("espeak-ng"):
        raise ClusterError(
            "espeak-ng not found: the embedded engine needs it; install it with 'sudo apt-get install -y espeak-ng'"
        )
    if settings.resolved_engine == "flite" and not shutil.which("flite"):
        raise ClusterError("flite not found: --engine flite needs it; install it with 'sudo apt-get install -y flite'")
    if settings.resolved_engine == "cosyvoice3":
        check_model(settings)
    for given, what in ((settings.canary_prompt, "--canary-prompt"), (settings.asr_model, "--asr-model")):
        if given and not Path(given).expanduser().exists():
            raise ClusterError(f"{what} {given} does not exist: name a file or dir the instances can read")
    if settings.mps:
        from cosyvoice_lb.launcher.plan.mps_env import mps_problem

        problem = mps_problem()
        if problem:
            raise ClusterError(problem)
    if settings.resolved_engine == "cosyvoice3" and settings.load_vllm:  # (which vLLM this box takes)
        from cosyvoice_lb.launcher.plan.gpu import inventory

        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").is_file() else ""
        check_instance_env(settings, gpu=bool(inventory(settings.gpus).gpus), cpuinfo=cpuinfo)
    else:
        check_instance_env(settings)


def check_model(settings: Settings) -> None:
    from cosyvoice_lb.instance.engines.cosyvoice import model_version

    if not settings.model_dir:
        raise ClusterError("--engine cosyvoice3 needs --model-dir: a local CosyVoice model dir")
    try:
        model_version(settings.model_dir)
    except ValueError as exc:
        raise ClusterError(str(exc)) from None
    if settings.cosyvoice_root:
        root = Path(settings.cosyvoice_root)
        lacking = [p for p in ("cosyvoice", "third_party/Matcha-TTS/matcha") if not (root / p).is_dir()]
        if lacking:
            raise ClusterError(
                f"--cosyvoice-root {root} lacks {', '.join(lacking)}: point it at a checkout of "
                "FunAudioLLM/CosyVoice with its submodules (git submodule update --init --recursive)"
            )


def check_ports(settings: Settings, slots: tuple[Slot, ...], held: set[int]) -> None:
    """Refuse ports someone else holds (``held``: the running cluster's own)."""
    wanted = [(settings.listen_host, settings.port, "public", "stop what holds it or choose another with --port")]
    wanted += [("127.0.0.1", s.port, f"{s.name}'s", "choose another range with --base-port") for s in slots]
    if settings.alertmanager and not held:  # (a first start: a running cluster's may hold it itself)
        wanted += [
            ("127.0.0.1", settings.alertmanager_port, "Alertmanager's", "choose another with --alertmanager-port")
        ]
    for host, port, what, hint in wanted:
        if port in held:
            continue
        why = processes.port_taken(host, port)
        if why:
            raise ClusterError(f"{what} port {port} on {host} is not free ({why}): {hint}")


def check_memory_limit(settings: Settings, slots: tuple[Slot, ...], root: Path = CGROUP_ROOT) -> None:
    """Refuse a plan whose instances (every planned slot: spares and surge slots run too) do not
    fit in the memory limit of the cgroup `up` runs in (a container's, a pod's; none: no check)."""
    problem = limit_problem(len(slots), per_instance(settings), cgroup_memory_limit(root))
    if problem:
        raise ClusterError(f"{problem} (nothing was started or changed)")
