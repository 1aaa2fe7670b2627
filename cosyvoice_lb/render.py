"""Config rendering: a plan and settings in, the cluster's config files out.

Pure: :func:`render` returns ``{relative path: text}`` and writes nothing; the caller
writes the files (atomically). Templates live in the project's ``templates/`` folder.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import jinja2

from .planner import Plan, PlanError, Slot, parse_size
from .resources import templates_dir
from .settings import Settings

# AF_UNIX socket paths are limited to 108 bytes on Linux (107 usable).
MAX_SOCKET_PATH = 107


class RenderError(ValueError):
    """Settings that cannot become a working config; the message says what to change."""


@dataclass(frozen=True)
class Layout:
    """Where everything of one cluster lives inside its state dir (path arithmetic only)."""

    root: Path

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def nginx_dir(self) -> Path:
        return self.root / "nginx"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def cluster_json(self) -> Path:
        return self.run / "cluster.json"

    @property
    def health_json(self) -> Path:
        return self.run / "health.json"

    @property
    def supervisord_conf(self) -> Path:
        return self.run / "supervisord.conf"

    @property
    def socket(self) -> Path:
        return self.run / "supervisor.sock"

    @property
    def supervisord_pid(self) -> Path:
        return self.run / "supervisord.pid"

    @property
    def nginx_conf(self) -> Path:
        return self.nginx_dir / "nginx.conf"

    @property
    def upstreams_conf(self) -> Path:
        return self.nginx_dir / "upstreams.conf"

    @property
    def nginx_pid(self) -> Path:
        return self.run / "nginx.pid"

    @property
    def nginx_tmp(self) -> Path:
        return self.nginx_dir / "tmp"

    @property
    def gradio_tmp(self) -> Path:
        return self.run / "gradio"

    def nginx_temp(self, kind: str) -> Path:
        return self.nginx_tmp / kind

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    @property
    def instance_lib(self) -> Path:
        """The staged copy of app.py and the instance modules."""
        return self.run / "lib"

    @property
    def outputs(self) -> Path:
        return self.root / "outputs"

    @property
    def footprint_json(self) -> Path:
        return self.run / "footprint.json"

    def starts(self, name: str) -> Path:
        """A line per start of the instance (it appends one itself): restarts, crash loops."""
        return self.run / f"{name}.starts"

    def starts_count(self, name: str) -> int:
        try:
            return sum(1 for line in self.starts(name).read_text().splitlines() if line.strip())
        except FileNotFoundError:
            return 0

    def restart_request(self, name: str) -> Path:
        """`cosyvoice-lb restart` asks the health loop for a drained restart with this file."""
        return self.run / f"{name}.restart"

    def relative(self, path: Path) -> str:
        return str(path.relative_to(self.root))


@dataclass(frozen=True)
class Programs:
    """What the configs run: resolved by the caller (which binary, which user)."""

    app: str  # path of app.py
    launcher_python: str  # runs the health loop
    nginx: str
    run_as_user: str = ""  # nginx `user` when the launcher runs as root
    worker_processes: int = 2


def _quote_nginx(value: object) -> str:
    text = str(value)
    if re.fullmatch(r"[\w./:@+-]+", text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _escape_supervisor(value: object) -> str:
    return str(value).replace("%", "%%")


def _supervisor_env(env: dict[str, str]) -> str:
    def quote(v: str) -> str:
        return '"' + v.replace("%", "%%").replace('"', '\\"') + '"'

    return ",".join(f"{k}={quote(v)}" for k, v in sorted(env.items()))


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
        keep_trailing_newline=True, autoescape=False,
    )
    env.filters.update(nq=_quote_nginx, sv=_escape_supervisor, svenv=_supervisor_env)
    return env


def instance_command(settings: Settings, layout: Layout, programs: Programs, slot: Slot) -> list[str]:
    engine = settings.resolved_engine
    command = [
        settings.python, programs.app, "--port", str(slot.port), "--engine", engine,
        "--max-chars", str(settings.max_chars), "--drain-timeout", str(settings.drain_timeout),
        "--request-timeout", str(settings.request_timeout),
        "--starts-file", str(layout.starts(slot.name)),
        "--max-prompt-seconds", str(settings.max_prompt_seconds),
        "--max-upload-mib", f"{parse_size(settings.max_upload) / 2**20:g}",
        "--instance-concurrency", str(settings.instance_concurrency),
        "--max-queue", str(settings.max_queue),
        "--outputs-dir", settings.outputs_dir or str(layout.outputs),
        "--outputs-max-age", str(settings.outputs_max_age),
        "--outputs-max-mib", f"{parse_size(settings.outputs_max_size) / 2**20:g}",
    ]
    if engine == "simulated":
        command += ["--simulated-ms-per-char", str(settings.simulated_ms_per_char),
                    "--simulated-base-ms", str(settings.simulated_base_ms)]
    if engine == "cosyvoice3":
        command += ["--model-dir", settings.model_dir]
        if settings.cosyvoice_root:
            command += ["--cosyvoice-root", settings.cosyvoice_root]
        command += [f"--{flag.replace('_', '-')}" for flag in ("load_trt", "load_vllm", "fp16")
                    if getattr(settings, flag)]
    return command


def instance_env(layout: Layout, slot: Slot) -> dict[str, str]:
    return {
        **slot.env,
        "PYTHONUNBUFFERED": "1",
        "GRADIO_ANALYTICS_ENABLED": "False",
        "GRADIO_TEMP_DIR": str(layout.gradio_tmp / slot.name),
    }


def check(settings: Settings, layout: Layout) -> None:
    """Refuse settings that would render a config that cannot work."""
    if not layout.root.is_absolute():
        raise RenderError(f"state dir must be an absolute path, got {layout.root}")
    if "%" in str(layout.root):
        # supervisord expands %(...)s in paths, some of them twice: no escape is reliable.
        raise RenderError(f"state dir {layout.root} contains '%', which supervisord cannot take in a path: "
                          "choose a --state-dir without it")
    socket_bytes = len(os.fsencode(str(layout.socket)))
    if socket_bytes > MAX_SOCKET_PATH:
        raise RenderError(
            f"state dir path is too long for a unix socket ({socket_bytes} > "
            f"{MAX_SOCKET_PATH} bytes for {layout.socket}): use a shorter --state-dir"
        )
    if not 1 <= settings.port <= 65535:
        raise RenderError(f"--port {settings.port} is not a TCP port (1-65535)")
    positive = {"--probe-interval": settings.probe_interval, "--probe-timeout": settings.probe_timeout,
                "--hang-timeout": settings.hang_timeout, "--startup-timeout": settings.startup_timeout,
                "--request-timeout": settings.request_timeout}
    for flag, value in positive.items():
        if not value > 0:
            raise RenderError(f"{flag} must be above 0 seconds, got {value}")
    if settings.simulated_ms_per_char < 0 or settings.simulated_base_ms < 0:
        raise RenderError("--simulated-ms-per-char and --simulated-base-ms cannot be negative")
    if settings.drain_timeout < 0:
        raise RenderError(f"--drain-timeout cannot be negative, got {settings.drain_timeout}")
    at_least = {"--fail-threshold": (settings.fail_threshold, 1), "--recover-threshold": (settings.recover_threshold, 1),
                "--retries": (settings.retries, 1), "--max-chars": (settings.max_chars, 1),
                "--start-retries": (settings.start_retries, 0)}
    for flag, (value, least) in at_least.items():
        if value < least:
            raise RenderError(f"{flag} must be at least {least}, got {value}")
    if settings.max_queue < 0:
        raise RenderError(f"--max-queue cannot be negative, got {settings.max_queue}")
    if settings.instance_concurrency < 1:
        raise RenderError(f"--instance-concurrency must be at least 1, got {settings.instance_concurrency}")
    if not 0 < settings.max_prompt_seconds <= 30:
        raise RenderError(f"--max-prompt-seconds must be above 0 and at most 30 (upstream refuses longer "
                          f"prompts), got {settings.max_prompt_seconds}")
    if not settings.outputs_max_age > 0:
        raise RenderError("--outputs-max-age must be above 0")
    if settings.max_requests < 0 or settings.max_requests_jitter < 0:
        raise RenderError("--max-requests and --max-requests-jitter cannot be negative")
    sizes = [("--max-upload", settings.max_upload), ("--outputs-max-size", settings.outputs_max_size)]
    if settings.max_memory:
        sizes.append(("--max-memory", settings.max_memory))
    for flag, size in sizes:
        try:
            parse_size(size)
        except PlanError as exc:
            raise RenderError(f"{flag}: {exc}") from None
    if settings.resolved_engine == "cosyvoice3" and not settings.model_dir:
        raise RenderError("--engine cosyvoice3 needs --model-dir (a local CosyVoice model dir)")


def warnings(settings: Settings) -> list[str]:
    """Settings that work but defeat a guarantee: said at `up`, not refused."""
    found = []
    if settings.hang_timeout >= settings.request_timeout:
        found.append(f"--hang-timeout {settings.hang_timeout:g} is not below --request-timeout "
                     f"{settings.request_timeout:g}: a stuck synthesis's request gets a 504 at the bound instead of "
                     "a retry on another instance")
    return found


def listen_address(host: str, port: int) -> str:
    """nginx's ``listen`` argument: IPv6 addresses go in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def render_upstreams(slots: tuple[Slot, ...], out_of_rotation: frozenset[str] = frozenset()) -> str:
    """upstreams.conf: every slot, those out of rotation marked ``down``."""
    return _environment().get_template("upstreams.conf.j2").render(
        slots=slots, out_of_rotation=out_of_rotation,
    )


def render(settings: Settings, plan: Plan, layout: Layout, programs: Programs,
           out_of_rotation: frozenset[str] = frozenset()) -> dict[str, str]:
    """Every config file of the cluster, keyed by its path relative to the state dir.

    ``out_of_rotation`` keeps instances the health loop has taken out marked ``down`` when a
    running cluster is re-rendered.
    """
    check(settings, layout)
    if any(slot.port == settings.port for slot in plan.slots):
        raise RenderError(
            f"public port {settings.port} collides with an instance port "
            f"({plan.slots[0].port}..{plan.slots[-1].port}): change --port or --base-port"
        )
    env = _environment()
    # The instance answers a request that ran out of time itself (a clear 504); nginx's
    # own timeout is the backstop for an instance that cannot answer at all.
    api_read_timeout = math.ceil(settings.request_timeout + 5)
    context = dict(
        settings=settings, slots=plan.slots, layout=layout, listen=listen_address(settings.host, settings.port), run_as_user=programs.run_as_user,
        worker_processes=programs.worker_processes,
        # room for the largest prompt upload plus the form around it
        max_body=f"{parse_size(settings.max_upload) // 2**20 + 2}m", api_read_timeout=api_read_timeout,
        instance_command=lambda slot: shlex.join(instance_command(settings, layout, programs, slot)),
        instance_env=lambda slot: instance_env(layout, slot),
        health_command=shlex.join([programs.launcher_python, "-m", "cosyvoice_lb.health",
                                   "--state-dir", str(layout.root)]),
        nginx_command=shlex.join([programs.nginx, "-p", str(layout.nginx_dir), "-c", str(layout.nginx_conf),
                                  "-e", str(layout.log("nginx-error"))]),
    )
    return {
        layout.relative(layout.supervisord_conf): env.get_template("supervisord.conf.j2").render(**context),
        layout.relative(layout.nginx_conf): env.get_template("nginx.conf.j2").render(**context),
        layout.relative(layout.upstreams_conf): render_upstreams(plan.slots, out_of_rotation),
        layout.relative(layout.cluster_json): cluster_json(settings, plan),
    }


def cluster_json(settings: Settings, plan: Plan) -> str:
    """What the health loop and status read back: the settings and the slots (nothing that
    changes between two renders of the same cluster, such as free memory)."""
    slots = [{k: v for k, v in slot.items() if k in ("name", "index", "port", "gpu", "memory")}
             for slot in plan.as_dict()["slots"]]
    return json.dumps({"settings": json.loads(settings.to_json()), "plan": {"mode": plan.mode, "slots": slots}},
                      indent=2) + "\n"


def read_cluster_json(text: str) -> tuple[Settings, tuple[Slot, ...]]:
    """Settings and slots back from ``cluster.json`` (what the health loop and status read)."""
    data = json.loads(text)
    slots = tuple(Slot(index=s["index"], port=s["port"], gpu=s["gpu"], memory=s["memory"])
                  for s in data["plan"]["slots"])
    return Settings.from_mapping(data["settings"]), slots
