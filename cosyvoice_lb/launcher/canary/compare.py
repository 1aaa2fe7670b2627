"""The comparison of a model roll-out: the serving side and the canary over the same
traffic (the requests nginx mirrored, or as many as the canary's share), and the verdict
against the canary's thresholds. Pure: samples in (each instance's ``GET /cohort``), figures
and words out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from cosyvoice_lb.launcher.state.canary import Thresholds

FAILED = ("failed", "timeout")


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` percentile (0-100) of ``values``; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class Side:
    """One side's figures. ``judged``: answers that say something of the model (answered,
    failed or bad audio; not refused as overloaded, cancelled by the client or invalid).
    Latency counts from the moment the engine took the request (its wait for the engine,
    ``queued``, apart): one canary alone queues otherwise than a pool balanced by least
    connections, whatever its model, and that is no finding about the model."""

    requests: int = 0
    ok: int = 0
    failed: int = 0
    bad_audio: int = 0
    refused: int = 0
    invalid: int = 0
    queued_p50: float | None = None
    queued_p99: float | None = None
    first_chunk_p50: float | None = None
    first_chunk_p99: float | None = None
    total_p50: float | None = None
    total_p99: float | None = None
    checked: int = 0
    error_mean: float | None = None
    error_p90: float | None = None
    similarity_mean: float | None = None

    @property
    def judged(self) -> int:
        return self.ok + self.failed + self.bad_audio

    @property
    def failure_ratio(self) -> float:
        return self.failed / self.judged if self.judged else 0.0

    @property
    def bad_audio_ratio(self) -> float:
        return self.bad_audio / self.judged if self.judged else 0.0

    @classmethod
    def of(cls, samples: Iterable[dict], since: float = 0.0) -> Side:
        kept = [s for s in samples if float(s.get("at", 0.0)) >= since]
        outcomes = [str(s.get("outcome", "")) for s in kept]
        ok = [s for s in kept if s.get("outcome") == "ok"]
        waits = [float(s.get("queued") or 0.0) for s in ok]
        firsts = [float(s["first_chunk"]) - w for s, w in zip(ok, waits) if s.get("first_chunk") is not None]
        totals = [float(s["total"]) - w for s, w in zip(ok, waits) if s.get("total") is not None]
        errors = [float(s["error"]) for s in ok if s.get("error") is not None]
        similar = [float(s["similarity"]) for s in ok if s.get("similarity") is not None]
        return cls(
            requests=len(kept),
            ok=len(ok),
            failed=sum(1 for o in outcomes if o in FAILED),
            bad_audio=outcomes.count("bad_audio"),
            refused=outcomes.count("refused"),
            invalid=outcomes.count("invalid"),
            queued_p50=percentile(waits, 50),
            queued_p99=percentile(waits, 99),
            first_chunk_p50=percentile(firsts, 50),
            first_chunk_p99=percentile(firsts, 99),
            total_p50=percentile(totals, 50),
            total_p99=percentile(totals, 99),
            checked=len(errors),
            error_mean=mean(errors),
            error_p90=percentile(errors, 90),
            similarity_mean=mean(similar),
        )


@dataclass(frozen=True)
class Finding:
    """One threshold checked: its name, whether it held, and the numbers in words."""

    name: str
    passed: bool
    said: str


@dataclass(frozen=True)
class Comparison:
    serving: Side
    canary: Side
    findings: tuple[Finding, ...]
    verdict: str  # "pass", "fail" or "waiting" (too few answers yet)

    @property
    def failed(self) -> list[Finding]:
        return [f for f in self.findings if not f.passed]

    def as_dict(self) -> dict:
        def side(s: Side) -> dict:
            return {
                **s.__dict__,
                "judged": s.judged,
                "failure_ratio": s.failure_ratio,
                "bad_audio_ratio": s.bad_audio_ratio,
            }

        return {
            "serving": side(self.serving),
            "canary": side(self.canary),
            "findings": [f.__dict__ for f in self.findings],
            "verdict": self.verdict,
        }


def _ratio_finding(name: str, serving: float, canary: float, allowed: float) -> Finding:
    passed = canary <= serving + allowed + 1e-12
    return Finding(name, passed, f"canary {canary:.1%} vs serving {serving:.1%} (at most +{allowed:.1%})")


def _latency_finding(name: str, serving: float | None, canary: float | None, ratio: float) -> Finding | None:
    if serving is None or canary is None:
        return None
    passed = canary <= serving * ratio + 1e-3  # (a millisecond of slack: equal sub-ms figures pass)
    return Finding(
        name, passed, f"canary {canary * 1000:.0f} ms vs serving {serving * 1000:.0f} ms (at most ×{ratio:g})"
    )


def _speech_finding(serving: Side, canary: Side, allowed: float) -> Finding:
    if canary.error_mean is None or serving.error_mean is None:
        side = "canary" if canary.error_mean is None else "serving side"
        return Finding(
            "speech check",
            False,
            f"unchecked: no answer of the {side} was transcribed (a recogniser for its language: --asr, "
            "--asr-model); what a model says cannot pass unheard",
        )
    passed = canary.error_mean <= serving.error_mean + allowed + 1e-12
    return Finding(
        "speech check",
        passed,
        f"mean error canary {canary.error_mean:.2f} vs serving {serving.error_mean:.2f} (at most +{allowed:.2f})",
    )


def _similarity_finding(serving: Side, canary: Side, drop: float) -> Finding | None:
    if serving.similarity_mean is None or canary.similarity_mean is None:
        return None  # (no speaker model, or no prompt: not judged)
    passed = canary.similarity_mean >= serving.similarity_mean - drop - 1e-12
    return Finding(
        "speaker similarity",
        passed,
        f"canary {canary.similarity_mean:.2f} vs serving {serving.similarity_mean:.2f} (at least -{drop:.2f})",
    )


def compare(serving: Side, canary: Side, limits: Thresholds) -> Comparison:
    """Both sides against ``limits``: "waiting" until each side has ``min_requests`` judged
    answers, as many of them heard by the speech check, then "pass" when every finding
    holds, else "fail"."""
    findings = [
        _ratio_finding("failures", serving.failure_ratio, canary.failure_ratio, limits.max_failure_increase),
        _ratio_finding("bad audio", serving.bad_audio_ratio, canary.bad_audio_ratio, limits.max_bad_audio_increase),
        _speech_finding(serving, canary, limits.max_error_increase),
        _latency_finding("first-chunk p99", serving.first_chunk_p99, canary.first_chunk_p99, limits.max_latency_ratio),
        _latency_finding("total p99", serving.total_p99, canary.total_p99, limits.max_latency_ratio),
        _similarity_finding(serving, canary, limits.max_similarity_drop),
    ]
    kept = tuple(f for f in findings if f is not None)
    short = []
    if min(serving.judged, canary.judged) < limits.min_requests:
        short.append(("answers", serving.judged, canary.judged))
    if 0 < min(serving.checked, canary.checked) < limits.min_requests:  # (none at all: unchecked, a failure)
        short.append(("answers heard", serving.checked, canary.checked))
    enough = not short
    kept = (
        *(
            Finding(name, False, f"serving {s}, canary {c}: {limits.min_requests} each are needed")
            for name, s, c in short
        ),
        *kept,
    )
    verdict = "waiting" if not enough else "pass" if all(f.passed for f in kept) else "fail"
    return Comparison(serving, canary, kept, verdict)


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f} ms"


def _num(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def rows(comparison: Comparison) -> list[tuple[str, str, str]]:
    """The comparison as (figure, serving, canary) rows: what ``canary status`` prints."""
    s, c = comparison.serving, comparison.canary
    return [
        ("requests", str(s.requests), str(c.requests)),
        ("answered", str(s.ok), str(c.ok)),
        ("failures", f"{s.failed} ({s.failure_ratio:.1%})", f"{c.failed} ({c.failure_ratio:.1%})"),
        ("bad audio", f"{s.bad_audio} ({s.bad_audio_ratio:.1%})", f"{c.bad_audio} ({c.bad_audio_ratio:.1%})"),
        ("refused (busy)", str(s.refused), str(c.refused)),
        ("invalid", str(s.invalid), str(c.invalid)),
        ("queue wait p50 (not judged)", _ms(s.queued_p50), _ms(c.queued_p50)),
        ("queue wait p99 (not judged)", _ms(s.queued_p99), _ms(c.queued_p99)),
        ("first chunk p50", _ms(s.first_chunk_p50), _ms(c.first_chunk_p50)),
        ("first chunk p99", _ms(s.first_chunk_p99), _ms(c.first_chunk_p99)),
        ("total p50", _ms(s.total_p50), _ms(c.total_p50)),
        ("total p99", _ms(s.total_p99), _ms(c.total_p99)),
        ("speech checked", str(s.checked), str(c.checked)),
        ("ASR error mean", _num(s.error_mean), _num(c.error_mean)),
        ("ASR error p90", _num(s.error_p90), _num(c.error_p90)),
        ("speaker similarity", _num(s.similarity_mean), _num(c.similarity_mean)),
    ]
