"""An instance's command line: written by the launcher, parsed by the instance, both from the
settings' declarations (``setting(instance=...)``), so the two sides cannot disagree on a flag's
name, type or default.

The launcher puts :func:`instance_args` into supervisord's config; the instance, in the
model's Python environment, reads them back with :func:`parse_instance_args`. Standard
library only, like all of ``common``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from cosyvoice_lb.common.settings import Settings, declarations, flag

# The format of the command line. An instance refuses one newer than it reads (its staged
# code is older than the launcher that rendered supervisord.conf); 0: written by 0.1, which
# had no version (launcher.compat).
ARGV_VERSION = 1


def instance_settings(engine: str) -> list[dataclasses.Field]:
    """The settings an instance of ``engine`` takes on its command line."""
    return [f for f in declarations() if f.metadata["instance"] in (True, engine)]


def instance_args(settings: Settings, **resolved: Any) -> list[str]:
    """The instance's share of ``settings`` as command-line flags (``resolved``: values the
    launcher worked out, e.g. the engine ``auto`` stands for, or the default outputs dir)."""
    values = {**dataclasses.asdict(settings), "engine": settings.resolved_engine, **resolved}
    args: list[str] = ["--argv-version", str(ARGV_VERSION)]
    for f in instance_settings(values["engine"]):
        value = values[f.name]
        if f.metadata["is_flag"]:
            args += [flag(f.name)] if value else []
        elif value != "":  # (empty: the instance's default, which is empty too)
            args += [flag(f.name), str(value)]
    return args


def instance_parser(description: str) -> argparse.ArgumentParser:
    """Parses what :func:`instance_args` writes: the same names, types and defaults (plus
    what only an instance has: its port and address, and its starts file)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--argv-version", type=int, default=0, help="the format of this command line")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--starts-file", default="", help="a line is appended here at every start (restart counting)")
    parser.add_argument("--ledger-dir", default="", help="marks of running syntheses, shared by all instances")
    parser.add_argument("--auth-file", default="", help="the access policy (tokens, users): all but /ping need them")
    parser.add_argument("--balancer", default="", help="nginx's URL on this box: long texts' segments go there")
    parser.add_argument("--peers", type=int, default=1, help="instances in the cluster: segments out at once")
    parser.add_argument("--segment-key-file", default="", help="the key segments carry (nginx knows them by it)")
    parser.add_argument("--board", default="", help="the routing board shared by the box's instances")
    parser.add_argument("--slot", type=int, default=-1, help="this instance's row on the routing board")
    parser.add_argument("--canary", action="store_true", help="a model roll-out's canary: every request is compared")
    for f in declarations():
        if not f.metadata["instance"]:
            continue
        meta = f.metadata
        if meta["is_flag"]:
            parser.add_argument(flag(f.name), dest=f.name, action="store_true", help=meta["help"])
        else:
            parser.add_argument(
                flag(f.name),
                dest=f.name,
                default=f.default,
                type=meta["type"] or str,
                choices=meta["choices"],
                metavar=meta["metavar"],
                help=meta["help"],
            )
    # Sizes in MiB, as instances of earlier versions were started with: an instance that
    # supervisord restarts from such a config while `up` rolls out new code still starts.
    for old, name in (("--max-upload-mib", "max_upload"), ("--outputs-max-mib", "outputs_max_size")):
        parser.add_argument(old, dest=f"{name}_mib", type=float, default=None, help=argparse.SUPPRESS)
    return parser


def parse_instance_args(argv: list[str] | None = None) -> tuple[Settings, argparse.Namespace]:
    """An instance's settings from its command line, and the namespace (port, host, starts file)."""
    parser = instance_parser("One cosyvoice-lb instance (run by supervisord).")
    args = parser.parse_args(argv)
    if args.argv_version > ARGV_VERSION:
        parser.error(
            f"this command line is format {args.argv_version}, and this instance's code reads up to "
            f"{ARGV_VERSION}: the launcher is newer than the staged instance code; 'cosyvoice-lb restart --all' "
            "stages the launcher's code"
        )
    for name in ("max_upload", "outputs_max_size"):
        mib = getattr(args, f"{name}_mib")
        if mib is not None:
            setattr(args, name, f"{mib:g}MiB")
    names = {f.name for f in declarations() if f.metadata["instance"]}
    return Settings.from_mapping({k: v for k, v in vars(args).items() if k in names}), args
