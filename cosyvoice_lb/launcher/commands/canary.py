"""`cosyvoice-lb canary`: model roll-outs that compare before they promote (see ``rollout``)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click
from rich.table import Table

from cosyvoice_lb.launcher import views
from cosyvoice_lb.launcher.canary import rollout
from cosyvoice_lb.launcher.canary.compare import Comparison, rows
from cosyvoice_lb.launcher.options import options
from cosyvoice_lb.launcher.state.canary import Thresholds, parse_value
from cosyvoice_lb.launcher.state.layout import layout_for

DEFAULTS = Thresholds()


def _state_dir(command):
    return options("state_dir")(command)


@click.group("canary")
def canary_group() -> None:
    """Model roll-outs that compare first: a canary on the new model beside the serving
    instances, both sides compared over the same requests, then promote or abort."""


@canary_group.command("start")
@_state_dir
@click.option("--model-dir", default=None, metavar="DIR", help="The new model (the canary's --model-dir).")
@click.option("--engine", default=None, help="The canary's engine (default: the cluster's).")
@click.option("--python", "python_path", default=None, metavar="PATH", help="The Python that runs the canary.")
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="NAME=VALUE",
    help="Any other instance setting the canary runs with (e.g. load_vllm=true, openai_voices=alloy=rms); repeat.",
)
@click.option("--mirror", type=click.FloatRange(0, 100, min_open=True), default=None, metavar="PCT",
              help="Copy PCT% of live synthesis requests to the canary; clients hear the serving instances "
                   "only (the default, 10%).")  # fmt: skip
@click.option("--share", type=click.FloatRange(0, 100, min_open=True), default=None, metavar="PCT",
              help="Serve PCT% of live synthesis requests from the canary (clients hear it; what it fails "
                   "is retried on the serving instances).")  # fmt: skip
@click.option("--instances", default=1, show_default=True, type=click.IntRange(min=1), help="Canary instances.")
@click.option("--min-requests", default=DEFAULTS.min_requests, show_default=True, type=click.IntRange(min=1),
              help="Answers on each side before a verdict.")  # fmt: skip
@click.option("--max-failure-increase", default=DEFAULTS.max_failure_increase, show_default=True,
              type=click.FloatRange(0, 1), help="The canary's failure ratio may exceed the serving side's by this.")  # fmt: skip
@click.option("--max-bad-audio-increase", default=DEFAULTS.max_bad_audio_increase, show_default=True,
              type=click.FloatRange(0, 1), help="Likewise for bad audio (NaN, silence, clipping, length).")  # fmt: skip
@click.option("--max-error-increase", default=DEFAULTS.max_error_increase, show_default=True,
              type=click.FloatRange(0), help="The canary's mean speech-check error (WER/CER) may exceed the "
                                             "serving side's by this.")  # fmt: skip
@click.option("--max-latency-ratio", default=DEFAULTS.max_latency_ratio, show_default=True,
              type=click.FloatRange(0, min_open=True), help="First-chunk and total p99: at most this times "
                                                            "the serving side's.")  # fmt: skip
@click.option("--max-similarity-drop", default=DEFAULTS.max_similarity_drop, show_default=True,
              type=click.FloatRange(0), help="Speaker similarity (cloning models with campplus.onnx): at least "
                                             "the serving side's minus this.")  # fmt: skip
def start_command(
    state_dir: str,
    model_dir: str | None,
    engine: str | None,
    python_path: str | None,
    sets: tuple[str, ...],
    mirror: float | None,
    share: float | None,
    instances: int,
    **limits: Any,
) -> None:
    """Start a canary on the new model on parked slots, beside the serving instances."""
    if mirror is not None and share is not None:
        raise click.UsageError("--mirror or --share, not both")
    changes: dict[str, Any] = {}
    for name, value in (("model_dir", model_dir), ("engine", engine), ("python", python_path)):
        if value is not None:
            changes[name] = parse_value(name, value)
    for item in sets:
        name, sep, value = item.partition("=")
        if not sep:
            raise click.UsageError(f"--set {item}: NAME=VALUE")
        changes[name.strip().replace("-", "_")] = parse_value(name.strip().replace("-", "_"), value)
    mode, percent = ("share", share) if share is not None else ("mirror", mirror if mirror is not None else 10.0)
    report = views.line_reporter(time.monotonic())
    canary = rollout.start(
        layout_for(state_dir), changes, mode, percent, instances, Thresholds(**limits), report, say=click.echo
    )
    click.echo(f"canary ready: {canary.describe()}")
    click.echo("'cosyvoice-lb canary status' compares both sides; 'canary promote' or 'canary abort' ends it")


def print_comparison(found: Comparison) -> None:
    table = Table(title="canary: both sides over the same requests")
    for column in ("", "serving", "canary"):
        table.add_column(column)
    for row in rows(found):
        table.add_row(*row)
    views.out.print(table)
    for finding in found.findings:
        click.echo(f"{'ok  ' if finding.passed else 'FAIL'} {finding.name}: {finding.said}")
    click.echo(f"verdict: {found.verdict}")


@canary_group.command("status")
@_state_dir
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
def status_command(state_dir: str, as_json: bool) -> None:
    """Both sides over the same requests, and the verdict. Exit 0: it passes; 1: it fails;
    2: too few answers yet."""
    layout = layout_for(state_dir)
    found = rollout.comparison(layout)
    canary = rollout.state.read(layout)
    if as_json:
        click.echo(json.dumps({"rollout": canary.as_dict() if canary else None, **found.as_dict()}, indent=2))
    else:
        if canary is not None:
            click.echo(f"canary: {canary.describe()}, for {time.time() - canary.started:.0f}s")
        print_comparison(found)
    sys.exit({"pass": 0, "fail": 1}.get(found.verdict, 2))


@canary_group.command("promote")
@_state_dir
@click.option("--force", is_flag=True, help="Promote whatever the verdict says.")
def promote_command(state_dir: str, force: bool) -> None:
    """Every instance onto the canary's settings (a surge roll-out), if its verdict passes."""
    report = views.line_reporter(time.monotonic())
    canary, found = rollout.promote(layout_for(state_dir), force, report, say=click.echo)
    print_comparison(found)
    click.echo(f"promoted: every instance now runs {canary.changed()}")


@canary_group.command("abort")
@_state_dir
def abort_command(state_dir: str) -> None:
    """Stop the canary; its slots are parked again and nginx's lines for it go."""
    report = views.line_reporter(time.monotonic())
    canary = rollout.abort(layout_for(state_dir), report, say=click.echo)
    click.echo(f"canary aborted: {', '.join(canary.slots)} stopped, the serving instances unchanged")
