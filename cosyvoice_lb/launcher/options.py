"""The settings as click options: each from its declaration (``common/settings.py``), with
its ``COSYVOICE_LB_*`` environment variable; a repeatable one given once per value. And the
one way a command fails with a message. Shared by the commands of ``cli`` and ``k8s``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import click

from cosyvoice_lb.common.settings import Settings, declarations, envvar, flag
from cosyvoice_lb.launcher import views

# The options `plan` takes; `up`, `render`, `calibrate` and `k8s render` take them all.
PLAN_OPTIONS = (
    "engine",
    "model_dir",
    "load_trt",
    "load_vllm",
    "fp16",
    "instances",
    "gpus",
    "footprint",
    "reserve",
    "max_instances",
    "min_instances",
    "spares",
    "surge",
    "force",
    "base_port",
    "state_dir",
)
CLUSTER_OPTIONS = PLAN_OPTIONS + tuple(f.name for f in declarations() if f.name not in PLAN_OPTIONS)


def absolute(settings: Settings) -> Settings:
    """Paths made absolute now: supervisord runs everything from the state dir."""
    paths: dict[str, Any] = {}
    for name in (
        "model_dir",
        "cosyvoice_root",
        "outputs_dir",
        "voices_dir",
        "job_results",
        "api_token_file",
        "ui_auth",
        "admin_token_file",
        "alert_smtp_password_file",
    ):
        value = getattr(settings, name)
        if value:
            paths[name] = str(Path(value).expanduser().resolve())
    return dataclasses.replace(settings, **paths)


def settings_from(kwargs: dict[str, Any]) -> Settings:
    return absolute(Settings.from_mapping(kwargs))


class Separated(click.ParamType):
    """One value of a repeatable setting; its environment variable holds them all, joined by
    the setting's separator."""

    name = "text"

    def __init__(self, separator: str):
        self.separator = separator

    def split_envvar_value(self, rv: str) -> list[str]:
        return [part.strip() for part in rv.split(self.separator) if part.strip()]

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        return str(value).strip()


def repeatable(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The click options that make a setting declared with a ``separator`` repeatable, its
    values joined into the setting's one string ({} for any other setting)."""
    separator = metadata.get("separator")
    if not separator:
        return {}
    return {
        "multiple": True,
        "type": Separated(separator),
        "default": (),
        "show_default": False,
        "callback": lambda _ctx, _param, values: separator.join(v for v in values if v),
    }


def options(*names: str) -> Callable:
    """Click options for the named settings, from their declarations."""
    by_name = {f.name: f for f in dataclasses.fields(Settings)}

    def decorate(command: Callable) -> Callable:
        for name in reversed(names):
            f = by_name[name]
            meta = f.metadata
            kwargs: dict[str, Any] = {
                "envvar": envvar(name),
                "show_envvar": True,
                "help": meta["help"],
                "default": f.default,
                "show_default": not meta["is_flag"] and name != "python",
            }
            if meta["is_flag"]:
                kwargs["is_flag"] = True
            elif meta["choices"]:
                kwargs["type"] = click.Choice(meta["choices"])
            elif meta["type"]:
                kwargs["type"] = meta["type"]
            if meta["metavar"]:
                kwargs["metavar"] = meta["metavar"]
            command = click.option(flag(name), name, **{**kwargs, **repeatable(meta)})(command)
        return command

    return decorate


def fail(message: str, code: int = 2) -> None:
    views.err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    sys.exit(code)
