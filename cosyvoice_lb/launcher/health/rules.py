"""The health rules: one instance's memory, what supervisord and a probe say, and the
clock in; its next memory and what to do out.

Pure (no clock, no randomness, no I/O: ``now`` and the recycle jitter are passed in), so
every rule is tested without sleeping. ``loop`` runs them against the real
instances and acts on the verdicts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.sizes import parse_size
from cosyvoice_lb.launcher.health.probe import Probe, ProbeStatus
from cosyvoice_lb.launcher.state.health_report import OnPurpose, Track
from cosyvoice_lb.launcher.state.markers import DrainAction
from cosyvoice_lb.launcher.state.supervision import ALIVE, ProcessInfo, ProgramState

# Why an instance was restarted, as the metrics count it: the loop orders all but "crash"
# (supervisord brought back a process that exited on its own; counted from the starts file).
# "replaced": new settings or a surge roll-out; "scaled_in": stopped by the elastic scaler
# (either start that follows is explained by it, not a crash); "bad_audio": its warm-up or a
# canary made bad audio (NaN, silence...: see the instance's ``audio.check``).
RESTART_REASONS = (
    "crash",
    "hang",
    "probe_failures",
    "not_ready",
    "recycle",
    "requested",
    "replaced",
    "scaled_in",
    "bad_audio",
)


@dataclass(frozen=True)
class Verdict:
    track: Track
    restart: str = ""  # non-empty: restart now, for this reason
    kind: str = ""  # the restart's reason as the metrics count it (RESTART_REASONS)
    drain: bool = False  # the restart may wait for syntheses still making progress
    give_up: str = ""  # non-empty: a crash loop; stop it and leave it stopped


@dataclass(frozen=True)
class Policy:
    fail_threshold: int = 3
    recover_threshold: int = 2
    hang_timeout: float = 60.0
    startup_timeout: float = 300.0
    max_requests: int = 0  # recycle after this many requests (0: never)
    max_requests_jitter: int = 0
    max_memory: int = 0  # recycle past this RSS or GPU memory per process, bytes (0: never)
    drain_timeout: float = 30.0
    start_retries: int = 3

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        return cls(
            settings.fail_threshold,
            settings.recover_threshold,
            settings.hang_timeout,
            settings.startup_timeout,
            settings.max_requests,
            settings.max_requests_jitter,
            parse_size(settings.max_memory) if settings.max_memory else 0,
            settings.drain_timeout,
            settings.start_retries,
        )


def failed_starts(starts: int, since_ready: int, alive: bool) -> int:
    """Starts in a row that ended without the instance getting ready (the one running now,
    still loading, is not counted)."""
    return max(0, starts - since_ready - (1 if alive else 0))


def judge(
    track: Track, process: ProcessInfo | None, probe: Probe, policy: Policy, starts: int = 0, now: float = 0.0
) -> Verdict:
    """The next :class:`Track` of one instance, and whether to restart it.

    ``starts``: how often the instance has been started (its starts file), for crash loops;
    ``now``: the epoch time of this judgement (when a give-up is recorded).
    """
    if process is None or process.state not in ALIVE or process.pid == 0:
        state = process.state if process else "missing"
        track = dataclasses.replace(
            track,
            in_rotation=False,
            fails=0,
            goods=0,
            pid=0,
            ever_ready=False,
            draining_since=0.0,
            drain_signal=None,
            signalled_at=0.0,
        )
        if track.failed:
            return Verdict(track)
        crashes = failed_starts(starts, track.ready_starts, alive=False)
        if state == ProgramState.FATAL or crashes > policy.start_retries:
            if state == ProgramState.FATAL:
                why = "supervisord gave up starting it" + (f" after {crashes} exits in a row" if crashes else "")
            else:
                why = (
                    f"it exited {crashes} times in a row without getting ready (--start-retries {policy.start_retries})"
                )
            return _give_up(track, why, now)
        return Verdict(_not_running(track, state))
    if track.failed:  # given up on, yet running (supervisord restarted it meanwhile): stop it again
        return Verdict(dataclasses.replace(track, in_rotation=False, pid=process.pid), give_up=track.failed)
    if process.pid != track.pid:  # a new process: earns its place like any newcomer
        # After a planned stop (restart, recycling, new settings) the start that follows is
        # not a failure, even of an instance that was still loading.
        since = max(track.ready_starts, starts - 1) if track.signalled_at else track.ready_starts
        track = Track(
            pid=process.pid,
            restarts=track.restarts,
            reason="started",
            ready_starts=since,
            ordered=track.ordered,
            crashes=track.crashes,
            bad_audio=track.bad_audio,
            bad_audio_at=track.bad_audio_at,
        )
    if track.signalled_at:  # stopping after a planned stop: wait for it to go
        return Verdict(dataclasses.replace(track, in_rotation=False))

    loading = not track.ever_ready and process.uptime < policy.startup_timeout
    if probe.status == ProbeStatus.READY:
        if probe.stalled_seconds > policy.hang_timeout:
            if track.drain_signal is DrainAction.KILL:  # already on its way out
                return Verdict(track)
            return _restart(
                track,
                f"a synthesis has made no progress for {probe.stalled_seconds:.0f}s "
                f"(hang timeout {policy.hang_timeout:.0f}s)",
                "hang",
                drain=True,
            )
        goods = track.goods + 1
        back = not track.draining_since and (track.in_rotation or goods >= policy.recover_threshold)
        return Verdict(
            dataclasses.replace(
                track,
                fails=0,
                goods=goods,
                ever_ready=True,
                in_rotation=back,
                ready_starts=starts or track.ready_starts,
                on_purpose=None if back else track.on_purpose,
                reason="" if back else track.reason,
            )
        )
    crashes = failed_starts(starts, track.ready_starts, alive=True)
    if probe.status == ProbeStatus.BAD_AUDIO:
        return _bad_audio(track, probe.detail, crashes, policy, now)
    if not track.ever_ready and crashes > policy.start_retries:
        return _give_up(track, _never_ready(crashes, policy), now)
    if loading:  # still loading its model (or not listening yet): never killed for being slow
        return Verdict(
            dataclasses.replace(track, in_rotation=False, fails=0, goods=0, on_purpose=None, reason="loading")
        )
    if probe.status == ProbeStatus.LOADING:
        detail = (
            f"not ready after the startup timeout ({policy.startup_timeout:.0f}s)"
            if not track.ever_ready
            else "reports loading again"
        )
        return _restart(track, detail, "not_ready", drain=True)
    fails = track.fails + 1
    if fails >= policy.fail_threshold:
        return _restart(track, f"{fails} probes failed in a row: {probe.detail}", "probe_failures")
    return Verdict(dataclasses.replace(track, fails=fails, goods=0))


def _not_running(track: Track, state: str) -> Track:
    """Why it is out while its process does not run: STOPPED, never started or stopped on
    purpose, is a parked slot; any other state is words for people."""
    if state == ProgramState.STOPPED:
        return dataclasses.replace(track, on_purpose=OnPurpose.PARKED, reason="")
    return dataclasses.replace(track, on_purpose=None, reason=f"process {state.lower()}")


def _never_ready(crashes: int, policy: Policy) -> str:
    return f"it was started {crashes + 1} times without getting ready (--start-retries {policy.start_retries})"


def _bad_audio(track: Track, detail: str, crashes: int, policy: Policy, now: float) -> Verdict:
    """Its warm-up or a canary made bad audio: out of rotation and restarted at once (no
    --fail-threshold to wait for: the instance itself says so). A new process whose warm-up
    does is a failed start: after --start-retries it is given up on, as a crash loop is."""
    track = dataclasses.replace(track, bad_audio=detail, bad_audio_at=now)
    if not track.ever_ready and crashes > policy.start_retries:
        return _give_up(track, f"{_never_ready(crashes, policy)}; it made bad audio: {detail}", now)
    return _restart(track, f"it made bad audio: {detail}", "bad_audio")


def recycle_due(track: Track, probe: Probe, memory: int, policy: Policy) -> str:
    """Why this healthy instance should get a drained restart now ("" when it should not):
    it served its share of requests, or its memory (RSS or GPU, per process) grew too big."""
    if not track.ever_ready or not track.in_rotation or track.draining_since or probe.status != ProbeStatus.READY:
        return ""
    if policy.max_requests and track.recycle_at and probe.served >= track.recycle_at:
        return f"served {probe.served} requests (--max-requests {policy.max_requests})"
    if policy.max_memory and memory > policy.max_memory:
        return f"uses {memory / 2**30:.1f} GiB (--max-memory {policy.max_memory / 2**30:.1f} GiB)"
    return ""


def pick_recycle(
    candidates: dict[str, str],
    tracks: dict[str, Track],
    uptimes: dict[str, float],
    drained: frozenset[str] = frozenset(),
    standing_by: frozenset[str] = frozenset(),
) -> tuple[str, str] | None:
    """At most one drained restart at a time, and only while every other instance serves
    (those ``drained`` by hand, and the ``standing_by`` ones: warm spares and parked slots,
    aside: out on purpose, they do not hold recycling up) and at least one other does; of
    those due, the oldest process first (so a busy cluster recycles every instance in turn,
    not the first names over and over)."""
    if any(t.draining_since or t.signalled_at for t in tracks.values()):
        return None
    aside = drained | standing_by

    def others_serve(name: str) -> bool:
        others = {other: t for other, t in tracks.items() if other != name}
        return all(t.in_rotation or other in aside for other, t in others.items()) and any(
            t.in_rotation for t in others.values()
        )

    due = [(name, reason) for name, reason in candidates.items() if reason and others_serve(name)]
    return max(due, key=lambda item: (uptimes.get(item[0], 0.0), item[0]), default=None)


def drain_done(track: Track, probe: Probe, policy: Policy, now: float) -> bool:
    """Whether a planned stop may signal the instance now: nothing it could still finish
    (a hung one: nothing still making progress), it stopped answering, or --drain-timeout.
    A streaming session is not waited for: it lasts as long as its client writes, and the
    instance's own drain (on the signal) lets it finish its sentence, then closes it."""
    if now - track.draining_since > policy.drain_timeout or probe.status != ProbeStatus.READY:
        return True
    if track.drain_signal is DrainAction.KILL:
        return probe.progressing(policy.hang_timeout) == 0
    return probe.inflight - probe.sessions <= 0 and probe.waiting == 0


def start_drain(track: Track, reason: str, action: DrainAction, now: float, kind: str = "") -> Track:
    """Out of rotation now; signalled by :func:`drain_done`'s say. ``kind``: the restart's
    reason as the metrics count it (not counted again when it was draining already)."""
    if kind and not track.draining_since:
        track = count_restart(track, kind)
    return dataclasses.replace(
        track,
        in_rotation=False,
        goods=0,
        on_purpose=None,
        reason=reason,
        drain_signal=action,
        draining_since=track.draining_since or now,
        restarts=track.restarts + (0 if track.draining_since else 1),
    )


def _restart(track: Track, reason: str, kind: str, drain: bool = False) -> Verdict:
    return Verdict(
        dataclasses.replace(
            count_restart(track, kind),
            in_rotation=False,
            fails=0,
            goods=0,
            on_purpose=None,
            reason=reason,
            restarts=track.restarts + 1,
        ),
        restart=reason,
        kind=kind,
        drain=drain,
    )


def count_restart(track: Track, kind: str) -> Track:
    """The track with one more restart of this kind ordered."""
    return dataclasses.replace(track, ordered={**track.ordered, kind: track.ordered.get(kind, 0) + 1})


def count_crashes(track: Track, starts: int) -> Track:
    """The track with its crashes brought up to date: the starts no order explains (an
    instance's first start is no restart). An order is counted when it is given and its
    start comes later: the count keeps its high mark meanwhile, so it never goes down (a
    Prometheus counter that dips reads as a reset, and a reset as a burst of restarts)."""
    explained = 1 + sum(track.ordered.values())
    return dataclasses.replace(track, crashes=max(track.crashes, starts - explained))


def restarts_by_reason(track: Track) -> dict[str, int]:
    """Every restart of an instance by reason, from its track in health.json."""
    counts = {kind: int(track.ordered.get(kind, 0)) for kind in RESTART_REASONS}
    counts["crash"] = int(track.crashes or 0)
    return counts


def _give_up(track: Track, why: str, now: float) -> Verdict:
    reason = f"failed: {why}"
    return Verdict(
        dataclasses.replace(
            track,
            in_rotation=False,
            fails=0,
            goods=0,
            on_purpose=None,
            reason=reason,
            failed=reason,
            failed_at=now,
            draining_since=0.0,
            drain_signal=None,
            signalled_at=0.0,
        ),
        give_up=reason,
    )
