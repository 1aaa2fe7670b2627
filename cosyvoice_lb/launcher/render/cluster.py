"""Config rendering: a plan and settings in, the cluster's config files out.

Pure: :func:`render` returns ``{relative path: text}`` and writes nothing; the caller
writes the files (atomically). Templates live in the project's ``templates/`` folder.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from cosyvoice_lb.common.instance_argv import instance_args
from cosyvoice_lb.common.networks import parse_networks
from cosyvoice_lb.common.setting_errors import setting_errors
from cosyvoice_lb.common.settings import Settings, envvar
from cosyvoice_lb.common.sizes import parse_size
from cosyvoice_lb.common.timeouts import Timeouts
from cosyvoice_lb.launcher.plan.footprint import vllm_cpu_kv_space
from cosyvoice_lb.launcher.plan.mps_env import client_env
from cosyvoice_lb.launcher.plan.planner import Plan, Slot
from cosyvoice_lb.launcher.render.addresses import balancer_url, listen_address
from cosyvoice_lb.launcher.render.alertmanager import alertmanager_program
from cosyvoice_lb.launcher.render.monitoring import monitoring_files
from cosyvoice_lb.launcher.render.templates import template_environment
from cosyvoice_lb.launcher.state import record
from cosyvoice_lb.launcher.state.canary import Canary
from cosyvoice_lb.launcher.state.layout import Layout

# AF_UNIX socket paths are limited to 108 bytes on Linux (107 usable).
MAX_SOCKET_PATH = 107


class RenderError(ValueError):
    """Settings that cannot become a working config; the message says what to change."""


@dataclass(frozen=True)
class Programs:
    """What the configs run: resolved by the caller (which binary, which user)."""

    app: str  # path of the staged app.py
    launcher_python: str  # runs the health loop
    nginx: str
    run_as_user: str = ""  # nginx `user` when the launcher runs as root
    worker_processes: int = 2
    alertmanager: str = "prometheus-alertmanager"  # (Debian's name for it; run with --alertmanager)


def instance_command(
    settings: Settings, layout: Layout, programs: Programs, slot: Slot, peers: int = 1, canary: bool = False
) -> list[str]:
    """The instance's command line: its port and starts file, then its share of the settings
    (written and parsed by the same declarations, see ``settings.instance_args``), with what
    the plan resolved for its slot (:func:`planned_args`). A ``canary`` (a model roll-out's,
    see ``launcher.canary``) routes nothing on (no board, no long texts sent out: its copies
    must cost the serving instances nothing) and compares every request it gets."""
    long_texts = (
        ["--balancer", balancer_url(settings), "--peers", str(peers), "--segment-key-file", str(layout.segment_key)]
        if settings.max_long_chars and not canary
        else []
    )
    routing = ["--canary"] if canary else ["--board", str(layout.routing_board), "--slot", str(slot.index)]
    return [
        settings.python,
        programs.app,
        "--port",
        str(slot.port),
        "--starts-file",
        str(layout.starts(slot.name)),
        "--ledger-dir",
        str(layout.ledger),
        *routing,
        *(["--auth-file", str(layout.access_policy)] if settings.auth_required else []),
        *long_texts,
        *instance_args(settings, **planned_args(settings, layout, slot)),
    ]


def planned_args(settings: Settings, layout: Layout, slot: Slot) -> dict[str, str]:
    """What the launcher works out for one instance's command line: its dirs, the syntheses
    it runs at once (what ``auto`` stood for on its device, as planned) and, with vLLM, the
    share of its card vLLM reserves (--vllm-memory as given, or planned)."""
    resolved = {
        "outputs_dir": settings.outputs_dir or str(layout.outputs),
        "voices_dir": settings.voices_dir or str(layout.voices),
        "instance_concurrency": str(slot.concurrency),
    }
    if settings.load_vllm and slot.vllm_memory:
        resolved["vllm_memory"] = f"{slot.vllm_memory:g}"
    return resolved


def instance_env(layout: Layout, slot: Slot, settings: Settings | None = None) -> dict[str, str]:
    """``settings`` with --mps: the instance talks to its GPU's MPS control daemon, which
    sees that one card only and remaps it: its clients see it as device 0 (NVIDIA's MPS
    docs: a client keeping the daemon's CUDA_VISIBLE_DEVICES fails)."""
    mps = (
        {
            **client_env(str(layout.mps_pipe(slot.gpu)), str(layout.mps_log(slot.gpu)), settings.mps_thread_percentage),
            "CUDA_VISIBLE_DEVICES": "0",
        }
        if settings is not None and settings.mps and slot.gpu is not None
        else {}
    )
    # A CPU slot with --load-vllm: vLLM's KV cache in host RAM, as planned (unset, vLLM takes 4 GiB)
    cpu_vllm = settings is not None and settings.load_vllm and settings.resolved_engine == "cosyvoice3"
    kv = {"VLLM_CPU_KVCACHE_SPACE": str(vllm_cpu_kv_space(slot.concurrency))} if cpu_vllm and slot.gpu is None else {}
    return {
        **slot.env,
        **mps,
        **kv,
        "PYTHONUNBUFFERED": "1",
        "GRADIO_ANALYTICS_ENABLED": "False",
        "GRADIO_TEMP_DIR": str(layout.gradio_tmp / slot.name),
    }


@dataclass(frozen=True)
class MpsDaemon:
    """One CUDA MPS control daemon (a supervisord program) for the instances on one GPU."""

    gpu: int
    command: str

    @property
    def name(self) -> str:
        return f"mps-gpu{self.gpu}"


def mps_daemons(settings: Settings, plan: Plan, layout: Layout, programs: Programs) -> list[MpsDaemon]:
    """With --mps, one daemon per GPU the plan puts instances on; refused without GPUs."""
    if not settings.mps:
        return []
    gpus = sorted({slot.gpu for slot in plan.slots if slot.gpu is not None})
    if not gpus:
        raise RenderError("--mps shares NVIDIA GPUs between instances, and this plan has none (CPU slots): drop --mps")
    return [
        MpsDaemon(
            gpu,
            shlex.join(
                [
                    programs.launcher_python,
                    "-m",
                    "cosyvoice_lb.launcher.cluster.mps",
                    "--gpu",
                    str(gpu),
                    "--pipe-dir",
                    str(layout.mps_pipe(gpu)),
                    "--log-dir",
                    str(layout.mps_log(gpu)),
                ]
            ),
        )
        for gpu in gpus
    ]


def jobs_socket(layout: Layout) -> Path:
    """The jobs API listens here; nginx is its only way in (``location /v1/audio/jobs``)."""
    return layout.run / "jobs.sock"


def jobs_env(settings: Settings) -> dict[str, str]:
    """The jobs process's environment: --jobs-redis travels here, never on its command line
    (the URL may hold a password, and command lines are everyone's to read)."""
    return {"PYTHONUNBUFFERED": "1", **({envvar("jobs_redis"): settings.jobs_redis} if settings.jobs_redis else {})}


def check(settings: Settings, layout: Layout) -> None:
    """Refuse settings that would render a config that cannot work."""
    if not layout.root.is_absolute():
        raise RenderError(f"state dir must be an absolute path, got {layout.root}")
    if "%" in str(layout.root):
        # supervisord expands %(...)s in paths, some of them twice: no escape is reliable.
        raise RenderError(
            f"state dir {layout.root} contains '%', which supervisord cannot take in a path: "
            "choose a --state-dir without it"
        )
    socket_bytes = len(os.fsencode(str(layout.socket)))
    if socket_bytes > MAX_SOCKET_PATH:
        raise RenderError(
            f"state dir path is too long for a unix socket ({socket_bytes} > "
            f"{MAX_SOCKET_PATH} bytes for {layout.socket}): use a shorter --state-dir"
        )
    found = setting_errors(settings)
    if found:
        raise RenderError(found[0])


def warnings(settings: Settings) -> list[str]:
    """Settings that work but defeat a guarantee: said at `up`, not refused."""
    found = []
    if settings.hang_timeout >= settings.request_timeout:
        found.append(
            f"--hang-timeout {settings.hang_timeout:g} is not below --request-timeout "
            f"{settings.request_timeout:g}: a stuck synthesis's request gets a 504 at the bound instead of "
            "a retry on another instance"
        )
    return found


def stub_status_allow(settings: Settings) -> str:
    """An address besides loopback that may read nginx's stub_status: the one nginx listens
    on, when it is one address of this box (the control panel reaches nginx there)."""
    host = settings.listen_host.strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name: nginx's allow takes addresses only (the panel then reads 127.0.0.1)
        return ""
    # (127.0.0.2 too: a connection to it comes from 127.0.0.2)
    return "" if address.is_unspecified or str(address) in ("127.0.0.1", "::1") else str(address)


def render_upstreams(
    slots: tuple[Slot, ...],
    out_of_rotation: frozenset[str] = frozenset(),
    overflow: str = "",
    canary: Canary | None = None,
) -> str:
    """upstreams.conf: every slot, those out of rotation marked ``down``; ``overflow``: the
    last resort's socket under --routing work (see ``routing``), "" for none; a ``canary``'s
    slots in pools of their own."""
    return (
        template_environment()
        .get_template("upstreams.conf.j2")
        .render(
            slots=slots,
            out_of_rotation=out_of_rotation,
            overflow=overflow,
            canary=frozenset(canary.slots) if canary else frozenset(),
            canary_mode=canary.mode if canary else "",
        )
    )


def canary_view(canary: Canary | None) -> dict[str, str] | None:
    """What nginx.conf says of a canary: its traffic mode and share (a percentage nginx's
    split_clients takes: at most two decimals)."""
    if canary is None:
        return None
    return {"mode": canary.mode, "percent": f"{canary.percent:.2f}".rstrip("0").rstrip(".")}


def nginx_command(programs: Programs, layout: Layout) -> list[str]:
    """nginx as supervisord starts it: first the last resort's socket goes, which an nginx
    killed outright leaves behind (nginx cannot bind a unix socket that exists)."""
    return [
        "/bin/sh",
        "-c",
        'rm -f -- "$0" && exec "$@"',
        str(layout.overflow_socket),
        programs.nginx,
        *layout.nginx_args(),
    ]


def overflow_of(settings: Settings, layout: Layout) -> str:
    """The last resort's socket when instances route by work, else ""."""
    return str(layout.overflow_socket) if settings.routing == "work" else ""


def api_tries(settings: Settings, slots: int, overflow: str) -> int:
    """How many instances nginx tries for one API request: --retries, and with a last resort
    (``overflow``: --routing work) at least every slot and then it (each declining instance
    is a try)."""
    return max(settings.retries, slots + 1) if overflow else settings.retries


def render(
    settings: Settings,
    plan: Plan,
    layout: Layout,
    programs: Programs,
    out_of_rotation: frozenset[str] = frozenset(),
    canary: Canary | None = None,
) -> dict[str, str]:
    """Every config file of the cluster, keyed by its path relative to the state dir.

    ``out_of_rotation`` keeps instances the health loop has taken out marked ``down`` when a
    running cluster is re-rendered. ``canary``: a model roll-out under comparison; its slots
    run its settings, and nginx mirrors or shares requests to them.
    """
    check(settings, layout)
    if any(slot.port == settings.port for slot in plan.slots):
        raise RenderError(
            f"public port {settings.port} collides with an instance port "
            f"({plan.slots[0].port}..{plan.slots[-1].port}): change --port or --base-port"
        )
    if settings.alertmanager and settings.alertmanager_port in {settings.port, *(s.port for s in plan.slots)}:
        raise RenderError(
            f"--alertmanager-port {settings.alertmanager_port} collides with the public port or an instance "
            "port: choose another with --alertmanager-port"
        )
    env = template_environment()
    timeouts = Timeouts(settings)
    overflow = overflow_of(settings, layout)  # the last resort: routing by work on, or not
    parked = {s.name for s in plan.slots[plan.roles.started :]}  # (a canary runs on parked slots only)
    canary = canary if canary is not None and set(canary.slots) <= parked else None
    canary_slots = frozenset(canary.slots) if canary else frozenset()
    canary_settings = canary.settings_for(settings) if canary else settings
    context = dict(
        settings=settings,
        slots=plan.slots,
        layout=layout,
        listen=listen_address(settings.listen_host, settings.port),
        run_as_user=programs.run_as_user,
        worker_processes=programs.worker_processes,
        max_body=parse_size(settings.max_body),
        timeouts=timeouts,
        instance_command=lambda slot: shlex.join(
            instance_command(
                canary_settings if slot.name in canary_slots else settings,
                layout,
                programs,
                slot,
                peers=plan.roles.serving,
                canary=slot.name in canary_slots,
            )
        ),
        instance_env=lambda slot: instance_env(
            layout, slot, canary_settings if slot.name in canary_slots else settings
        ),
        canary=canary_view(canary),
        mps_daemons=mps_daemons(settings, plan, layout, programs),
        health_command=shlex.join(
            [programs.launcher_python, "-m", "cosyvoice_lb.launcher.health.loop", "--state-dir", str(layout.root)]
        ),
        jobs_command=shlex.join([programs.launcher_python, "-m", "cosyvoice_lb.jobs", "--state-dir", str(layout.root)]),
        jobs_env=jobs_env(settings),
        jobs_socket=jobs_socket(layout),
        admin_command=shlex.join(
            [programs.launcher_python, "-m", "cosyvoice_lb.launcher.panel.server", "--state-dir", str(layout.root)]
        ),
        stub_status_allow=stub_status_allow(settings),
        trusted_proxies=parse_networks(settings.trusted_proxies),  # (nginx takes the client's address from them)
        api_tries=api_tries(settings, len(plan.slots), overflow),
        overflow=overflow,
        nginx_command=shlex.join(nginx_command(programs, layout)),
        alertmanager=alertmanager_program(settings, layout, programs.alertmanager),
    )
    return {
        layout.relative(layout.supervisord_conf): env.get_template("supervisord.conf.j2").render(**context),
        layout.relative(layout.nginx_conf): env.get_template("nginx.conf.j2").render(**context),
        layout.relative(layout.upstreams_conf): render_upstreams(plan.slots, out_of_rotation, overflow, canary),
        layout.relative(layout.cluster_json): record.dump(settings, plan),
        **monitoring_files(settings, layout, plan.slots),
    }
