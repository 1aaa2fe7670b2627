"""The cluster's config files on disk: render (pure, ``render``) into a scratch dir, check
with ``nginx -t``, then write atomically what changed, with the instance code staged
beside them. What the last render recorded (cluster.json) is read back here too.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import tempfile
from pathlib import Path

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.plan.footprint import make_plan
from cosyvoice_lb.launcher.plan.planner import Plan, Slot
from cosyvoice_lb.launcher.plan.preflight import (
    ALERTMANAGERS,
    alertmanager_binary,
    check_model,
    check_settings,
    check_state_dir,
    find_nginx,
)
from cosyvoice_lb.launcher.render.cluster import Programs, render
from cosyvoice_lb.launcher.render.credentials import write_admin_access, write_policy, write_segment_key
from cosyvoice_lb.launcher.render.staging import CODE_FILE, stage
from cosyvoice_lb.launcher.state import canary as canary_state
from cosyvoice_lb.launcher.state import record
from cosyvoice_lb.launcher.state.health_report import read_report
from cosyvoice_lb.launcher.state.layout import Layout, layout_for
from cosyvoice_lb.launcher.state.supervision import Supervisor


def recorded(layout: Layout) -> tuple[Settings, tuple[Slot, ...]] | None:
    """The settings and slots the cluster in ``layout`` was last rendered with."""
    found = record.read(layout)
    return (found.settings, found.slots) if found else None


def programs_for(settings: Settings) -> Programs:
    # As root, nginx's workers would drop to 'nobody' and could not write request-body
    # temp files in a private state dir; run them as the launcher's own user instead.
    user = pwd.getpwuid(os.geteuid()).pw_name if os.geteuid() == 0 else ""
    return Programs(
        app=str(layout_for(settings).instance_lib / "app.py"),
        launcher_python=sys.executable,
        nginx=find_nginx(settings.nginx),
        run_as_user=user,
        worker_processes=max(1, min(4, os.cpu_count() or 1)),
        alertmanager=alertmanager_binary() or ALERTMANAGERS[0],
    )


def make_dirs(layout: Layout) -> None:
    for directory in (
        layout.logs,
        layout.run,
        layout.nginx_dir,
        layout.gradio_tmp,
        *(layout.nginx_temp(k) for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")),
    ):
        directory.mkdir(parents=True, exist_ok=True)
    os.chmod(layout.run, 0o700)


def render_to_disk(
    settings: Settings, own: tuple[Slot, ...] = (), planned: Plan | None = None, live: bool = False
) -> tuple[Plan, Layout, list[Path]]:
    """Render every config into the state dir; returns the files whose content changed.

    The configs are first rendered into a scratch dir and checked with ``nginx -t``, so a
    bad setting never replaces a running cluster's files; each file is written atomically.
    ``live``: the cluster runs, and its health loop is the only writer of the rotation
    (upstreams.conf): only the first render writes it.
    """
    result = planned or make_plan(settings, own)[0]
    layout = layout_for(settings)
    programs = programs_for(settings)
    out = read_report(layout).out_of_rotation
    canary = canary_state.read(layout)
    files = render(settings, result, layout, programs, out, canary)
    if live:
        files.pop(layout.relative(layout.upstreams_conf))
    with tempfile.TemporaryDirectory(prefix="cvlb-check-") as scratch:
        trial = Layout(Path(scratch))
        make_dirs(trial)
        write_segment_key(trial)  # (nginx.conf includes it)
        for relative, text in render(settings, result, trial, programs, out, canary).items():
            write_atomic(trial.root / relative, text, mode=0o600)
        check_nginx(settings, trial)
    make_dirs(layout)
    write_policy(settings, layout)  # before the instances that read it (re)start
    write_admin_access(settings, layout)
    write_segment_key(layout)
    changed = []
    for relative, text in files.items():
        path = layout.root / relative
        if not path.exists() or path.read_text() != text:
            write_atomic(path, text, mode=0o600)  # (the private run dir's; some carry a secret: --jobs-redis)
            changed.append(path)
    if stage(layout.instance_lib)[1]:  # (new instance code: a path under run/lib says so)
        changed.append(layout.instance_lib / CODE_FILE)
    return result, layout, changed


def render_only(settings: Settings) -> tuple[Plan, Layout, list[Path]]:
    """`cosyvoice-lb render`: never touches the files of a running cluster."""
    layout = layout_for(settings)
    if Supervisor(layout).running():
        raise ClusterError(
            f"a cluster runs in {layout.root}: 'cosyvoice-lb up' applies new settings to it; "
            "to look at a config, render into another --state-dir"
        )
    check_settings(settings)
    check_state_dir(layout.root)
    if settings.resolved_engine == "cosyvoice3":
        check_model(settings)
    return render_to_disk(settings)


def check_nginx(settings: Settings, layout: Layout) -> None:
    done = subprocess.run(
        [find_nginx(settings.nginx), "-t", "-q", *layout.nginx_args()],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise ClusterError(f"nginx rejects the rendered config, nothing was changed:\n{done.stderr.strip()}")
