#!/usr/bin/env python3
"""Chaos run: a real espeak cluster under a bounded API load while faults are injected one
at a time, and a table of what the clients saw.

    python bench/chaos.py [--instances 3] [--clients 4] [--traffic both|varied|common]
                          [--only NAME[,NAME]] [--csv PATH] [--keep-logs DIR]

It starts its own cluster with the CLI (``cosyvoice-lb up --engine espeak``) on a free
127.0.0.1 port block below the kernel's ephemeral range and a short state dir under /tmp, and always takes it
down again (``cosyvoice-lb down``) and removes the state dir, also on errors, Ctrl-C and
SIGTERM (a process it SIGSTOPped is SIGKILLed first).

Scenarios, in this order, each on its own:

  kill-instance     SIGKILL one instance process
  stop-instance     SIGSTOP one instance (the health loop takes it out and kills it)
  stuck-synthesis   SIGSTOP one instance's espeak-ng child: its HTTP stays alive, one
                    synthesis makes no progress (the health loop's hang detection)
  kill-nginx        SIGKILL the nginx master (its orphaned workers keep the port)
  kill-health       SIGKILL the health loop
  rolling-restart   ``cosyvoice-lb restart --all --rolling``
  poison-request    one request that hangs whichever instance runs it (the cluster's PATH
                    starts with an espeak-ng wrapper that stops itself on that request's
                    voice and rate and execs the real one otherwise): it must cost at most
                    one retry -- exactly two restarts -- then its client gets a 422 that says
                    why; sent again, a 422 with no restart
  recycling         ``cosyvoice-lb up`` again with --max-requests 40 --max-requests-jitter 10,
                    until two recycling restarts were seen (D/run/instance-N.starts); last,
                    since the cluster keeps recycling afterwards

Traffic: ``varied`` clients cycle through a dozen different sentences; ``common`` clients
all send one sentence, as real traffic often does (an IVR prompt, a greeting, a UI's
default text), so most faults strike with that text in flight on the instance hit: the
poison rule must never refuse it (see cosyvoice_lb/instance/speech/poison.py). ``both`` (the default) makes
two whole runs, each on a fresh cluster, and one table with a row per scenario and traffic.

Per scenario: wait until the cluster is fully serving (what ``cosyvoice-lb status`` exits 0
on); K clients POST /v1/tts through nginx; 2 s of baseline; inject; poll
``status()`` every 0.2 s until the target is back; 2 s more; stop the clients.

Columns: "out of rotation s" is the time from the fault until the instance hit was first
seen out of rotation or replaced (how fast the fault is noticed) -- for rolling-restart and
recycling the longest single period any instance spent out of rotation; for nginx and the
health loop there is no rotation to leave (—); "back serving s" is the time from the fault until the
target serves again (rolling-restart: until all are back with new pids; recycling: until
two restarts were seen and all but at most one instance serve -- one recycles at a time,
and at ~100 requests/s one nearly always is).

poison-request takes two instances out at once by design (the first run and the one retry):
while both reload, the one left sheds what it cannot queue with 503 + Retry-After; those are
counted and reported, and any other failure is a miss.

Exit 0 when every scenario recovered, no scenario but kill-nginx had a failed request (but
poison-request's 503s) and
kill-nginx's refused window (first failed request's start to last one's end) is at most
1 s; else 1, naming each missed target. The last line is always
``chaos: N scenarios, F failed requests of R``.
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import requests

from cosyvoice_lb.instance.engines.espeak import BASE_WPM
from cosyvoice_lb.launcher.cluster.status import ClusterStatus, InstanceStatus, status
from cosyvoice_lb.launcher.state.layout import Layout, layout_for
from cosyvoice_lb.launcher.state.processes import orphan_nginx, stray_processes
from load import Interrupted, cli_command, free_port_block, shielded, stop_on_sigterm  # bench/load.py

# --- bounds ------------------------------------------------------------------------------

SCENARIO_CAP_S = 120.0  # one scenario, baseline and tail load included (not the wait before)
RECOVERY_S = 110.0  # how long a fault may take to heal
RECYCLING_S = 90.0  # how long the recycling scenario waits for its restarts
SERVING_WAIT_S = 120.0  # for the cluster to serve fully before a scenario
BASELINE_S = 2.0
TAIL_S = 2.0
POLL_S = 0.2
POLL_WORKERS = 6  # overlapping status calls: one blocks --probe-timeout on a stopped instance
MAX_REQUESTS = 15000  # per scenario: above 120 s at the ~100 requests/s 4 clients reach on 2 cores
CLIENT_TIMEOUT_S = 60.0
FAIL_PAUSE_S = 0.05  # a client pauses this long after a failure (no hot loop on refusals)
ESPEAK_SEARCH_S = 15.0
NGINX_WINDOW_TARGET_S = 1.0
RECYCLE_RESTARTS = 2
UP_TIMEOUT_S = 300.0
DOWN_TIMEOUT_S = 180.0

HANG_TIMEOUT = "5"
REQUEST_TIMEOUT = "30"

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Please leave the package at the front door.",
    "Our train leaves at half past seven tomorrow.",
    "Turn left at the second traffic light.",
    "The weather will be sunny with a light breeze.",
    "Thank you for calling, how can I help you today?",
    "The meeting has been moved to Thursday afternoon.",
    "Remember to water the plants before you leave.",
    "A cup of tea sounds lovely right now.",
    "The library closes early on public holidays.",
    "Your order number is four five six seven.",
    "Keep calm and carry on speaking clearly.",
)
COMMON_TEXT = "Thank you for calling, how can I help you today?"
TRAFFIC = {"varied": SENTENCES, "common": (COMMON_TEXT,)}

# --- the cluster -------------------------------------------------------------------------


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE_LB_")}


@dataclass
class Run:
    """One chaos run's cluster, and everything it started or stopped (cleaned up at the end)."""

    cli: list[str]
    instances: int
    clients: int
    texts: tuple[str, ...]
    state_dir: Path
    port: int
    base_port: int
    up_args: list[str] = field(default_factory=list)
    children: list[subprocess.Popen] = field(default_factory=list)
    stopped: list[psutil.Process] = field(default_factory=list)

    @property
    def layout(self) -> Layout:
        return layout_for(str(self.state_dir))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, *args: str) -> list[str]:
        return [*self.cli, *args]

    @property
    def hung_pids(self) -> Path:
        """Where the espeak-ng wrapper notes the pid of each poison run it hung."""
        return self.state_dir / "hung-espeak.pids"

    def env(self) -> dict[str, str]:
        """The cluster's environment: the espeak-ng wrapper first on PATH."""
        env = clean_env()
        env["PATH"] = f"{self.state_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["CVLB_CHAOS_HUNG_PIDS"] = str(self.hung_pids)
        return env

    def spawn(self, *args: str) -> subprocess.Popen:
        """A CLI command in the background; its output is kept for the notes."""
        proc = subprocess.Popen(
            self.command(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env()
        )
        self.children.append(proc)
        return proc

    def suspend(self, proc: psutil.Process) -> None:
        self.stopped.append(proc)
        proc.suspend()


def prepare(instances: int, clients: int, texts: tuple[str, ...] = SENTENCES) -> Run:
    base = free_port_block(instances + 1)
    state_dir = Path(tempfile.mkdtemp(prefix="cx", dir="/tmp"))  # short: supervisord's socket lives in it
    run = Run(
        cli=cli_command(),
        instances=instances,
        clients=clients,
        texts=texts,
        state_dir=state_dir,
        port=base,
        base_port=base + 1,
    )
    install_espeak_wrapper(state_dir / "bin")
    # --request-timeout bounds each request's total wait (all retries included), so a
    # client never waits on a stuck instance longer than that.
    run.up_args = [
        "up",
        "--engine",
        "espeak",
        "--instances",
        str(instances),
        "--host",
        "127.0.0.1",
        "--port",
        str(run.port),
        "--base-port",
        str(run.base_port),
        "--state-dir",
        str(state_dir),
        "--hang-timeout",
        HANG_TIMEOUT,
        "--request-timeout",
        REQUEST_TIMEOUT,
    ]
    return run


def install_espeak_wrapper(bin_dir: Path) -> None:
    """An ``espeak-ng`` first on the cluster's PATH: the poison request's run (its voice and
    rate, see POISON_WPM) stops itself, a synthesis that hangs on that input wherever it runs,
    caught every time; every other call is the real espeak-ng, exec'd (the same pid)."""
    real = shutil.which("espeak-ng")
    if real is None:
        raise RuntimeError("espeak-ng not found: install it (apt-get install espeak-ng)")
    bin_dir.mkdir()
    wrapper = bin_dir / "espeak-ng"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'case " $* " in *" -v cmn-latn-pinyin -s {POISON_WPM} "*)\n'
        '    echo $$ >> "$CVLB_CHAOS_HUNG_PIDS"; kill -STOP $$ ;;\n'
        "esac\n"
        f'exec {shlex.quote(real)} "$@"\n'
    )
    wrapper.chmod(0o755)


def hung_poison_runs(run: Run) -> list[psutil.Process]:
    """The poison runs the wrapper stopped, still there (the pid checked against its command)."""
    try:
        pids = [int(line) for line in run.hung_pids.read_text().split()]
    except (OSError, ValueError):
        return []
    hung = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if POISON_WPM in proc.cmdline():
                hung.append(proc)
        except psutil.Error:
            continue
    return hung


def start_cluster(run: Run) -> None:
    done = subprocess.run(
        run.command(*run.up_args), capture_output=True, text=True, timeout=UP_TIMEOUT_S, env=run.env(), check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"cosyvoice-lb up exited {done.returncode}:\n{tail(done.stdout + done.stderr, 20)}")


def teardown(run: Run, keep_logs: str | None) -> None:
    """Everything this run started or stopped goes, whatever happened (a second Ctrl-C or
    SIGTERM included)."""
    with shielded():
        _teardown(run, keep_logs)


def _teardown(run: Run, keep_logs: str | None) -> None:
    for proc in [*run.stopped, *hung_poison_runs(run)]:  # stopped: KILL works on a stopped process
        kill(proc)
    for child in run.children:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)
    try:
        down = subprocess.run(
            run.command("down", "--state-dir", str(run.state_dir)),
            capture_output=True,
            text=True,
            timeout=DOWN_TIMEOUT_S,
            env=clean_env(),
            check=False,
        )
        log(f"down: {(down.stdout + down.stderr).strip()}")
    except subprocess.TimeoutExpired:
        log(f"down did not finish within {DOWN_TIMEOUT_S:.0f}s")
    left = stray_processes(run.layout, run.port)  # what down missed: ours, so it goes too
    if left:
        log(f"down left {len(left)} process(es) behind (pids {', '.join(str(p.pid) for p in left)}): killing them")
        for proc in left:
            kill(proc)
    if keep_logs and run.layout.logs.is_dir():
        shutil.copytree(run.layout.logs, keep_logs, dirs_exist_ok=True)
        log(f"logs kept in {keep_logs}")
    shutil.rmtree(run.state_dir, ignore_errors=True)


def kill(proc: psutil.Process) -> bool:
    """SIGKILL ``proc`` if it still runs (is_running also checks it is the same process)."""
    try:
        if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
            proc.kill()
            return True
    except psutil.Error:
        pass
    return False


def count_lines(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def tail(text: str, lines: int = 3) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def wait_serving(layout: Layout, within: float) -> tuple[ClusterStatus | None, str]:
    """The first status that would make ``cosyvoice-lb status`` exit 0, or None and why not."""
    deadline = time.monotonic() + within
    problems = "no status yet"
    while time.monotonic() < deadline:
        try:
            current = status(layout)
        except Exception as exc:  # supervisord busy restarting something: ask again
            problems = f"status failed: {exc}"
        else:
            if current.exit_code == 0:
                return current, ""
            problems = "; ".join(current.problems)
        time.sleep(0.5)
    return None, problems


# --- the load ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    start: float  # time.monotonic()
    end: float
    outcome: str  # "200", another status code, or the exception's kind

    @property
    def ok(self) -> bool:
        return self.outcome == "200"


def error_kind(exc: Exception) -> str:
    text = str(exc).lower()
    for key in ("refused", "reset", "aborted", "disconnected", "timed out"):
        if key in text:
            return f"{type(exc).__name__}({key})"
    return type(exc).__name__


class Load:
    """K client threads, each with its own session, posting /v1/tts until stopped or
    ``limit`` requests were made. Every request is recorded."""

    def __init__(
        self,
        url: str,
        clients: int,
        limit: int = MAX_REQUESTS,
        seconds: float = SCENARIO_CAP_S + CLIENT_TIMEOUT_S,
        texts: tuple[str, ...] = SENTENCES,
    ):
        self.url = url + "/v1/tts"
        self.limit, self.texts = limit, texts
        self.deadline = time.monotonic() + seconds
        self.records: list[Request] = []
        self.issued = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        until = time.monotonic() + CLIENT_TIMEOUT_S + 5
        for thread in self.threads:
            thread.join(timeout=max(0.0, until - time.monotonic()))

    def take_turn(self) -> bool:
        with self.lock:
            if self.stopping.is_set() or self.issued >= self.limit or time.monotonic() > self.deadline:
                return False
            self.issued += 1
            return True

    def client(self, index: int) -> None:
        session = requests.Session()
        session.trust_env = False
        turn = 0
        try:
            while self.take_turn():
                text = self.texts[(index * 5 + turn) % len(self.texts)]
                turn += 1
                record = self.post(session, text)
                with self.lock:
                    self.records.append(record)
                if not record.ok:
                    self.stopping.wait(FAIL_PAUSE_S)
        finally:
            session.close()

    def post(self, session: requests.Session, text: str) -> Request:
        start = time.monotonic()
        try:
            response = session.post(self.url, json={"text": text}, timeout=CLIENT_TIMEOUT_S)
            outcome = str(response.status_code)
            if response.ok and response.headers.get("content-type") != "audio/wav":
                outcome += " (not audio/wav)"
        except requests.RequestException as exc:
            outcome = error_kind(exc)
        return Request(start, time.monotonic(), outcome)


# --- watching a fault heal ---------------------------------------------------------------


@dataclass(frozen=True)
class Observation:
    t: float  # seconds after the fault when this status call began
    status: ClusterStatus


def observe(layout: Layout, t0: float) -> Observation | None:
    t = time.monotonic() - t0
    try:
        return Observation(t, status(layout))
    except Exception:  # e.g. supervisord's socket busy: one poll less
        return None


def watch(
    layout: Layout, t0: float, recovered: Callable[[ClusterStatus], bool], within: float
) -> tuple[list[Observation], float | None]:
    """Poll the cluster every POLL_S (calls may overlap) until ``recovered`` holds or
    ``within`` seconds after the fault passed; returns the observations in time order and
    when (seconds after the fault) the first recovered one was taken."""
    observations: list[Observation] = []
    back: float | None = None
    pending: set[Future] = set()

    def collect(futures: set[Future]) -> None:
        nonlocal back
        for future in futures:
            item = future.result()
            if item is None:
                continue
            observations.append(item)
            if recovered(item.status) and (back is None or item.t < back):
                back = item.t

    with ThreadPoolExecutor(max_workers=POLL_WORKERS) as pool:
        while back is None and time.monotonic() - t0 < within:
            finished = {f for f in pending if f.done()}
            pending -= finished
            collect(finished)
            if back is None and len(pending) < POLL_WORKERS:
                pending.add(pool.submit(observe, layout, t0))
            time.sleep(POLL_S)
    collect(pending)  # the pool has waited for them
    return sorted(observations, key=lambda o: o.t), back


def longest_out(observations: list[Observation]) -> float:
    """The longest single period any instance spent not serving (ready and in rotation)."""
    longest, since = 0.0, {}
    for item in observations:
        for inst in item.status.instances:
            if not inst.serving:
                since.setdefault(inst.name, item.t)
            elif inst.name in since:
                longest = max(longest, item.t - since.pop(inst.name))
    end = observations[-1].t if observations else 0.0
    return max([longest, *(end - t for t in since.values())])


# --- faults ------------------------------------------------------------------------------


class InjectError(RuntimeError):
    """The fault could not be injected (the scenario then counts as missed)."""


@dataclass
class Fault:
    """What one injection disturbed, as predicates over one status observation."""

    disturbed: Callable[[ClusterStatus], bool]
    recovered: Callable[[ClusterStatus], bool]
    within: float = RECOVERY_S
    fleet: bool = False  # report the longest out-of-rotation period of any instance
    rotation: bool = True  # False: a service, not an instance, was hit: no rotation to leave
    finish: Callable[[Fault], None] = lambda fault: None  # after recovery: clean up, add notes
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # missed targets beyond failures and recovery


def pick(before: ClusterStatus, index: int) -> InstanceStatus:
    return before.instances[index % len(before.instances)]


def instance_fault(target: InstanceStatus, leftover: psutil.Process | None = None, what: str = "") -> Fault:
    """One instance hit: out when not in rotation or replaced; back with a new pid, ready
    and in rotation. ``leftover``: a process we stopped, killed after recovery if it lives."""

    def current(status: ClusterStatus) -> InstanceStatus | None:
        return status.instance(target.name)

    def disturbed(status: ClusterStatus) -> bool:
        item = current(status)
        return item is None or item.pid != target.pid or not item.in_rotation

    def recovered(status: ClusterStatus) -> bool:
        item = current(status)
        return item is not None and item.pid not in (0, target.pid) and item.serving

    def finish(fault: Fault) -> None:
        if leftover is not None and kill(leftover):
            fault.notes.append(f"{what} (pid {leftover.pid}) was still there: killed it")

    return Fault(disturbed, recovered, finish=finish)


def service_fault(name: str, old_pid: int, healthy: Callable[[ClusterStatus, int], bool]) -> Fault:
    """nginx or the health loop killed: back when RUNNING with a new pid and ``healthy``."""

    def disturbed(status: ClusterStatus) -> bool:
        info = getattr(status, name)
        return info.get("state") != "RUNNING" or info.get("pid") != old_pid or not healthy(status, old_pid)

    def recovered(status: ClusterStatus) -> bool:
        info = getattr(status, name)
        pid = info.get("pid", 0)
        return info.get("state") == "RUNNING" and pid not in (0, old_pid) and healthy(status, pid)

    return Fault(disturbed, recovered, rotation=False)


def kill_instance(run: Run, before: ClusterStatus) -> Fault:
    target = pick(before, 0)
    os.kill(target.pid, signal.SIGKILL)
    return instance_fault(target)


def stop_instance(run: Run, before: ClusterStatus) -> Fault:
    target = pick(before, 1)
    proc = psutil.Process(target.pid)
    run.suspend(proc)
    return instance_fault(target, proc, "the stopped instance")


def stuck_synthesis(run: Run, before: ClusterStatus) -> Fault:
    target = pick(before, 2)
    child = stop_espeak_child(run, target)
    return instance_fault(target, child, "the stopped espeak-ng")


def stop_espeak_child(run: Run, target: InstanceStatus) -> psutil.Process:
    """SIGSTOP one of the short-lived espeak-ng processes the instance runs per synthesis."""
    parent = psutil.Process(target.pid)
    deadline = time.monotonic() + ESPEAK_SEARCH_S
    while time.monotonic() < deadline:
        try:
            children = parent.children()
        except psutil.Error as exc:
            raise InjectError(f"{target.name} (pid {target.pid}) went away: {exc}") from None
        for child in children:
            try:
                if child.name() != "espeak-ng":
                    continue
                run.suspend(child)
                if stopped(child):
                    return child
            except psutil.Error:
                continue  # it finished first: wait for the next one
        time.sleep(0.002)
    raise InjectError(f"no espeak-ng child of {target.name} seen within {ESPEAK_SEARCH_S:.0f}s")


def stopped(proc: psutil.Process) -> bool:
    """Whether SIGSTOP took (not when the process had already exited)."""
    for _ in range(50):
        if proc.status() == psutil.STATUS_STOPPED:
            return True
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        time.sleep(0.001)
    return False


def kill_nginx(run: Run, before: ClusterStatus) -> Fault:
    old = before.nginx["pid"]
    os.kill(old, signal.SIGKILL)

    def healthy(status: ClusterStatus, pid: int) -> bool:  # answers, and no orphan of old holds the port
        return status.nginx.get("answers") == 200 and (pid == old or not orphan_nginx(run.port, pid))

    return service_fault("nginx", old, healthy)


def kill_health(run: Run, before: ClusterStatus) -> Fault:
    old = before.health["pid"]
    os.kill(old, signal.SIGKILL)
    return service_fault("health", old, lambda status, pid: True)


# Only this request speaks Chinese at this rate, so the espeak-ng wrapper knows its command
# line (-v cmn-latn-pinyin -s POISON_WPM); an instance's warm-up speaks Chinese too, at the
# base rate, and must not hang.
POISON_TEXT = "这句话每次都会卡住，无论哪个实例来合成它，都会一直等下去。" * 6
POISON_SPEED = 0.85
POISON_WPM = str(round(BASE_WPM * POISON_SPEED))


def poison_request(run: Run, before: ClusterStatus) -> Fault:
    """A request that hangs whichever instance runs it (the espeak-ng wrapper stops its run),
    sent once, then once more, while the load runs."""
    names = [i.name for i in before.instances]
    starts_before = {n: count_lines(run.state_dir / "run" / f"{n}.starts") for n in names}
    answers: list[requests.Response | Exception] = []
    done = threading.Event()

    def send() -> None:
        with requests.Session() as session:
            session.trust_env = False
            for _ in range(2):  # as a client that retries what failed
                try:
                    answers.append(
                        session.post(
                            run.url + "/v1/tts",
                            json={"text": POISON_TEXT, "speed": POISON_SPEED},
                            timeout=CLIENT_TIMEOUT_S + 10,
                        )
                    )
                except requests.RequestException as exc:
                    answers.append(exc)
        done.set()

    threading.Thread(target=send, daemon=True).start()

    def restarts() -> int:
        return sum(count_lines(run.state_dir / "run" / f"{n}.starts") - starts_before[n] for n in names)

    def recovered(status: ClusterStatus) -> bool:
        return done.is_set() and all(i.serving for i in status.instances)

    def finish(fault: Fault) -> None:
        done.set()
        shown = [a.status_code if isinstance(a, requests.Response) else type(a).__name__ for a in answers]
        fault.notes.append(f"poison answers {shown}, {restarts()} restart(s)")
        if len(answers) != 2 or not all(
            isinstance(a, requests.Response) and a.status_code == 422 and "crashed or hung" in a.text for a in answers
        ):
            fault.problems.append(f"the poison request's answers were {shown}, not 422 twice")
        if restarts() != 2:
            fault.problems.append(f"the poison request cost {restarts()} restarts, not 2 (the first run, one retry)")

    return Fault(lambda status: not all(i.serving for i in status.instances), recovered, finish=finish)


def fleet_fault(
    proc: subprocess.Popen,
    label: str,
    settled: Callable[[ClusterStatus], bool],
    within: float = RECOVERY_S,
    may_be_out: int = 0,
    counted: Callable[[], str] = lambda: "",
) -> Fault:
    """A CLI command that restarts instances: back when it exited, ``settled`` holds and
    every instance but ``may_be_out`` serves; it must exit 0. ``counted``: a note."""

    def recovered(status: ClusterStatus) -> bool:
        out = sum(not i.serving for i in status.instances)
        return proc.poll() is not None and settled(status) and out <= may_be_out

    def finish(fault: Fault) -> None:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate(timeout=30)[0] or ""
        if proc.returncode != 0:
            fault.problems.append(f"{label} exited {proc.returncode}: {tail(output, 1)}")
        note = counted()
        if note:
            fault.notes.append(note)

    return Fault(
        lambda status: not all(i.serving for i in status.instances), recovered, within=within, fleet=True, finish=finish
    )


def rolling_restart(run: Run, before: ClusterStatus) -> Fault:
    proc = run.spawn("restart", "--all", "--rolling", "--state-dir", str(run.state_dir))
    old = {i.name: i.pid for i in before.instances}
    return fleet_fault(
        proc, "restart --all --rolling", lambda status: all(i.pid != old[i.name] for i in status.instances)
    )


def recycling(run: Run, before: ClusterStatus) -> Fault:
    proc = run.spawn(*run.up_args, "--max-requests", "40", "--max-requests-jitter", "10")
    names = [i.name for i in before.instances]
    baseline: dict[str, int] = {}

    def starts() -> dict[str, int]:  # each instance appends a line to D/run/NAME.starts when it starts
        return {name: count_lines(run.state_dir / "run" / f"{name}.starts") for name in names}

    def recycled() -> dict[str, int]:
        now = starts()
        return {n: now[n] - baseline[n] for n in names} if baseline else {}

    def settled(status: ClusterStatus) -> bool:  # restarts counted from when `up` is done
        if not baseline:
            baseline.update(starts())
            return False
        return sum(recycled().values()) >= RECYCLE_RESTARTS

    def counted() -> str:
        per = recycled()
        if not per:
            return "no restarts counted (up had not finished)"
        return f"{sum(per.values())} recycling restarts (" + ", ".join(f"{n} {c}" for n, c in per.items()) + ")"

    # One instance at a time recycles, and at this load one almost always is: back means
    # two restarts seen and every instance but (at most) one serving.
    return fleet_fault(proc, "up --max-requests", settled, within=RECYCLING_S, may_be_out=1, counted=counted)


@dataclass(frozen=True)
class Scenario:
    name: str
    inject: Callable[[Run, ClusterStatus], Fault]
    judged_by_window: bool = False  # failures allowed within NGINX_WINDOW_TARGET_S
    # Two instances down at once by design: 503s that shed load (Retry-After) are allowed, reported.
    sheds_load: bool = False


SCENARIOS = (
    Scenario("kill-instance", kill_instance),
    Scenario("stop-instance", stop_instance),
    Scenario("stuck-synthesis", stuck_synthesis),
    Scenario("kill-nginx", kill_nginx, judged_by_window=True),
    Scenario("kill-health", kill_health),
    Scenario("rolling-restart", rolling_restart),
    # (before recycling, which leaves the cluster recycling every ~40 requests)
    Scenario("poison-request", poison_request, sheds_load=True),
    Scenario("recycling", recycling),
)

# --- one scenario ------------------------------------------------------------------------


@dataclass
class ScenarioResult:
    name: str
    traffic: str = "varied"
    requests: int = 0
    failed: int = 0
    p50_ms: float | None = None
    p99_ms: float | None = None
    out_s: float | None = None
    back_s: float | None = None
    recovered: bool = False
    window_s: float = 0.0  # first failed request's start to the last one's end
    errors: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)

    COLUMNS = (
        "scenario",
        "traffic",
        "requests",
        "failed",
        "p50 ms",
        "p99 ms",
        "out of rotation s",
        "back serving s",
        "note",
    )

    def row(self) -> list[str]:
        def num(value: float | None, digits: int) -> str:
            return "—" if value is None else f"{value:.{digits}f}"

        return [
            self.name,
            self.traffic,
            str(self.requests),
            str(self.failed),
            num(self.p50_ms, 0),
            num(self.p99_ms, 0),
            num(self.out_s, 1),
            num(self.back_s, 1) if self.recovered else "not back",
            "; ".join(self.notes),
        ]


def summarize(
    scenario: Scenario,
    records: list[Request],
    fault: Fault,
    observations: list[Observation],
    back: float | None,
    t0: float,
) -> ScenarioResult:
    result = ScenarioResult(scenario.name, requests=len(records), recovered=back is not None, back_s=back)
    if records:
        durations = np.array([(r.end - r.start) * 1000 for r in records])
        result.p50_ms, result.p99_ms = (float(v) for v in np.percentile(durations, [50, 99]))
        if durations.max() > 1000:  # e.g. the request stuck on a hung instance, then retried
            result.notes.append(f"slowest {durations.max() / 1000:.1f} s")
    failed = [r for r in records if not r.ok]
    result.failed = len(failed)
    result.errors = Counter(r.outcome for r in failed)
    if failed:
        result.window_s = max(r.end for r in failed) - min(r.start for r in failed)
        log_failures(scenario.name, failed, t0)
    if not fault.rotation:
        result.out_s = None
    elif fault.fleet:
        result.out_s = longest_out(observations) if observations else None
    else:
        result.out_s = next((o.t for o in observations if fault.disturbed(o.status)), None)
    judge(scenario, result, fault)
    return result


def log_failures(name: str, failed: list[Request], t0: float, first: int = 5) -> None:
    """The first few failures, stamped to match the cluster's logs."""
    wall = time.time() - time.monotonic()
    for r in sorted(failed, key=lambda r: r.end)[:first]:
        stamp = time.strftime("%H:%M:%S", time.localtime(wall + r.end)) + f".{int((wall + r.end) % 1 * 1000):03d}"
        log(
            f"{name}: failed at {stamp} (+{r.end - t0:.2f} s after the fault, "
            f"{(r.end - r.start) * 1000:.0f} ms): {r.outcome}"
        )


def judge(scenario: Scenario, result: ScenarioResult, fault: Fault) -> None:
    """Notes and missed targets of one scenario."""
    if scenario.judged_by_window:
        result.notes.append(f"refused window {result.window_s:.2f} s")
        if result.window_s > NGINX_WINDOW_TARGET_S:
            result.missed.append(f"refused window {result.window_s:.2f} s > {NGINX_WINDOW_TARGET_S:g} s")
    elif scenario.sheds_load:
        shed = result.errors.get("503", 0)
        if shed:
            result.notes.append(f"{shed} shed with 503 + Retry-After while two instances were out")
        if result.failed > shed:
            result.missed.append(f"{result.failed - shed} failed request(s) other than 503")
    elif result.failed:
        result.missed.append(f"{result.failed} failed request(s)")
    if result.errors:
        result.notes.append("errors: " + ", ".join(f"{k}×{n}" for k, n in result.errors.most_common(4)))
    if not result.recovered:
        result.notes.append(f"not back within {fault.within:.0f} s")
        result.missed.append(f"not recovered within {fault.within:.0f} s")
    result.notes += fault.notes + fault.problems
    result.missed += fault.problems


def not_run(name: str, why: str) -> ScenarioResult:
    return ScenarioResult(name, notes=[why], missed=[why])


def run_scenario(run: Run, scenario: Scenario) -> ScenarioResult:
    before, why = wait_serving(run.layout, SERVING_WAIT_S)
    if before is None:
        return not_run(scenario.name, f"cluster not fully serving within {SERVING_WAIT_S:.0f}s: {why}")
    log(f"{scenario.name}: load on, {BASELINE_S:g} s baseline")
    began = time.monotonic()
    observations: list[Observation] = []
    back = None
    with Load(run.url, run.clients, texts=run.texts) as load:
        time.sleep(BASELINE_S)
        try:
            fault = scenario.inject(run, before)
        except (InjectError, psutil.Error, OSError) as exc:
            fault = Fault(lambda s: False, lambda s: False, within=0.0, problems=[f"not injected: {exc}"])
        t0 = time.monotonic()
        log(f"{scenario.name}: injected, watching")
        within = min(fault.within, SCENARIO_CAP_S - TAIL_S - (t0 - began))
        fault.within = max(0.0, within)
        if fault.within:
            observations, back = watch(run.layout, t0, fault.recovered, fault.within)
        fault.finish(fault)
        log(
            f"{scenario.name}: "
            + (f"back after {back:.1f} s" if back is not None else "NOT back")
            + f", {TAIL_S:g} s more load"
        )
        time.sleep(TAIL_S)
    records = list(load.records)
    if load.issued >= load.limit:
        fault.notes.append(f"the load stopped at its cap of {load.limit} requests")
    if any(t.is_alive() for t in load.threads):
        fault.notes.append("a client was still waiting at the end")
    return summarize(scenario, records, fault, observations, back, t0)


# --- report ------------------------------------------------------------------------------


def markdown(rows: list[list[str]]) -> str:
    header = list(ScenarioResult.COLUMNS)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def write_csv(path: str, rows: list[list[str]]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(ScenarioResult.COLUMNS)
        writer.writerows(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    names = [s.name for s in SCENARIOS]
    parser = argparse.ArgumentParser(
        description="Chaos run against a real espeak cluster on 127.0.0.1.", epilog="scenarios: " + ", ".join(names)
    )
    parser.add_argument("--instances", type=int, default=3, help="instances in the cluster (default 3)")
    parser.add_argument("--clients", type=int, default=4, help="client threads of the load (default 4)")
    parser.add_argument(
        "--traffic",
        choices=("both", *TRAFFIC),
        default="both",
        help="what the clients send: a dozen different sentences, one common sentence, or a run of each (default both)",
    )
    parser.add_argument("--only", default="", help="comma-separated scenarios to run (default: all, in order)")
    parser.add_argument("--csv", help="also write the table's rows to this CSV file")
    parser.add_argument("--keep-logs", metavar="DIR", help="copy the cluster's logs here before its state dir goes")
    args = parser.parse_args(argv)
    wanted = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(names)}")
    if args.instances < 2 or args.clients < 1:
        parser.error("--instances must be at least 2 (one is taken out) and --clients at least 1")
    args.scenarios = [s for s in SCENARIOS if not wanted or s.name in wanted]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()  # so the cluster still goes down
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    results: list[ScenarioResult] = []
    setup_missed: list[str] = []
    kinds = list(TRAFFIC) if args.traffic == "both" else [args.traffic]
    print(
        f"settings: {args.instances} instances, {args.clients} clients, traffic {', '.join(kinds)}, scenarios "
        f"{','.join(s.name for s in args.scenarios)}; per scenario at most {MAX_REQUESTS} requests and "
        f"{SCENARIO_CAP_S:.0f} s, client timeout {CLIENT_TIMEOUT_S:.0f} s"
    )
    for kind in kinds:
        if not chaos_run(args, kind, results, setup_missed):
            break
    return report(results, setup_missed, args.csv)


def chaos_run(args: argparse.Namespace, kind: str, results: list[ScenarioResult], setup_missed: list[str]) -> bool:
    """Every scenario on a fresh cluster whose clients send ``kind`` of traffic; False when
    interrupted."""
    run = prepare(args.instances, args.clients, TRAFFIC[kind])
    keep_logs = os.path.join(args.keep_logs, kind) if args.keep_logs else None
    try:
        print(f"cluster ({kind} traffic): " + shlex.join(["cosyvoice-lb", *run.up_args]))
        sys.stdout.flush()
        log(f"{kind} traffic: starting the cluster in {run.state_dir}")
        start_cluster(run)
        for scenario in args.scenarios:
            try:
                result = run_scenario(run, scenario)
            except Exception as exc:  # a harness bug must not leave the cluster up or hide the rest
                result = not_run(scenario.name, f"harness error: {type(exc).__name__}: {exc}")
            result.traffic = kind
            results.append(result)
    except Exception as exc:
        setup_missed.append(f"setup ({kind} traffic): {exc}")
    except (KeyboardInterrupt, Interrupted):
        setup_missed.append(f"interrupted after {len(results)} scenario(s)")
        return False
    finally:
        teardown(run, keep_logs)
    return True


def report(results: list[ScenarioResult], setup_missed: list[str], csv_path: str | None) -> int:
    rows = [r.row() for r in results]
    print()
    print(markdown(rows))
    if csv_path:
        write_csv(csv_path, rows)
    missed = setup_missed + [f"{r.name} ({r.traffic} traffic): {m}" for r in results for m in r.missed]
    print()
    for item in missed:
        print(f"missed: {item}")
    failed = sum(r.failed for r in results)
    print(f"chaos: {len(results)} scenarios, {failed} failed requests of {sum(r.requests for r in results)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
