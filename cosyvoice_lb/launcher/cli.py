"""The ``cosyvoice-lb`` command: parse, call one function of the core per command, print.

The options come from the settings' declarations (``settings.py``), each with its
``COSYVOICE_LB_*`` environment variable.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from typing import Any

import click

from cosyvoice_lb import __version__
from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.sizes import SizeError
from cosyvoice_lb.launcher import views
from cosyvoice_lb.launcher.cluster import calibration, lifecycle
from cosyvoice_lb.launcher.cluster.disk import render_only
from cosyvoice_lb.launcher.cluster.foreground import StopSignals, stay
from cosyvoice_lb.launcher.cluster.log_relay import RelayThread
from cosyvoice_lb.launcher.cluster.status import ClusterStatus, status
from cosyvoice_lb.launcher.commands.backup import backup_command, restore_command
from cosyvoice_lb.launcher.commands.canary import canary_group
from cosyvoice_lb.launcher.commands.k8s import k8s_group
from cosyvoice_lb.launcher.commands.model import prepare_model_command
from cosyvoice_lb.launcher.commands.service import service_group
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.options import CLUSTER_OPTIONS, PLAN_OPTIONS, fail, options, settings_from
from cosyvoice_lb.launcher.plan import footprint
from cosyvoice_lb.launcher.plan.planner import PlanError
from cosyvoice_lb.launcher.render.cluster import RenderError
from cosyvoice_lb.launcher.render.cluster import warnings as render_warnings
from cosyvoice_lb.launcher.render.credentials import access_of, open_warning
from cosyvoice_lb.launcher.state.canary import CanaryError
from cosyvoice_lb.launcher.state.layout import Layout, layout_for
from cosyvoice_lb.launcher.state.supervision import SupervisionError

USER_ERRORS = (PlanError, SizeError, RenderError, ClusterError, SupervisionError, CanaryError)


class Command(click.Group):
    """Turns the user-facing errors into one clear line and a non-zero exit."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except USER_ERRORS as exc:
            fail(str(exc))


@click.group(cls=Command, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="cosyvoice-lb")
def main() -> None:
    """One GPU box as a load-balanced CosyVoice3 text-to-speech service.

    Instances under supervisord, nginx in front, a health loop keeping them in rotation.
    Every option can also be set through its COSYVOICE_LB_* environment variable.
    """


@main.command("plan")
@options(*PLAN_OPTIONS, "instance_concurrency", "vllm_memory")  # (processes x syntheses each)
@click.option(
    "--json", "as_json", is_flag=True, envvar="COSYVOICE_LB_JSON", show_envvar=True, help="Print the plan as JSON."
)
def plan_command(as_json: bool, **kwargs: Any) -> None:
    """Show how many instances fit, on which device and port, and how many syntheses each runs."""
    settings = settings_from(kwargs)
    report = footprint.plan_report(settings)
    if as_json:
        click.echo(json.dumps(report.as_dict(settings.resolved_engine), indent=2))
        return
    views.print_plan(report, settings.resolved_engine)


@main.command("render")
@options(*CLUSTER_OPTIONS)
def render_command(**kwargs: Any) -> None:
    """Write every config (supervisord, nginx) into the state dir; start nothing."""
    settings = settings_from(kwargs)
    result, layout, written = render_only(settings)
    for path in written:
        click.echo(str(path))
    click.echo(f"{len(result.slots)} instance(s); nginx -t accepts {layout.nginx_conf}")


@main.command("up")
@options(*CLUSTER_OPTIONS)
@click.option(
    "--foreground",
    is_flag=True,
    envvar="COSYVOICE_LB_FOREGROUND",
    show_envvar=True,
    help="Stay in the foreground once up (a container's main process): SIGTERM or SIGINT drains and stops "
    "the cluster, then exit 0; exit 1 if supervisord goes away. Every program's lines also go to stdout as "
    "'[POD_NAME] NAME | LINE' (for kubectl logs); the files in the state dir's logs/ stay "
    "('cosyvoice-lb logs NAME' reads them).",
)
def up_command(foreground: bool, **kwargs: Any) -> None:
    """Start the cluster and wait until every instance is ready (safe to run again)."""
    settings = settings_from(kwargs)
    if not foreground:
        start_cluster(settings)
        return
    layout = layout_for(settings)
    signals = StopSignals().install()
    relay = RelayThread(layout.logs).start()  # every program's lines on stdout, for the container's log
    try:
        with signals.while_starting(layout):
            start_cluster(settings, stop_on_failure=True)
        if signals.stopped_starting:
            click.echo("stopped while starting, as asked: the instances drained and the cluster is down")
            return
        stopped = stay(layout, settings, signals.event, say=click.echo)
    finally:
        relay.stop()
    if stopped.code:
        fail(stopped.reason, code=stopped.code)


def start_cluster(settings: Settings, stop_on_failure: bool = False) -> None:
    """`up` itself: start (or update) the cluster, say where it serves. Instances that failed
    while others serve: exit 1, the rest left serving, or (``stop_on_failure``) stopped."""
    for warning in render_warnings(settings):
        views.warn(warning)
    started = time.monotonic()
    with views.up_progress(started) as (report, say):
        current = lifecycle.up(settings, report, say=say)
    elapsed = time.monotonic() - started
    layout = layout_for(settings)
    failed = [i for i in current.instances if i.failed]
    access = access_lines(settings, layout, current.url)
    for line in views.up_lines(current, elapsed, settings, layout, access, invoked_as()):
        click.echo(line)
    if failed:
        for line in current.report:
            click.echo(line, err=True)
        if stop_on_failure:
            pids = lifecycle.down(layout)
            fail(f"{len(failed)} instance(s) failed to start: stopped the cluster ({len(pids)} process(es))", code=1)
        fail(
            f"{len(failed)} instance(s) failed to start and stay stopped while the rest serve: fix the cause, "
            f"then 'cosyvoice-lb restart {' '.join(i.name for i in failed)} --state-dir {layout.root}'",
            code=1,
        )


def access_lines(settings: Settings, layout: Layout, url: str) -> list[str]:
    """Who may get in, and how (the token itself is never printed: it would land in logs)."""
    access = access_of(settings, layout)
    if not access.required:
        warning = open_warning(settings)
        return [warning] if warning else ["  credentials: none needed (only this box can reach it)"]
    lines = []
    if access.generated is not None:
        token = shlex.quote(str(access.generated))
        lines += [
            f"  credentials: an API token, generated into {access.generated} (readable by you only)",
            f'  use it: curl -H "Authorization: Bearer $(tail -n1 {token})" -H "Content-Type: application/json" '
            f'-d \'{{"text": "Hello"}}\' {url}/v1/tts -o hello.wav',
        ]
    else:
        lines.append(f"  credentials: the API tokens in {settings.api_token_file} (Authorization: Bearer TOKEN)")
    who = f"a user of {settings.ui_auth} or an API token" if settings.ui_auth else "an API token as the password"
    lines.append(f"  browsers: log in at {url}/login with {who}")
    return lines


def invoked_as() -> str:
    """How to run this command again, as typed: run.sh says so (the venv's cosyvoice-lb is
    not on PATH then); else the name on PATH, the script's path, or the module."""
    given = os.environ.get("COSYVOICE_LB_INVOKED_AS", "")
    if given:
        return given
    script = sys.argv[0]
    if os.path.basename(script) == "cosyvoice-lb":
        on_path = shutil.which("cosyvoice-lb")
        if on_path and os.path.realpath(on_path) == os.path.realpath(script):
            return "cosyvoice-lb"
        return shlex.quote(script)
    return f"{shlex.quote(sys.executable)} -m cosyvoice_lb.launcher.cli"


@main.command("calibrate")
@options(*CLUSTER_OPTIONS)
@click.option(
    "--up-to",
    type=click.IntRange(min=1, max=64),
    default=calibration.MOST,
    show_default=True,
    help="The most syntheses at once to measure (1, 2, 4, ... up to it).",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1, max=20),
    default=calibration.ROUNDS,
    show_default=True,
    help="Rounds of each.",
)
def calibrate_command(up_to: int, rounds: int, **kwargs: Any) -> None:
    """Measure one instance of this box's engine: throughput against syntheses at once (the
    knee becomes --instance-concurrency auto), memory per synthesis, and on a GPU its peak
    GPU memory (NVML) as the footprint to plan with."""
    settings = settings_from(kwargs)
    entry = calibration.calibrate(settings, views.line_reporter(time.monotonic()), most=up_to, rounds=rounds)
    click.echo(views.calibrated_line(footprint.flags_key(settings), entry, layout_for(settings).footprint_json))


def state_dir_option(command):
    return options("state_dir")(command)


@main.command("status")
@state_dir_option
@click.option(
    "--json", "as_json", is_flag=True, envvar="COSYVOICE_LB_JSON", show_envvar=True, help="Print the status as JSON."
)
@click.option(
    "-w",
    "--watch",
    is_flag=True,
    envvar="COSYVOICE_LB_WATCH",
    show_envvar=True,
    help="Refresh the status in place every --interval seconds until Ctrl-C (one block per refresh when piped).",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    envvar="COSYVOICE_LB_INTERVAL",
    show_envvar=True,
    metavar="SECONDS",
    help="Seconds between two refreshes of --watch.",
)
def status_command(state_dir: str, as_json: bool, watch: bool, interval: float) -> None:
    """Exit 0 when all is up and ready, 1 when something falls short, 3 when not running."""
    layout = layout_for(state_dir)
    if watch and as_json:
        raise click.UsageError(
            "--watch redraws a table and cannot be combined with --json (or COSYVOICE_LB_JSON): "
            "poll 'status --json' instead"
        )
    if watch:
        views.watch_status(lambda: read_status(layout), layout.root, interval)
        return
    current = status(layout)
    if as_json:
        click.echo(json.dumps(current.as_dict(), indent=2))
        sys.exit(current.exit_code)
    views.print_status(current, layout.root)
    sys.exit(current.exit_code)


def read_status(layout: Layout) -> ClusterStatus:
    """The status for ``--watch``: one failed read (supervisord swapping, say) must not end the watch."""
    try:
        return status(layout)
    except USER_ERRORS as exc:
        return ClusterStatus(running=False, problems=[f"status failed: {exc}"], unanswered=True)


@main.command("down")
@state_dir_option
def down_command(state_dir: str) -> None:
    """Drain and stop everything the cluster started."""
    layout = layout_for(state_dir)
    pids = lifecycle.down(layout)
    click.echo(f"stopped {len(pids)} process(es)" if pids else f"not running ({layout.root})")


@main.command("restart")
@state_dir_option
@click.argument("names", nargs=-1)
@click.option(
    "--all", "restart_all", is_flag=True, envvar="COSYVOICE_LB_ALL", show_envvar=True, help="Restart every instance."
)
@click.option(
    "--rolling/--no-rolling",
    default=True,
    show_default=True,
    envvar="COSYVOICE_LB_ROLLING",
    show_envvar=True,
    help="One instance at a time, each serving again before the next goes (no "
    "request lost); --no-rolling restarts them all at once (an outage while "
    "they load).",
)
@click.option(
    "--surge",
    type=click.IntRange(min=0),
    default=None,
    envvar="COSYVOICE_LB_RESTART_SURGE",
    show_envvar=True,
    help="Rolling: start up to N replacements on spare ports first, put them in rotation, and only then "
    "drain the old instances (capacity never drops); default: the cluster's --surge. Where memory has no "
    "room for one, it says so and drains first.",
)
def restart_command(
    state_dir: str, names: tuple[str, ...], restart_all: bool, rolling: bool, surge: int | None
) -> None:
    """Restart instances (or nginx, health) by name, or --all instances. Each instance leaves
    nginx's rotation first and stops once its requests are done (a drained restart)."""
    layout = layout_for(state_dir)
    if bool(names) == restart_all:
        fail("name the instances to restart (e.g. instance-0) or pass --all, not both")
    if surge and not rolling:
        fail("--surge is for rolling restarts: drop --no-rolling or --surge")
    report = views.line_reporter(time.monotonic())
    for line in lifecycle.restart(layout, None if restart_all else list(names), report, rolling=rolling, surge=surge):
        click.echo(line)


@main.command("drain")
@state_dir_option
@click.argument("names", nargs=-1, required=True)
def drain_command(state_dir: str, names: tuple[str, ...]) -> None:
    """Take instances out of rotation and keep them out (processes kept, requests in flight
    finish) until 'undrain': to look at one, or to take its load off for a while."""
    changed = lifecycle.set_drained(layout_for(state_dir), list(names), True)
    for name in names:
        click.echo(f"{name}: {'drained' if name in changed else 'was drained already'} (out of rotation)")


@main.command("undrain")
@state_dir_option
@click.argument("names", nargs=-1, required=True)
def undrain_command(state_dir: str, names: tuple[str, ...]) -> None:
    """Put instances drained by hand back in rotation (at the health loop's next good probes)."""
    changed = lifecycle.set_drained(layout_for(state_dir), list(names), False)
    for name in names:
        click.echo(f"{name}: {'back in rotation shortly' if name in changed else 'was not drained'}")


@main.command("logs")
@state_dir_option
@click.argument("name")
@click.option(
    "-f", "--follow", is_flag=True, envvar="COSYVOICE_LB_FOLLOW", show_envvar=True, help="Keep printing new lines."
)
@click.option(
    "-n",
    "--lines",
    default=50,
    show_default=True,
    envvar="COSYVOICE_LB_LINES",
    show_envvar=True,
    help="How many lines to show first.",
)
def logs_command(state_dir: str, name: str, follow: bool, lines: int) -> None:
    """Print a program's log: an instance, nginx, nginx-error, nginx-access, health, supervisord."""
    layout = layout_for(state_dir)
    path = layout.log(name)
    if not path.exists():
        known = ", ".join(lifecycle.log_names(layout)) or "none yet"
        fail(f"no log named {name!r} in {layout.logs} (known: {known})")
    views.show_log(path, lines, follow)


main.add_command(k8s_group)
main.add_command(prepare_model_command)
main.add_command(canary_group)
main.add_command(service_group)
main.add_command(backup_command)
main.add_command(restore_command)


if __name__ == "__main__":
    main()
