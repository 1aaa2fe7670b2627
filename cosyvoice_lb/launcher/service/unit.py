"""A systemd unit that starts the cluster at boot: `up --foreground` run by systemd, its
settings carried in an environment file beside the cluster's state. Pure: the settings in,
the unit's and the environment file's texts out (:mod:`.systemd` writes them).

The settings travel as their ``COSYVOICE_LB_*`` variables, those that differ from the
defaults, the way the pod gets them (``k8s/pod.py``): `up` reads them back through the same
declarations, so the unit runs exactly the settings given, and nothing that may be secret
(``--jobs-redis`` may hold a password) lands on the ExecStart line, in ``ps`` or in the unit,
which is world-readable.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cosyvoice_lb.common.settings import Settings, envvar
from cosyvoice_lb.common.timeouts import Timeouts
from cosyvoice_lb.launcher.render.templates import template_environment

Scope = Literal["system", "user"]
DEFAULT_NAME = "cosyvoice-lb"
TEMPLATE = "cosyvoice-lb.service.j2"
# Past `down`'s own bound before systemd KILLs what is left: `down` kills stragglers itself
# at its bound, and needs a moment after that to see them gone and exit.
STOP_MARGIN = 30
# Between a failed run and the next start: long enough that a box still coming up (a network
# mount, a GPU driver) is not hammered, short enough that a crash costs little.
RESTART_SEC = 10
# Open files: nginx is set for 4096 connections a worker, each an upstream's too.
OPEN_FILES = 65536
UNIT_NAME = re.compile(r"[A-Za-z0-9:_.\\@-]+")


class ServiceError(Exception):
    """A unit that cannot be written or handed to systemd; the message says what to do."""


@dataclass(frozen=True)
class Service:
    """One installed unit: ``name`` (without ``.service``), ``command`` (ExecStart's words),
    ``state_dir``, ``env_file``, ``user`` (User=, system units only; "" for none), ``scope``,
    ``down_wait`` (how long `down` waits for the drains) and ``stop_timeout``."""

    name: str
    command: tuple[str, ...]
    state_dir: str
    env_file: str
    scope: Scope = "system"
    user: str = ""
    down_wait: int = 0
    stop_timeout: int = 0
    restart_sec: int = RESTART_SEC
    open_files: int = OPEN_FILES

    @property
    def unit_file(self) -> str:
        return f"{self.name}.service"


def check_name(name: str) -> str:
    """A unit name as systemd takes it (``.service`` may be given or not)."""
    name = name.removesuffix(".service")
    if not name or not UNIT_NAME.fullmatch(name) or len(name) > 200:
        raise ServiceError(
            f"--unit-name {name!r} is not a unit name systemd takes: use letters, digits and ':_.@-' only"
        )
    return name


def stop_timeout(settings: Settings) -> int:
    """TimeoutStopSec: `down`'s bound (the drains, twice over, and nginx's graceful stop; at
    least --drain-timeout) plus :data:`STOP_MARGIN`, so systemd never cuts a drain short."""
    return math.ceil(Timeouts(settings).down) + STOP_MARGIN


def env_value(value: object) -> str:
    """A setting's value as its environment variable holds it (a flag: true or false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def service_env(settings: Settings, path: str) -> dict[str, str]:
    """The unit's environment: the state dir, every setting that differs from its default,
    and ``path`` as PATH (systemd's own PATH may not find nginx or the launcher's venv)."""
    defaults = Settings()
    env = {"PATH": path, envvar("state_dir"): settings.state_dir}
    for f in dataclasses.fields(Settings):
        value = getattr(settings, f.name)
        if f.name != "state_dir" and value != getattr(defaults, f.name):
            env[envvar(f.name)] = env_value(value)
    return env


def render_env(env: dict[str, str]) -> str:
    """The environment file: one ``KEY="VALUE"`` a line, quoted as systemd's EnvironmentFile
    (and a POSIX shell) reads double quotes: ``\\``, ``"``, ``$`` and a backquote escaped."""
    lines = ["# cosyvoice-lb's settings for its systemd unit (cosyvoice-lb service install); keep it 0600"]
    for key, value in env.items():
        if "\n" in value or "\r" in value or "\0" in value:
            raise ServiceError(f"{key} holds a line break, which an environment file cannot carry: remove it")
        quoted = re.sub(r'([\\"$`])', r"\\\1", value)
        lines.append(f'{key}="{quoted}"')
    return "\n".join(lines) + "\n"


def escape_specifiers(value: object) -> str:
    """A value on a unit's line as itself: ``%`` would start a specifier."""
    text = str(value)
    if any(c in text for c in "\n\r\0"):
        raise ServiceError(f"{text!r} holds a line break, which a unit file cannot carry: use another path")
    return text.replace("%", "%%")


def exec_word(word: str) -> str:
    """One argument of ExecStart: specifiers and ``$`` escaped, quoted when it has anything
    but a plain path's characters (a space, a quote)."""
    text = escape_specifiers(word).replace("$", "$$")
    if re.fullmatch(r"[\w./:@+=,-]+", text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_line(words: tuple[str, ...]) -> str:
    """ExecStart's value. systemd takes the program's path literally (no ``$`` expansion) and
    refuses one with a quote or a backslash in it; a space needs the path quoted."""
    program, *args = words
    if any(c in program for c in "'\"\\"):
        raise ServiceError(
            f"systemd cannot run a program whose path holds a quote or a backslash ({program}): "
            "install cosyvoice-lb into a venv at a plainer path"
        )
    text = escape_specifiers(program)
    return " ".join([f'"{text}"' if re.search(r"\s", text) else text, *(exec_word(a) for a in args)])


def render_unit(service: Service) -> str:
    """The unit file's text."""
    env = template_environment()
    env.filters.update(spec=escape_specifiers, execline=exec_line)
    return env.get_template(TEMPLATE).render(service=service)


def plan_service(
    settings: Settings,
    *,
    name: str,
    command: tuple[str, ...],
    scope: Scope,
    user: str,
) -> Service:
    """The unit for ``settings`` (their state dir made absolute); its environment file is
    ``NAME.env`` in the state dir, 0600, beside the tokens `up` generates there."""
    state_dir = str(Path(settings.state_dir).expanduser().resolve())
    name = check_name(name)
    return Service(
        name=name,
        command=command,
        state_dir=state_dir,
        env_file=str(Path(state_dir) / f"{name}.env"),
        scope=scope,
        user=user if scope == "system" else "",
        down_wait=math.ceil(Timeouts(settings).down),
        stop_timeout=stop_timeout(settings),
    )
