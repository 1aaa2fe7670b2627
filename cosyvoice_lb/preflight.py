"""Checks before anything starts: the tools `up` needs, the instances' Python and its
packages, the model dir, and the ports. Each refusal says what to install or change;
nothing here starts or writes anything.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from . import processes
from .errors import ClusterError
from .planner import Slot
from .settings import Settings, problems


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


# Run by the instances' Python: which of the modules an instance imports are missing there.
ENV_PROBE = """
import importlib, importlib.util, json, sys
sys.path[:0] = [p for p in sys.argv[2:] if p]
missing, versions = [], {}
for name in sys.argv[1].split(","):
    try:
        found = importlib.util.find_spec(name) is not None
    except Exception:
        found = False
    if not found:
        missing.append(name)
try:
    import gradio
    versions["gradio"] = gradio.__version__
except Exception:
    pass
broken = ""
for name in sys.argv[1].split(","):  # the model package: import it for real, its dependencies too
    if name.startswith("cosyvoice") and name not in missing:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if (exc.name or name) not in missing:
                missing.append(exc.name or name)
        except Exception as exc:
            broken = f"{type(exc).__name__}: {exc}"
print(json.dumps({"missing": missing, "broken": broken, "python": sys.version.split()[0], "versions": versions}))
"""
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
ENGINE_NEEDS = {"espeak": {"pypinyin": "pypinyin"}, "cosyvoice3": {"torch": "torch"}, "simulated": {}}


def check_instance_env(settings: Settings) -> dict:
    """Ask the instances' Python what it lacks; refuse with the exact install command."""
    engine = settings.resolved_engine
    needs = {
        **INSTANCE_NEEDS,
        **ENGINE_NEEDS[engine],
        **({"bcrypt": "bcrypt"} if settings.ui_auth else {}),
        **({"httpx": "httpx"} if settings.max_long_chars else {}),  # long texts' segments (gradio brings it)
    }
    modules = list(needs) + (["cosyvoice.cli.cosyvoice"] if engine == "cosyvoice3" else [])
    roots = []
    if settings.cosyvoice_root:
        root = Path(settings.cosyvoice_root)
        roots = [str(root), str(root / "third_party" / "Matcha-TTS")]
    try:
        done = subprocess.run(
            [settings.python, "-c", ENV_PROBE, ",".join(modules), *roots],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        report = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"--python {settings.python} could not be run to check its packages ({exc})") from None
    missing = [m for m in report["missing"] if m != "cosyvoice.cli.cosyvoice"]
    if missing:  # the instance's own packages, or what importing upstream CosyVoice needed
        packages = " ".join(sorted({needs.get(m, m.split(".")[0]) for m in missing}))
        raise ClusterError(
            f"the instances' Python ({settings.python}, Python {report['python']}) lacks "
            f"{', '.join(missing)}: install with '{settings.python} -m pip install {packages}' "
            "(nothing was started)"
        )
    if report.get("broken"):
        raise ClusterError(
            f"the instances' Python cannot import upstream CosyVoice: {report['broken']} (nothing was started)"
        )
    if "cosyvoice.cli.cosyvoice" in report["missing"]:
        raise ClusterError(
            "the instances' Python cannot import upstream CosyVoice (cosyvoice.cli.cosyvoice): "
            "pass --cosyvoice-root with the checkout that holds cosyvoice/ and "
            "third_party/Matcha-TTS (nothing was started)"
        )
    return report


def check_settings(settings: Settings) -> None:
    """Refuse settings that cannot work (each setting's own check, then combinations)."""
    found = problems(settings)
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
    if not Path(settings.python).exists():
        raise ClusterError(f"--python {settings.python} does not exist: name the Python that runs instances")
    if settings.resolved_engine == "espeak" and not shutil.which("espeak-ng"):
        raise ClusterError(
            "espeak-ng not found: the embedded engine needs it; install it with 'sudo apt-get install -y espeak-ng'"
        )
    if settings.resolved_engine == "cosyvoice3":
        check_model(settings)
    if settings.mps:
        from .mps import mps_problem

        problem = mps_problem()
        if problem:
            raise ClusterError(problem)
    check_instance_env(settings)


def check_model(settings: Settings) -> None:
    from .engines.cosyvoice import model_version

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
    for host, port, what, hint in wanted:
        if port in held:
            continue
        why = processes.port_taken(host, port)
        if why:
            raise ClusterError(f"{what} port {port} on {host} is not free ({why}): {hint}")
