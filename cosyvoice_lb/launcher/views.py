"""What the ``cosyvoice-lb`` commands show: the plan's tables, `up`'s progress and summary,
the status's tables and words (the GPU table among them), the watch loop's redraws, and a
followed log.

The commands (``cli.py``) parse and call the core; these turn what the core returns into
rich tables and plain lines. The lines go out unwrapped through click: they land in logs
and greps.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import click
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.sizes import format_size
from cosyvoice_lb.launcher.cluster import lifecycle
from cosyvoice_lb.launcher.cluster.status import SERVICES, ClusterStatus, jobs_line, pool_line
from cosyvoice_lb.launcher.plan.footprint import PlanReport
from cosyvoice_lb.launcher.render.credentials import admin_token_path
from cosyvoice_lb.launcher.state.layout import Layout
from cosyvoice_lb.launcher.state.supervision import read_tail

# Wide tables and unwrapped messages when piped (rich assumes 80 columns off a terminal).
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)

NONE = "—"  # a reading the card does not offer (or a CPU instance's GPU memory)


def print_plan(report: PlanReport, engine: str) -> None:
    """`plan`: the instances planned, what fits on each device, why each runs the syntheses it
    does, and where the figures came from."""
    result = report.plan
    vllm = any(slot.vllm_memory for slot in result.slots)
    table = Table(title=f"cosyvoice-lb plan: {len(result.slots)} instance(s), engine {engine}")
    for column in ("instance", "device", "memory", "port", "role", "syntheses", *(["vLLM share"] if vllm else [])):
        table.add_column(column)
    for slot, role in zip(result.slots, result.roles.at_up(len(result.slots))):
        device = "cpu" if slot.gpu is None else f"gpu{slot.gpu}"
        share = [f"{slot.vllm_memory:g}"] if vllm else []
        table.add_row(slot.name, device, format_size(slot.memory), str(slot.port), role, str(slot.concurrency), *share)
    out.print(table)
    fits = Table(title="what fits per device")
    for column in ("device", "total", "free", "fits by total", "fits by free", "fits", "limited by"):
        fits.add_column(column)
    for fit in result.fits:
        fits.add_row(
            fit.device,
            format_size(fit.total),
            format_size(fit.free),
            str(fit.by_total),
            str(fit.by_free),
            str(fit.fits),
            fit.limit,
        )
    out.print(fits)
    for line in report.reasoning:  # (unwrapped: one line per device)
        out.print(line, highlight=False, soft_wrap=True)
    out.print(f"GPU inventory: {report.gpu_source}; footprint: {report.footprint_source}", highlight=False)
    for note in result.notes:
        out.print(f"note: {note}", highlight=False)


def calibrated_line(flags: str, entry: dict, path: Path) -> str:
    """What `calibrate` measured (``entry``, kept in ``path``) and plans with from now on."""
    rates = ", ".join(f"{n} at once {x:g}" for n, x in entry.get("throughput", {}).items())
    lines = [
        f"audio seconds a second of one {flags} instance: {rates}; --instance-concurrency auto = "
        f"{entry['knee']} from now on (the fewest at once within 10 % of the best)"
    ]
    each = format_size(entry.get("per_synthesis_bytes", 0))
    if "peak_bytes" in entry:
        lines.append(
            f"peak GPU memory: {format_size(entry['peak_bytes'])}; planning with {format_size(entry['gpu_bytes'])} "
            f"(+10 %), and {each} for each synthesis more"
        )
    else:
        lines.append(
            f"peak host memory (its longest text): {format_size(entry['host_peak_bytes'])}; planning with "
            f"{format_size(entry['host_bytes'])} (+10 %), and {each} for each synthesis more"
        )
    return "\n".join([*lines, f"kept in {path}"])


def warn(message: str) -> None:
    """A warning on stderr, in the same shape as an error."""
    err.print(f"[bold yellow]warning:[/] {message}", markup=True, highlight=False)


@contextmanager
def up_progress(started: float) -> Iterator[tuple[Callable[[lifecycle.Progress], None], Callable[[str], None]]]:
    """How `up` reports while it waits, as (report progress, say a line): a bar on a terminal,
    plain lines on stderr in a log."""
    if not err.is_terminal:
        yield line_reporter(started), lambda line: click.echo(line, err=True)
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[detail]}"),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task("instances ready", total=None, detail="starting")

        def report(progress: lifecycle.Progress) -> None:
            bar.update(task, total=progress.total, completed=progress.ready, detail=progress.detail[:80])

        yield report, lambda line: bar.console.print(line, markup=False, highlight=False)


def line_reporter(started: float) -> Callable[[lifecycle.Progress], None]:
    """Progress as plain lines on stderr, one whenever something changes."""
    last = [""]

    def report(progress: lifecycle.Progress) -> None:
        line = f"{progress.ready}/{progress.total} ready: {progress.detail}"
        if line != last[0]:
            click.echo(f"[{time.monotonic() - started:5.1f}s] {line}", err=True)
            last[0] = line

    return report


def up_lines(
    current: ClusterStatus, elapsed: float, settings: Settings, layout: Layout, access: list[str], prog: str
) -> list[str]:
    """What `up` says once it is up: how many serve, where, who may get in (``access``), and how
    to stop it (``prog``: the command as typed)."""
    failed = sum(1 for i in current.instances if i.failed)
    serving = len(current.instances) - failed
    return [
        f"cosyvoice-lb is up: {serving} instance(s) ready in {elapsed:.1f}s" + (f", {failed} failed" if failed else ""),
        f"  {'API (no UI: --no-ui)' if settings.no_ui else 'UI and API'}: {current.url}/   "
        f"(API: POST {current.url}/v1/tts, health: {current.url}/ping)",
        f"  OpenAI-compatible: base_url {current.url}/v1   (POST /v1/audio/speech, saved voices: /v1/audio/voices)",
        f"  reachable: {reach(settings.listen_host, settings.port)}",
        *access,
        f"  control panel: {current.url}/admin   (admin token in {admin_token_path(settings, layout)}; "
        f"Prometheus: {layout.prometheus_yml})",
        f"  state: {layout.root}   stop with: {prog} down --state-dir {shlex.quote(str(layout.root))}",
    ]


def reach(host: str, port: int) -> str:
    """Who can reach the service, from the address nginx listens on."""
    if host in ("0.0.0.0", "::", "[::]", "*", ""):
        return f"from other machines too: nginx listens on every address of this box, port {port}"
    if host in ("127.0.0.1", "localhost", "::1", "[::1]"):
        return "from this box only (loopback)"
    return f"on {host}:{port} only"


def status_tables(current: ClusterStatus) -> list[Table]:
    """The instance table, and the GPU table when there are GPUs; none when it is not running."""
    if not current.running:
        return []
    with_gpus = bool(current.gpus)
    table = Table(title=f"cosyvoice-lb at {current.url}")
    columns = ["name", "port", "device", "pid", "state", "ready", "in rotation", "restarts", "uptime", "code"]
    with_speech = any(i.speech for i in current.instances)
    columns += ["speech"] if with_speech else []  # (the speech check's verdict, once an instance says one)
    columns += ["GPU memory"] if with_gpus else []  # no empty GPU column on a box without one
    with_bad = any(i.bad_audio or i.bad_audio_restarts for i in current.instances)
    columns += ["bad audio"] if with_bad else []  # (only once an instance made some)
    for column in [*columns, "note"]:
        table.add_column(column)
    for i in current.instances:
        row = [
            i.name,
            str(i.port),
            "cpu" if i.gpu is None else f"gpu{i.gpu}",
            str(i.pid),
            i.state,
            "yes" if i.ready else "no",
            "yes" if i.in_rotation else "no",
            str(i.restarts),
            f"{i.uptime:.0f}s",
            code_cell(i.code, current.code),
        ]
        row += [i.speech or NONE] if with_speech else []
        row += [format_size(i.gpu_memory) if i.gpu_memory else NONE] if with_gpus else []
        row += [bad_audio_cell(i.bad_audio, i.bad_audio_restarts)] if with_bad else []
        table.add_row(*row, i.reason)
    services = [(name, getattr(current, name)) for name in SERVICES] + sorted(current.daemons.items())
    for name, info in services:
        if not info:  # (a status read before that service existed)
            continue
        row = [name, str(info.get("port", "")), name[4:] if name.startswith("mps-") else "", str(info["pid"])]
        row.append(info["state"])
        table.add_row(*row, *[""] * (len(columns) + 1 - len(row)))
    if not with_gpus:
        return [table]
    return [table, gpu_table(current)]


def bad_audio_cell(counts: dict[str, int], restarts: int) -> str:
    """Bad audio of an instance: its syntheses that failed the check (this process), by
    reason, and the restarts the health loop ordered for it."""
    found = ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()))
    again = f"{restarts} restart(s)" if restarts else ""
    return "; ".join(part for part in (found, again) if part) or NONE


def code_cell(runs: str, staged: str) -> str:
    """The code an instance runs: its digest, marked when it is not the one staged now."""
    if not runs:  # (not answering: nothing to say)
        return ""
    return runs[:8] if runs == staged or not staged else f"{runs[:8]} (old)"


def gpu_table(current: ClusterStatus) -> Table:
    """One row per visible GPU: model, memory, utilisation, temperature, power, instances on it."""
    table = Table(title="GPUs")
    for column in ("device", "model", "memory used", "utilization", "temperature", "power", "instances"):
        table.add_column(column)
    for g in current.gpus:
        share = f" ({g.memory_used / g.memory_total:.0%})" if g.memory_total else ""
        table.add_row(
            f"gpu{g.index}",
            g.name,
            f"{format_size(g.memory_used)} / {format_size(g.memory_total)}{share}",
            NONE if g.utilization is None else f"{g.utilization:.0%}",
            NONE if g.temperature is None else f"{g.temperature:.0f} °C",
            NONE if g.power is None else f"{g.power:.0f} W",
            str(sum(1 for i in current.instances if i.gpu == g.index)),
        )
    return table


def status_lines(current: ClusterStatus, root: Path) -> list[str]:
    """What ``status`` says in words: below the tables, or instead of them when it is not running."""
    if current.unanswered:  # there, but not answering: say what was asked and how it failed
        return list(current.problems)
    if not current.running:
        return [f"not running ({root})", *current.problems[1:]]
    lines = []
    if current.access:
        access = current.access
        who = "other machines too" if access["public"] else "this box only"
        lines.append(
            f"access: nginx on {access['listen']} ({who}); credentials "
            + ("required" if access["credentials"] else "not required")
        )
        if current.code:
            lines.append(f"instance code staged: {current.code}")
        if access.get("admin"):
            lines.append(
                f"control panel: {access['admin']} (and the cluster's /metrics), admin token in "
                f"{access['admin_token_file']}"
            )
    if pool_line(current.pool):
        lines.append(pool_line(current.pool))
    if jobs_line(current.jobs):
        lines.append(jobs_line(current.jobs))
    if current.canary:
        lines.append(
            f"canary in progress: {current.canary['summary']}; 'cosyvoice-lb canary status' compares, "
            "'canary promote' or 'canary abort' ends it"
        )
    lines += current.warnings + current.report
    lines.append("ok" if current.exit_code == 0 else "problems: " + "; ".join(current.problems))
    return lines


def print_status(current: ClusterStatus, root: Path) -> None:
    """The status once: tables through rich, the words unwrapped (they land in logs and greps)."""
    for table in status_tables(current):
        out.print(table)
    for line in status_lines(current, root):
        click.echo(line)


def status_view(current: ClusterStatus, root: Path, footer: str = "") -> Group:
    """The whole status as one renderable, for :class:`rich.live.Live` to redraw."""
    lines = status_lines(current, root) + ([footer] if footer else [])
    return Group(*status_tables(current), *(Text(line) for line in lines))


def watch_status(read: Callable[[], ClusterStatus], root: Path, interval: float) -> None:
    """``status --watch``: show what ``read`` returns every ``interval`` seconds until Ctrl-C.

    On a terminal the same region is redrawn; piped, one plain block per refresh, each
    followed by a blank line. A cluster that is not running is said so, and watched on
    (it may come up).
    """
    try:
        if out.is_terminal:
            footer = f"every {interval:g}s, Ctrl-C to stop; last read %H:%M:%S"
            with Live(console=out, screen=False, auto_refresh=False) as live:
                while True:
                    live.update(status_view(read(), root, time.strftime(footer)), refresh=True)
                    time.sleep(interval)
        else:
            while True:
                print_status(read(), root)
                click.echo("")
                sys.stdout.flush()  # a pipe is block-buffered: let the reader see each block now
                time.sleep(interval)
    except KeyboardInterrupt:
        return  # Ctrl-C is how a watch ends: quietly, exit 0


def show_log(path: Path, lines: int, follow: bool) -> None:
    """`logs`: the last ``lines`` lines of a log, then (``follow``) what is appended to it."""
    click.echo("\n".join(read_tail(path, 200 * lines).splitlines()[-lines:]))
    if not follow:
        return
    follow_file(path)


def follow_file(path: Path) -> None:
    """Print lines as they are appended; reopen when supervisord rotates the log."""
    handle = open(path, "rb")
    handle.seek(0, 2)
    try:
        while True:
            chunk = handle.readline()
            if chunk:
                click.echo(chunk.decode("utf-8", errors="replace"), nl=False)
                continue
            time.sleep(0.2)
            try:
                rotated = (
                    os.stat(path).st_ino != os.fstat(handle.fileno()).st_ino or os.stat(path).st_size < handle.tell()
                )
            except FileNotFoundError:
                continue  # between the rename and the new file
            if rotated:
                handle.close()
                handle = open(path, "rb")
    except KeyboardInterrupt:
        return
    finally:
        handle.close()
