"""The cluster's lifecycle: up (start, or update a running one), restart, drain, down.

Everything that changes what runs goes through here. Planned stops of instances are
drained: the launcher asks the health loop (``markers``), which takes the instance out
of rotation and stops it once its requests are done.
"""

from __future__ import annotations

import dataclasses

import psutil

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.timeouts import Timeouts
from cosyvoice_lb.launcher.cluster.changes import described, guard_step
from cosyvoice_lb.launcher.cluster.context import Cluster, Progress, Report, Say
from cosyvoice_lb.launcher.cluster.disk import recorded, render_to_disk
from cosyvoice_lb.launcher.cluster.rollout import Slots, surge_rollout, surge_room
from cosyvoice_lb.launcher.cluster.status import SERVICES, ClusterStatus, failure_report
from cosyvoice_lb.launcher.cluster.waits import (
    drain,
    loop_reported,
    others_serving,
    serving_or_fail,
    wait_serving,
)
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.plan.footprint import make_plan
from cosyvoice_lb.launcher.plan.planner import Roles, Slot
from cosyvoice_lb.launcher.plan.preflight import check_memory_limit, check_ports, check_tools
from cosyvoice_lb.launcher.render.credentials import generated_token
from cosyvoice_lb.launcher.render.staging import prune, stage
from cosyvoice_lb.launcher.state import canary as canary_state
from cosyvoice_lb.launcher.state import processes
from cosyvoice_lb.launcher.state.layout import Layout, layout_for
from cosyvoice_lb.launcher.state.markers import (
    DrainAction,
    clear_drained,
    clear_drains,
    clear_starts,
    drain_by_hand,
    drained_by_hand,
    end_rollout,
    undrain,
)
from cosyvoice_lb.launcher.state.supervision import ALIVE, SupervisionError, Supervisor

# What the last render recorded (cluster.json): the settings and the slots.
Recorded = tuple[Settings, tuple[Slot, ...]]


# --- up --------------------------------------------------------------------------------


def up(settings: Settings, on_progress: Report = lambda p: None, say: Say = lambda line: None) -> ClusterStatus:
    """Start the cluster, or bring a running one to these settings (the ones given, defaults
    included: see ``changes``); wait until all ready. ``say``: what changes, before it does."""
    layout = layout_for(settings)
    check_tools(settings)
    c = Cluster.of(layout, settings, on_progress)
    previous = recorded(layout) if c.supervisor.running() else None
    current = start(c) if previous is None else update(c, previous, say)
    pruned(layout, current)
    current.report = failure_report(layout, current, supervisor=c.supervisor)
    return current


def pruned(layout: Layout, current: ClusterStatus) -> list[str]:
    """Remove staged code trees no instance runs any more (none while one still loads:
    it may import from its tree yet)."""
    running = [i for i in current.instances if i.state in ALIVE]
    if any(not i.code for i in running):
        return []
    return prune(layout.instance_lib, {i.code for i in running})


def start(c: Cluster) -> ClusterStatus:
    """A first start: plan, render, supervisord, the instances (all at once, or --stagger'd
    one after another). Whatever goes wrong (Ctrl-C too), what was started is stopped."""
    settings, layout = c.settings, c.layout
    result, _ = make_plan(settings)
    check_ports(settings, result.slots, held=set())
    check_memory_limit(settings, result.slots)
    forget_last_run(layout)
    canary_state.displaced(layout, {s.name for s in result.slots[result.roles.started :]})
    result, layout, _ = render_to_disk(settings, planned=result)
    # The first ones serve (and wait as spares); the slots past them stay parked for surges.
    starting = [s.name for s in result.slots[: result.roles.started]]
    try:
        c.supervisor.start_daemon()
        since = c.wall()  # (a --stagger'd one that failed before the last wait still failed)
        for index, name in enumerate(starting):
            if settings.staggered:  # one model load at a time: each instance serves before the next starts
                c.progress(Progress(index, len(starting), f"starting {name} (--stagger)"))
            c.supervisor.start(name)
            if settings.staggered:
                try:
                    wait_serving(c, [name])
                except ClusterError:  # this one failed: the others may still serve (checked below)
                    pass
        # Serving with some instances failed is still serving: they are reported, not fatal.
        current = wait_serving(c, starting, since=since)
        for name in sorted(canary_state.names(layout)):  # a model roll-out's canary comes back too
            c.supervisor.start(name)
        return current
    except BaseException as exc:  # never a half-started cluster, whatever went wrong (Ctrl-C too)
        down(layout)
        raise ClusterError(f"{what_failed(exc)}\nThe cluster was stopped; logs are in {layout.logs}") from None


def what_failed(exc: BaseException) -> str:
    if isinstance(exc, (ClusterError, SupervisionError)):
        return str(exc)
    return "interrupted" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"


def forget_last_run(layout: Layout) -> None:
    """Restarts are counted from this start; old requests, drains by hand, a roll-out marker,
    the last run's health report and routing board rows are void."""
    if layout.run.is_dir():
        clear_starts(layout)
        clear_drains(layout)
        clear_drained(layout)
        end_rollout(layout)
    layout.health_json.unlink(missing_ok=True)
    layout.routing_board.unlink(missing_ok=True)


def update(c: Cluster, previous: Recorded, say: Say) -> ClusterStatus:
    """Bring a running cluster to ``c.settings``, said line by line first. Access and the
    listener changing together go in two steps, the safe way round (``changes.guard_step``)."""
    settings, layout = c.settings, c.layout
    for line in described(previous[0], settings):
        say(f"changing: {line}")
    guard = guard_step(previous[0], settings, str(layout.api_token))
    if guard is not None:
        if not guard.api_token_file or guard.api_token_file == str(layout.api_token):
            generated_token(layout)  # (made once; the final settings use the same one)
        say(
            "credentials stay in force while nginx listens beyond loopback: "
            + ("credentials first, then nginx moves" if settings.auth_required else "nginx moves first")
        )
        update_to(c.with_settings(guard), previous, say)
        previous = recorded(layout) or previous
    return update_to(c, previous, say)


def update_to(c: Cluster, previous: Recorded, say: Say) -> ClusterStatus:
    """Apply new settings to a running cluster, one instance at a time; nginx takes its new
    config checked (``nginx_apply``): early when it narrows, last when it widens."""
    settings, layout = c.settings, c.layout
    old_settings, old_slots = previous
    if settings.mps != old_settings.mps:
        raise ClusterError(
            f"--mps {'on' if settings.mps else 'off'} changes how every instance reaches its GPU, which cannot "
            f"happen one instance at a time: 'cosyvoice-lb down', then 'up' with the new settings"
        )
    canary = canary_state.names(layout)  # (running, and holding memory, though no Slots' own)
    own = (*Slots.read(layout, c.supervisor, old_slots).running, *(s for s in old_slots if s.name in canary))
    result, _ = make_plan(settings, own=own)
    gone = canary_state.displaced(layout, {s.name for s in result.slots[result.roles.started :]})
    if gone is not None:
        say(f"the canary ({gone.describe()}) ends: the new plan has no parked slot for it; stopping it")
        for name in gone.slots:
            c.supervisor.stop(name)
    check_ports(settings, result.slots, held={old_settings.port, *(s.port for s in old_slots)})
    check_memory_limit(settings, result.slots)
    result, layout, changed = render_to_disk(settings, own=own, planned=result, live=True)
    if changed:
        code_changed = any(layout.instance_lib in path.parents for path in changed)
        apply_rendered(c, previous, result.slots, code_changed, say)
    elif c.nginx.lagging(settings):
        # (nothing to render, yet nginx does not run its config: an earlier failed move or reload)
        c.nginx.apply(settings, say)
    # (also with nothing changed: a slot stopped by hand, or an interrupted restart, is started)
    settle_count(c, result.slots, result.roles)
    return wait_serving(c, [s.name for s in Slots.read(layout, c.supervisor, result.slots).running])


def apply_rendered(c: Cluster, previous: Recorded, slots: tuple[Slot, ...], code_changed: bool, say: Say) -> None:
    """The configs on disk changed: supervisord takes them, and the cluster moves over in
    this order, each step before the next:

    1. parked slots that stay take over from slots the plan no longer has, and serve;
    2. the health loop restarts on the new slots (it drains the instances replaced below);
    3. removed programs go, added ones come (stopped);
    4. nginx, when the change narrows access (or changes nothing about it);
    5. the changed instances, replaced with a surge where parked slots allow, else one after
       another, each out of rotation and idle first;
    6. nginx, when the change widens access: credentials on, or a listener beyond loopback.
    """
    settings, old_settings = c.settings, previous[0]
    added, groups_changed, removed = c.supervisor.reload()
    take_over(c, previous[1], removed)
    restart_health_loop(c, "health" in groups_changed)
    for name in removed:
        c.supervisor.remove_group(name)
        clear_starts(c.layout, name)
        clear_drained(c.layout, name)
    for name in added:
        c.supervisor.add_group(name)
    moves = (settings.listen_host, settings.port) != (old_settings.listen_host, old_settings.port)
    widens = (settings.auth_required and not old_settings.auth_required) or (moves and settings.exposed)
    nginx_program = "nginx" in groups_changed
    if not widens:
        take_nginx(c, nginx_program, say)
    names = [s.name for s in slots]
    if code_changed:  # new instance code (staged in run/lib): every instance is "changed"
        groups_changed = sorted(set(groups_changed) | (set(names) - set(added)))
    replace_changed(c, slots, [n for n in groups_changed if n in names])
    if widens:
        take_nginx(c, nginx_program, say)


def take_over(c: Cluster, old_slots: tuple[Slot, ...], removed: list[str]) -> None:
    """Slots the plan no longer has may be serving (roles move between slots): parked slots
    that stay take over first, and serve (the loop still running knows them) before the new
    loop leaves the old ones out."""
    before = Slots.read(c.layout, c.supervisor, old_slots)
    leaving = [s.name for s in before.running if s.name in removed]
    taking_over = [s.name for s in before.parked if s.name not in removed][: len(leaving)]
    if taking_over:
        c.progress(Progress(0, len(taking_over), f"{', '.join(taking_over)} take over from {', '.join(leaving)}"))
        for name in taking_over:
            c.supervisor.start(name)
        wait_serving(c, taking_over)


def restart_health_loop(c: Cluster, program_changed: bool) -> None:
    """The health loop reads its slots at start; restarted, it re-publishes the rotation at
    once, and is there to drain the instances replaced next. (Its program changed, e.g. its
    command: supervisord takes the new one with the group.)"""
    restarted = c.wall()
    if program_changed:
        c.supervisor.remove_group("health")
        c.supervisor.add_group("health")
    else:
        c.supervisor.stop("health")
        c.supervisor.start("health", wait=True)
    loop_reported(c, restarted)


def take_nginx(c: Cluster, program_changed: bool, say: Say) -> None:
    if program_changed:  # (its program changed: supervisord starts the new one)
        c.nginx.replace_program(c.settings)
    else:
        c.nginx.apply(c.settings, say)


def regroup(c: Cluster, name: str) -> None:
    """A stopped slot takes its new config (and stays stopped)."""
    c.supervisor.remove_group(name)
    c.supervisor.add_group(name)


def replace_changed(c: Cluster, slots: tuple[Slot, ...], changed: list[str]) -> None:
    """Instances whose config changed run it: a parked slot at once; running ones with a surge
    roll-out where parked slots have room, else one after another, each drained first (one
    drained by hand is replaced in place, without a surge)."""
    now = Slots.read(c.layout, c.supervisor, slots)
    for slot in now.parked:  # nothing runs there: the new config now
        if slot.name in changed:
            regroup(c, slot.name)
    by_hand = {s.name for s in now.running if drained_by_hand(c.layout, s.name)}
    running = [s.name for s in now.running if s.name in changed and s.name not in by_hand]
    free = surge_room(c, Slots.read(c.layout, c.supervisor, slots), c.settings.surge, running)
    if running and free:
        c.progress(Progress(0, len(running), f"surge roll-out: {len(free)} at a time on parked slots"))
        surge_rollout(c, running, free, refresh=lambda name: regroup(c, name))
        running = []
    elif running and c.settings.surge:
        c.progress(Progress(0, len(running), f"--surge {c.settings.surge}: {NO_SURGE}; draining first"))
    running += [s.name for s in now.running if s.name in changed and s.name in by_hand]
    for name in running:
        c.progress(Progress(0, len(running), f"replacing {name} with its new settings"))
        others_serving(c, name)
        old = drain(c, [name], DrainAction.HOLD)
        regroup(c, name)
        c.supervisor.start(name)
        serving_or_fail(c, [name], old)


NO_SURGE = "no parked slot has memory for a replacement now"


def settle_count(c: Cluster, slots: tuple[Slot, ...], roles: Roles) -> None:
    """After new settings: as many instances running as they ask for (serving and spares;
    elastic: at least the floor, the health loop does the rest). Parked slots start, or
    the surplus is drained (out of rotation, idle) and stopped: spares and the last first."""
    now = Slots.read(c.layout, c.supervisor, slots)
    wanted = roles.started
    if len(now.running) < wanted:
        for slot in now.parked[: wanted - len(now.running)]:
            c.progress(Progress(0, wanted, f"starting {slot.name}"))
            c.supervisor.start(slot.name)
        return
    if roles.elastic or len(now.running) == wanted:
        return
    current = {i.name: i for i in c.read_status().instances}
    surplus = sorted(now.running, key=lambda s: (current[s.name].in_rotation, -s.index))[: len(now.running) - wanted]
    names = [s.name for s in surplus]
    c.progress(Progress(0, len(names), f"stopping {', '.join(names)} (fewer instances asked for)"))
    drain(c, names, DrainAction.HOLD)
    for name in names:
        c.supervisor.stop(name)


# --- restart, down, logs ---------------------------------------------------------------


def restart(
    layout: Layout,
    names: list[str] | None = None,
    on_progress: Report = lambda p: None,
    rolling: bool = True,
    surge: int | None = None,
) -> list[str]:
    """Restart the named programs (every instance when ``names`` is None). Instances get a
    drained restart: out of nginx's rotation first, stopped once their requests are done.
    ``rolling``: one at a time, each serving again before the next goes; otherwise all at
    once (an outage while they load). ``surge`` (default: the cluster's --surge): rolling,
    start up to that many replacements on parked slots first (see ``rollout``), the slots
    planned now if the cluster has fewer and memory allows; else drain first, said so.
    Returns what was done, a line each."""
    record = recorded(layout)
    c = Cluster.of(layout, record[0] if record else Settings(), on_progress)
    if not c.supervisor.running() or record is None:
        raise ClusterError(f"no cluster runs in {layout.root}: start it with 'cosyvoice-lb up'")
    return restart_in(c, record[1], names, rolling, c.settings.surge if surge is None else surge)


def restart_in(c: Cluster, slots: tuple[Slot, ...], names: list[str] | None, rolling: bool, surge: int) -> list[str]:
    """:func:`restart`'s steps on a running cluster: the services asked for, then the
    instances (new code staged first; a surge roll-out where it can; the rest in turn)."""
    # --all --rolling keeps capacity: each waits for the others to serve. Names given by
    # hand are restarted as asked.
    careful = names is None and rolling
    names = restartable(c, slots, names)
    done = restart_services(c, [n for n in names if n in SERVICES])
    targets = [n for n in names if n in {s.name for s in slots}]
    if targets:  # a restarted instance runs the code installed now (e.g. after a git pull)
        digest, moved = stage(c.layout.instance_lib)
        if moved:
            c.progress(Progress(0, len(targets), f"staged new instance code {digest}"))
            done.append(f"staged new instance code {digest}; the instances restarted below run it")
    if targets and rolling and surge:
        targets = surge_first(c, targets, surge, done)
    done += restart_in_turn(c, targets, rolling, careful)
    if targets or any(line.startswith("replaced") for line in done):
        pruned(c.layout, c.read_status())
    return done


def restartable(c: Cluster, slots: tuple[Slot, ...], names: list[str] | None) -> list[str]:
    """The programs to restart (every running instance for None), or why not."""
    instances = [s.name for s in slots]
    parked = {s.name for s in Slots.read(c.layout, c.supervisor, slots).parked}
    canary_state.not_restarted(c.layout, names)  # (a model roll-out's canary: the canary command's)
    names = [n for n in instances if n not in parked | canary_state.names(c.layout)] if names is None else names
    known = c.supervisor.processes()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ClusterError(f"no program named {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    idle = [n for n in names if n in parked]
    if idle:
        raise ClusterError(
            f"{', '.join(idle)} {'is' if len(idle) == 1 else 'are'} parked (a slot kept stopped for surges, or "
            "scaled in): nothing runs there to restart. If fewer instances run than the settings ask for, "
            "'cosyvoice-lb up' with them starts parked slots"
        )
    daemons = [n for n in names if n not in instances and n not in SERVICES]
    if daemons:
        raise ClusterError(
            f"{', '.join(daemons)} serves every instance on its GPU: restarting it alone would break them; "
            "'cosyvoice-lb down' then 'up' restarts the whole cluster"
        )
    return names


def restart_services(c: Cluster, services: list[str]) -> list[str]:
    for name in services:
        c.progress(Progress(0, 1, f"restarting {name}"))
        c.supervisor.stop(name)
        c.supervisor.start(name)
        if name == "nginx":  # (back where its config says, or an error)
            c.nginx.restarted(c.settings)
    return [f"restarted {n}" for n in services]


def surge_first(c: Cluster, targets: list[str], surge: int, done: list[str]) -> list[str]:
    """Replace the running targets with a surge roll-out where parked slots have room (the
    slots grown to ``surge`` first, see :func:`grown`); the targets left to restart in turn."""
    now = grown(c, surge, done)
    # (drained by hand: out of rotation already, restarted in place below)
    running = [s.name for s in now.running if s.name in targets and not drained_by_hand(c.layout, s.name)]
    free = surge_room(c, now, surge, running)
    if free and running:
        c.progress(Progress(0, len(running), f"surge roll-out: {len(free)} at a time on parked slots"))
        done += [f"replaced {line}" for line in surge_rollout(c, running, free)]
        return [n for n in targets if n not in running]  # (left: those not running, started below)
    if running:
        c.progress(Progress(0, len(running), f"--surge {surge}: {NO_SURGE}; draining first"))
        done.append(f"--surge {surge}: {NO_SURGE}; restarted draining first")
    return targets


def restart_in_turn(c: Cluster, targets: list[str], rolling: bool, careful: bool) -> list[str]:
    """Drained restarts: those not serving first (restarting them costs no capacity); rolling,
    one at a time, each serving again before the next (``careful``: and the others serving
    before each goes); else all at once."""
    current = {i.name: i for i in c.read_status().instances}
    targets = sorted(targets, key=lambda n: current[n].serving)
    done = []
    for group in [[n] for n in targets] if rolling else [targets] if targets else []:
        c.progress(Progress(0, len(group), f"restarting {', '.join(group)}"))
        if careful and current[group[0]].serving:
            others_serving(c, group[0])
        old = drain(c, group, DrainAction.TERM)
        for name in group:
            if name not in old:  # stopped (given up on after a crash loop, or crashed): start it
                c.supervisor.start(name)
        serving_or_fail(c, group, old)
        done += [f"restarted {name}" for name in group]
    return done


def grown(c: Cluster, surge: int, said: list[str]) -> Slots:
    """The slots, with parked ones planned for a ``surge`` the cluster has fewer of (as
    `up --surge N` does, which it is: the instances keep running, supervisord's config
    grows, and the cluster keeps --surge N from now on, said in ``said``)."""
    record = recorded(c.layout)
    slots = record[1] if record else ()
    now = Slots.read(c.layout, c.supervisor, slots)
    if len(now.parked) >= surge or c.settings.surge >= surge:
        return now
    up(dataclasses.replace(c.settings, surge=surge))
    record = recorded(c.layout)
    now = Slots.read(c.layout, c.supervisor, record[1] if record else slots)
    said.append(f"planned --surge {surge} (the cluster keeps it): {len(now.parked)} parked slot(s)")
    return now


def set_drained(layout: Layout, names: list[str], drained: bool) -> list[str]:
    """Drain instances by hand (out of rotation, processes kept, requests in flight finish)
    or return them; the health loop acts at its next step. Returns those whose state changed."""
    known = instance_names(layout)
    if not known:
        raise ClusterError(f"no cluster runs in {layout.root}: start it with 'cosyvoice-lb up'")
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ClusterError(f"no instance named {', '.join(unknown) or '(none given)'}; instances: {', '.join(known)}")
    changed = []
    for name in names:
        if drained_by_hand(layout, name) != drained:
            (drain_by_hand if drained else undrain)(layout, name)
            changed.append(name)
    return changed


def down(layout: Layout, timeout: float | None = None) -> list[int]:
    """Stop everything the cluster started; returns the pids that were stopped."""
    supervisor = Supervisor(layout)
    record = recorded(layout)
    pids: list[int] = []
    if supervisor.running():
        try:
            root = psutil.Process(supervisor.pid())
            tree = [root] + root.children(recursive=True)
            pids = [p.pid for p in tree]
            # Stops by priority: the health loop, then the instances (each drains), then nginx.
            supervisor.shutdown()
            bound = Timeouts(record[0] if record else Settings()).down
            processes.stop(tree, timeout=bound if timeout is None else timeout, term=False)
        except (SupervisionError, psutil.Error):  # it went away (or stopped answering) meanwhile
            pass
    # A supervisord stopped mid-start (SIGSTOP, a hang) may spawn more programs once it is
    # continued by the TERM below: sweep again until nothing of this cluster is left.
    for _sweep in range(3):
        strays = processes.stray_processes(layout, record[0].port if record else None)
        if not strays:
            break
        pids += [p.pid for p in strays]
        processes.stop(strays, timeout=10)
    layout.socket.unlink(missing_ok=True)
    layout.admin_socket.unlink(missing_ok=True)
    layout.overflow_socket.unlink(missing_ok=True)
    end_rollout(layout)
    return pids


def instance_names(layout: Layout) -> list[str]:
    record = recorded(layout)
    return [s.name for s in record[1]] if record else []


def log_names(layout: Layout) -> list[str]:
    return sorted(p.stem for p in layout.logs.glob("*.log"))
