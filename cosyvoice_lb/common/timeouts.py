"""Every timeout derived from the settings, in one place, each with why its margin is what it is.

The settings give the bounds a user thinks in (a request's time, a drain's time, a load's
time); the processes that enforce them (nginx, supervisord, the health loop, the launcher,
the instance) need their own figures a little past or around those, so that the clearer
answer always wins and nothing waits forever. Pure; imported on both sides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cosyvoice_lb.common.settings import Settings

# A launcher call to supervisord over its socket. supervisord answers from one event loop:
# a few seconds is already a supervisord that is stuck (stopped, swapping), not a busy one.
SUPERVISOR_CALL = 10.0
# A call that waits until a process started or stopped (supervisord answers then): a stop
# waits up to the program's stopwaitsecs, then supervisord KILLs it. The launcher passes
# Timeouts.supervisor_wait for its cluster; this is the bound where no settings are known.
SUPERVISOR_WAIT = 120.0
# The health loop and `status` ask more often and must not stall on one slow answer.
SUPERVISOR_POLL = 5.0
# How long `up` tolerates a supervisord that does not answer at all before it gives up and
# stops the cluster: longer than a poll (one slow answer is no reason), far shorter than a load.
SUPERVISOR_SILENT = 20.0
# After the instance's own deadline, how long the request handler still waits for the
# synthesis worker: the worker's TimedOut carries the clearer message, so it gets a moment.
WORKER_GRACE = 1.0
# An X-Request-Start stamp older than the request timeout by more than this, or in the
# future by more than STAMP_AHEAD, is not nginx's (same host, same clock): ignored.
STAMP_SLACK = 60.0
STAMP_AHEAD = 1.0
# After the drain, connections that are only streams (Gradio heartbeats) get this long.
GRACEFUL_SHUTDOWN = 2


@dataclass(frozen=True)
class Timeouts:
    """The derived figures for one cluster's settings."""

    settings: Settings

    @property
    def nginx_api_read(self) -> int:
        """nginx's read timeout on /v1/: the instance answers a request that ran out of time
        itself (a 504 that says why); nginx's own timeout is the backstop for an instance
        that cannot answer at all, 5 s later so the instance's answer arrives first."""
        return math.ceil(self.settings.request_timeout + 5)

    @property
    def nginx_retry_window(self) -> int:
        """proxy_next_upstream_timeout: no retry once the request's time is spent; rounded up,
        never down to 0, which nginx reads as "no bound"."""
        return max(1, math.ceil(self.settings.request_timeout))

    @property
    def nginx_worker_shutdown(self) -> int:
        """How long a reloaded nginx's old workers may finish what they serve: as long as an
        instance may drain, plus the same moment as :attr:`supervisord_stop_wait`; and no
        less than a streaming session may last (every rotation change reloads nginx, which
        must not cut a voice agent's reply off)."""
        return int(max(self.settings.drain_timeout, self.settings.stream_max_seconds) + 5)

    @property
    def nginx_stream_read(self) -> int:
        """nginx's read and send timeouts on a streaming session: the instance ends a session
        at its limits itself (with a close code that says which); this is the backstop."""
        return math.ceil(self.settings.stream_max_seconds + 5)

    @property
    def supervisord_stop_wait(self) -> int:
        """stopwaitsecs: an instance drains for up to --drain-timeout, then needs a moment to
        exit; only after both does supervisord KILL it."""
        return int(self.settings.drain_timeout + 5)

    @property
    def supervisor_wait(self) -> float:
        """How long the launcher waits for supervisord to answer a stop that waits: the
        longest stopwaitsecs of the cluster's programs (an instance's, or nginx's 15 s), then
        supervisord's KILL and the exit, with 30 s to spare."""
        return max(self.supervisord_stop_wait, 15) + 30.0

    @property
    def loop_answer(self) -> float:
        """How long the launcher waits for the health loop to take a drain request: ten probe
        intervals, and at least 15 s for a loop that is busy with a slow step."""
        return max(15.0, 10 * self.settings.probe_interval)

    @property
    def hold_done(self) -> float:
        """How long the launcher waits for a HOLD drain to finish: the drain itself plus the
        time for the loop to notice it (as for :attr:`loop_answer`)."""
        return self.settings.drain_timeout + self.loop_answer

    @property
    def serving(self) -> float:
        """How long `up` and `restart` wait for an instance to serve: a whole load, the drain
        of the process it replaces, and 30 s for the loop's good probes and nginx's reload."""
        return self.settings.startup_timeout + self.settings.drain_timeout + 30

    @property
    def others_serving(self) -> float:
        """How long a rolling restart waits for the other instances before it stops one:
        one load plus 30 s, as for :attr:`serving` (nothing of theirs is being drained)."""
        return self.settings.startup_timeout + 30

    @property
    def health_stale(self) -> float:
        """After this long without a health.json update the loop counts as hung: five probe
        rounds, each of which may take a probe timeout twice (probe, then supervisord), and
        never under 10 s (a slow step is not a hung loop)."""
        return max(10.0, 5 * self.settings.probe_interval + 2 * self.settings.probe_timeout)

    @property
    def kill_after_term(self) -> float:
        """A drained instance still running this long after its TERM is KILLed: its own drain
        bound plus 10 s for interpreter exit (supervisord would KILL it at stopwaitsecs only
        on a stop, not on a signal)."""
        return self.settings.drain_timeout + 10

    @property
    def down(self) -> float:
        """How long `down` waits for supervisord's tree before it KILLs what is left: the
        instances' drains (one band; each bounded by --drain-timeout, and supervisord's own
        stopwaitsecs past it) twice over for slack, plus 30 s for nginx's graceful QUIT."""
        return self.settings.drain_timeout * 2 + 30
