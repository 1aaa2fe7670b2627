"""`cosyvoice-lb backup` and `restore`: the saved voices and the long-form jobs, copied whole."""

from __future__ import annotations

from pathlib import Path

import click

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.cluster.backup import Sources, restore, take
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.options import options
from cosyvoice_lb.launcher.state import record
from cosyvoice_lb.launcher.state.layout import Layout, layout_for
from cosyvoice_lb.launcher.state.supervision import Supervisor


def sources_of(layout: Layout) -> Sources:
    """Where this state dir's cluster keeps voices and jobs: its record's settings (the
    defaults when it never ran)."""
    found = record.read(layout)
    return Sources.of(layout.root, found.settings if found else Settings())


@click.command("backup")
@options("state_dir")
@click.argument("dest", type=click.Path(path_type=Path))
def backup_command(state_dir: str, dest: Path) -> None:
    """Copy the saved voices and the long-form jobs (their store and audio) into DEST, a new
    directory; safe while the cluster runs."""
    layout = layout_for(state_dir)
    manifest = take(sources_of(layout), dest.expanduser().absolute())
    for line in manifest.lines(dest):
        click.echo(line)


@click.command("restore")
@options("state_dir")
@click.argument("source", type=click.Path(path_type=Path, exists=True, file_okay=False))
def restore_command(state_dir: str, source: Path) -> None:
    """Put a backup back into the state dir: the cluster must be down (run 'down' first)."""
    layout = layout_for(state_dir)
    if Supervisor(layout).running():
        raise ClusterError(f"the cluster in {layout.root} is running: run 'cosyvoice-lb down' first, then restore")
    for line in restore(source, sources_of(layout)):
        click.echo(line)
