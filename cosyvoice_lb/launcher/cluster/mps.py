"""One CUDA MPS control daemon for one GPU, as a supervisord program; and what clients need.

    python -m cosyvoice_lb.launcher.cluster.mps --gpu N --pipe-dir DIR --log-dir DIR [--control PATH] [--stop-timeout S]

With MPS the instances on a GPU run their kernels concurrently instead of time-slicing the
card. The daemon runs in the foreground (``nvidia-cuda-mps-control -f``) as this process's
child, so supervisord sees it live and die. Stopping is the documented way: ``quit`` on the
control client's stdin, then SIGKILL if the daemon is still there after --stop-timeout.
Exit status: 0 after a clean stop, the daemon's own non-zero status when it died by itself
(supervisord restarts it), 1 when it had to be killed.

What clients and the daemon need in their environment, and whether this box can run MPS, are
in ``plan/mps_env.py`` (pure): the renderer and the preflight use them.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from cosyvoice_lb.launcher.plan.mps_env import CONTROL, daemon_env, mps_problem

QUIT_TIMEOUT = 5.0  # seconds the `quit` client may take (capped by --stop-timeout)
POLL = 0.1  # seconds between two looks at the daemon and the stop flag

log = logging.getLogger("cosyvoice_lb.mps")


def private_dir(path: Path) -> None:
    """``path`` and any missing parent, created 0700: the pipe dir is the daemon's door."""
    for missing in reversed([p for p in (path, *path.parents) if not p.exists()]):
        missing.mkdir(mode=0o700, exist_ok=True)
    path.chmod(0o700)


class StopFlag:
    """Set by SIGTERM or SIGINT. The handler only records the signal: the main loop acts
    (an Event's lock could deadlock against the main thread inside a handler)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.signum = self.signum or signum

    def install(self) -> StopFlag:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self)
        return self


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: killed by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def ask_quit(control: str, env: dict[str, str], timeout: float) -> None:
    """``echo quit | CONTROL``, bounded by ``timeout``: the daemon then stops its servers and exits."""
    try:
        done = subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("%s did not take quit within %gs", control, timeout)
    except OSError as exc:
        log.warning("cannot run %s to send quit: %s", control, exc)
    else:
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            log.warning("%s quit exited %d%s", control, done.returncode, f": {said[-1]}" if said else "")


def supervise(
    daemon: subprocess.Popen[bytes], stop: StopFlag, control: str, env: dict[str, str], stop_timeout: float
) -> int:
    """Wait until the daemon dies or a stop is asked; then stop it. Returns the exit status."""
    while stop.signum is None:
        try:
            code = daemon.wait(timeout=POLL)
        except subprocess.TimeoutExpired:
            continue
        log.error("daemon (pid %d) exited on its own with status %d", daemon.pid, code)
        return exit_status(code) or 1
    log.info("stop asked (%s): sending quit to the daemon (pid %d)", signal.Signals(stop.signum).name, daemon.pid)
    ask_quit(control, env, min(QUIT_TIMEOUT, stop_timeout))
    try:
        code = daemon.wait(timeout=stop_timeout)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
        log.warning("killed: the daemon (pid %d) was still there %gs after quit", daemon.pid, stop_timeout)
        return 1
    log.info("stopped: the daemon (pid %d) exited with status %d", daemon.pid, code)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one CUDA MPS control daemon for one GPU (run by supervisord)")
    parser.add_argument("--gpu", type=int, required=True, help="the GPU's index (PCI bus order, as nvidia-smi)")
    parser.add_argument("--pipe-dir", required=True, help="CUDA_MPS_PIPE_DIRECTORY (created 0700)")
    parser.add_argument("--log-dir", required=True, help="CUDA_MPS_LOG_DIRECTORY (created 0700)")
    parser.add_argument("--control", default=CONTROL, help=f"the control binary (default: {CONTROL})")
    parser.add_argument(
        "--stop-timeout", type=float, default=10.0, help="seconds the daemon has to exit after quit (default: 10)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(asctime)s mps %(levelname)s %(message)s")
    stop = StopFlag().install()  # before the daemon starts: a stop asked meanwhile is not lost
    pipe_dir, log_dir = Path(args.pipe_dir).absolute(), Path(args.log_dir).absolute()
    try:
        private_dir(pipe_dir)
        private_dir(log_dir)
    except OSError as exc:
        log.error("cannot create the MPS dirs: %s", exc)
        return 1
    env = {**os.environ, **daemon_env(args.gpu, str(pipe_dir), str(log_dir))}
    try:
        daemon = subprocess.Popen([args.control, "-f"], env=env)
    except OSError as exc:
        problem = mps_problem(args.control)
        log.error("cannot start %s -f: %s%s", args.control, exc, f" ({problem})" if problem else "")
        return 127 if isinstance(exc, FileNotFoundError) else 126
    started = time.monotonic()
    log.info("started: daemon pid %d, gpu %d, pipe dir %s", daemon.pid, args.gpu, pipe_dir)
    code = supervise(daemon, stop, args.control, env, args.stop_timeout)
    log.info("ran %.1fs; exiting with status %d", time.monotonic() - started, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
