"""The job runner over a real SQLite store and a real results dir, with segments "sent" by an
in-process function (the HTTP side is test_job_sender's; the whole path through nginx is an
integration test's): order, the slots bound, retries, poison, cancel, leases, a crash and its
resume, a full disk, and the joined result in each format."""

from __future__ import annotations

import errno
import io
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import soundfile

from cosyvoice_lb.common.atomic import write_atomic
from cosyvoice_lb.instance.audio.formats import Encoder, available
from cosyvoice_lb.jobs import model
from cosyvoice_lb.jobs.base import StoreError
from cosyvoice_lb.jobs.model import CANCELLED, FAILED, RUNNING, SUCCEEDED, Job
from cosyvoice_lb.jobs.results import Results, tree_size
from cosyvoice_lb.jobs.runner import Runner, seed_of, segments_of
from cosyvoice_lb.jobs.sender import SegmentError
from cosyvoice_lb.jobs.sqlite_store import SqliteStore

RATE = 24000
PIECE = 4800  # samples of each segment's audio (0.2 s)
FADE = 720  # the join's 30 ms crossfade at 24 kHz
SEGMENT_CHARS = 40
OWNER = "shared"


def text_of(count: int, word: str = "sentence") -> str:
    """``count`` sentences of about 30 characters: one segment each at SEGMENT_CHARS."""
    return " ".join(f"This is {word} {i} of the text." for i in range(1, count + 1))


def number(text: str) -> int:
    return int(re.search(r"\d+", text).group())  # type: ignore[union-attr]


def wav(level: float, samples: int = PIECE) -> bytes:
    """A segment's answer as /v1/audio/speech streams it: wav of unknown size, a constant level."""
    encoder = Encoder("wav", RATE)
    return encoder.feed(np.full(samples, level, dtype=np.float32)) + encoder.finish()


def level(text: str) -> float:
    return number(text) / 20


class Speaker:
    """The runner's ``send``: audio whose level says which segment it is; counts what it was
    sent and how many were out at once. ``faults[text]``: errors to raise first, in order."""

    def __init__(self, delay: Callable[[str], float] = lambda text: 0.0) -> None:
        self.delay = delay
        self.faults: dict[str, list[Exception]] = {}
        self.sent: list[tuple[str, int | None]] = []
        self.out = self.most = 0
        self.lock = threading.Lock()
        self.gate: threading.Event | None = None  # when set: calls past ``free`` wait on it
        self.free = 0

    def __call__(self, params: dict, text: str, seed: int | None) -> bytes:
        with self.lock:
            self.sent.append((text, seed))
            self.out += 1
            self.most = max(self.most, self.out)
            blocked = self.gate is not None and len(self.sent) > self.free
            fault = self.faults[text].pop(0) if self.faults.get(text) else None
        try:
            if blocked and self.gate is not None:
                self.gate.wait(5)
                raise SegmentError(0, "the runner was gone", True)
            time.sleep(self.delay(text))
            if fault is not None:
                raise fault
            return wav(level(text))
        finally:
            with self.lock:
                self.out -= 1

    def texts(self) -> list[str]:
        return [text for text, _ in self.sent]


class Clock:
    """Real time, pushed on by ``offset`` (a lease running out without waiting for it)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@pytest.fixture
def store(tmp_path):
    with SqliteStore(tmp_path / "jobs.sqlite3") as store:
        yield store


@pytest.fixture
def results(tmp_path):
    return Results(tmp_path / "results")


def submit(store: SqliteStore, text: str, **params) -> Job:
    params = {"voice": "alloy", "response_format": "wav", "speed": 1.0, "seed": 7, **params}
    job = model.new_job(OWNER, text, len(segments_of(text, SEGMENT_CHARS)), time.time(), params=params)
    store.create(job, text)
    return job


def runner_of(store, send, results, slots: int = 2, **kwargs) -> Runner:
    kwargs.setdefault("backoff", 0.01)
    kwargs.setdefault("worker", "box:1")
    kwargs.setdefault("segment_chars", SEGMENT_CHARS)
    return Runner(store, send, results, slots=slots, **kwargs)


def drive(runner: Runner, until: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not until():
        assert time.monotonic() < deadline, "the runner did not get there in time"
        runner.step()
        runner.wait(0.005)


def status(store: SqliteStore, job: Job) -> str:
    current = store.get(job.id, OWNER)
    assert current is not None
    return current.status


def finished(store: SqliteStore, *jobs: Job) -> Callable[[], bool]:
    return lambda: all(status(store, job) in model.FINISHED for job in jobs)


def settle(runner: Runner) -> None:
    """Until the runner has dropped every job (its files removed or kept)."""
    drive(runner, lambda: not runner.active)


def test_segments_are_the_long_text_split_less_the_wordless():
    text = "First sentence here. * * *\nSecond one, then more. 3.14 is pi."
    assert segments_of(text, 25) == ["First sentence here.", "Second one, then more.", "3.14 is pi."]
    assert segments_of("* * * ...", 25) == []
    with pytest.raises(ValueError, match="segment_chars"):
        segments_of("Hello.", 0)


def test_a_jobs_seed_is_its_own_or_one_its_id_always_gives(store):
    job = submit(store, text_of(2))
    assert seed_of(job) == 7
    unseeded = submit(store, text_of(2), seed=None)
    assert seed_of(unseeded) == seed_of(unseeded) and 0 <= seed_of(unseeded) < 2**32


def test_segments_join_in_order_into_the_result(store, results):
    # earlier segments come back later: the result is still in the text's order
    speaker = Speaker(delay=lambda text: 0.04 / number(text))
    job = submit(store, text_of(8))
    runner = runner_of(store, speaker, results, slots=3)
    try:
        drive(runner, finished(store, job))
        settle(runner)
    finally:
        runner.close()
    done = store.get(job.id, OWNER)
    assert done is not None and done.status == SUCCEEDED, done.error
    assert (done.segments_done, done.segments_total) == (8, 8)
    assert sorted(speaker.texts()) == sorted(segments_of(text_of(8), SEGMENT_CHARS))
    assert {seed for _, seed in speaker.sent} == {7}
    path = Path(done.result_path or "")
    assert path == results.audio_path(job.id, "wav").resolve() and path.stat().st_size == done.result_bytes
    audio, rate = soundfile.read(str(path), dtype="float32")
    assert rate == RATE and audio.size == 8 * PIECE - 7 * FADE
    step = PIECE - FADE
    for i in range(8):  # the middle of each piece is its segment's level
        assert audio[i * step + PIECE // 2] == pytest.approx((i + 1) / 20, abs=1e-3)
    assert sorted(p.name for p in results.folder(job.id).iterdir()) == ["audio.wav", "plan.json"]


def test_no_more_segments_out_than_slots_and_the_oldest_job_first(store, results):
    speaker = Speaker(delay=lambda text: 0.02)
    first, second = submit(store, text_of(6, "alpha")), submit(store, text_of(6, "omega"))
    runner = runner_of(store, speaker, results, slots=3)
    try:
        drive(runner, finished(store, first, second))
    finally:
        runner.close()
    assert (status(store, first), status(store, second)) == (SUCCEEDED, SUCCEEDED)
    assert speaker.most == 3
    kinds = ["omega" in text for text in speaker.texts()]
    assert kinds == [False] * 6 + [True] * 6


def test_a_segment_that_fails_retryably_is_sent_again(store, results):
    speaker = Speaker()
    job = submit(store, text_of(4))
    third = segments_of(text_of(4), SEGMENT_CHARS)[2]
    speaker.faults[third] = [SegmentError(503, "busy", True), SegmentError(0, "nothing answered", True)]
    runner = runner_of(store, speaker, results)
    try:
        drive(runner, finished(store, job))
    finally:
        runner.close()
    assert status(store, job) == SUCCEEDED
    assert speaker.texts().count(third) == 3 and len(speaker.sent) == 6


def test_retries_are_bounded_then_the_job_fails(store, results):
    speaker = Speaker()
    job = submit(store, text_of(3))
    second = segments_of(text_of(3), SEGMENT_CHARS)[1]
    speaker.faults[second] = [SegmentError(503, "every instance is busy", True) for _ in range(10)]
    runner = runner_of(store, speaker, results, retries=2)
    try:
        drive(runner, finished(store, job))
        settle(runner)
    finally:
        runner.close()
    failed = store.get(job.id, OWNER)
    assert failed is not None and failed.status == FAILED
    assert failed.error == (
        'segment 2 of 3 (it begins "This is sentence 2 of the text.") failed after 3 tries: every instance is busy'
    )
    assert speaker.texts().count(second) == 3
    assert not results.folder(job.id).exists()  # (a failed job has no content: its files go)


def test_poison_fails_its_job_and_the_runner_goes_on(store, results):
    speaker = Speaker()
    poisoned, healthy = submit(store, text_of(5)), submit(store, text_of(3, "word"))
    second = segments_of(text_of(5), SEGMENT_CHARS)[1]
    speaker.faults[second] = [SegmentError(422, "this request killed instances twice: refused", False)]
    runner = runner_of(store, speaker, results, slots=1)
    try:
        drive(runner, finished(store, poisoned, healthy))
        settle(runner)
    finally:
        runner.close()
    failed = store.get(poisoned.id, OWNER)
    assert failed is not None and failed.status == FAILED and failed.error is not None
    assert failed.error.startswith('segment 2 of 5 (it begins "This is sentence 2')
    assert failed.error.endswith("killed instances twice: refused")
    assert speaker.texts()[:2] == segments_of(text_of(5), SEGMENT_CHARS)[:2]  # nothing of it after the poison
    assert status(store, healthy) == SUCCEEDED


def test_a_sender_that_breaks_fails_the_job_not_the_runner(store, results):
    def broken(params, text, seed):
        raise KeyError("a bug")

    job = submit(store, text_of(2))
    runner = runner_of(store, broken, results)
    try:
        drive(runner, finished(store, job))
    finally:
        runner.close()
    failed = store.get(job.id, OWNER)
    assert failed is not None and failed.status == FAILED and "a bug" in (failed.error or "")


def test_cancel_stops_the_remaining_segments(store, results):
    speaker = Speaker(delay=lambda text: 0.01)
    job = submit(store, text_of(10))
    runner = runner_of(store, speaker, results, slots=1)
    try:
        drive(runner, lambda: store.done_segments(job.id) >= {0, 1})
        assert store.cancel(job.id, OWNER, time.time()) is not None
        settle(runner)
    finally:
        runner.close()
    assert status(store, job) == CANCELLED
    assert len(speaker.sent) <= 4  # (the one out when it was cancelled, at most one round more)
    assert not results.folder(job.id).exists()


def test_a_crashed_runners_job_resumes_without_the_segments_it_made(store, results):
    clock = Clock()
    first = Speaker()
    first.gate, first.free = threading.Event(), 3  # the 4th segment hangs: the runner "crashes" there
    job = submit(store, text_of(6))
    crashed = runner_of(store, first, results, slots=1, clock=clock, worker="box:1", lease=30.0)
    segments = segments_of(text_of(6), SEGMENT_CHARS)
    try:
        drive(crashed, lambda: store.done_segments(job.id) == {0, 1, 2})
        # ... and is never stepped again. A segment recorded done whose file was lost is made again.
        results.segment_path(job.id, 1).unlink()
        clock.offset += 31.0  # its lease runs out
        second = Speaker()
        # (restarted with another --segment-chars: the job keeps the split it was begun with)
        resumed = runner_of(store, second, results, slots=2, clock=clock, worker="box:2", segment_chars=80)
        try:
            drive(resumed, finished(store, job))
        finally:
            resumed.close()
        done = store.get(job.id, OWNER)
        assert done is not None and done.status == SUCCEEDED and done.attempts == 2
        assert sorted(second.texts()) == sorted([segments[1], *segments[3:]])
        audio, _ = soundfile.read(str(done.result_path), dtype="float32")
        assert audio.size == 6 * PIECE - 5 * FADE
        # the crashed runner comes back to life: it holds the job no more, and leaves its result be
        first.gate.set()
        drive(crashed, lambda: not crashed.active)
        assert Path(str(done.result_path)).is_file() and status(store, job) == SUCCEEDED
    finally:
        first.gate.set()
        crashed.close()


def test_a_job_counted_with_another_segment_size_fails_with_why(store, results):
    job = submit(store, text_of(4))  # (counted at SEGMENT_CHARS, run at twice that, never begun)
    runner = runner_of(store, Speaker(), results, segment_chars=2 * SEGMENT_CHARS)
    try:
        drive(runner, finished(store, job))
    finally:
        runner.close()
    failed = store.get(job.id, OWNER)
    assert failed is not None and failed.status == FAILED
    assert (
        failed.error
        == "its text splits into 2 segments of up to 80 characters, not the 4 it was sent with: send it again"
    )


class FlakyStore(SqliteStore):
    """The real store, whose segment records fail ``failures`` times as an unreachable one's do."""

    failures = 3

    def segment_done(self, job_id: str, index: int, now: float) -> Job | None:
        if self.failures:
            self.failures -= 1
            raise StoreError("the job store is unreachable", "unreachable")
        return super().segment_done(job_id, index, now)


def test_a_store_that_fails_for_a_while_delays_the_job_and_loses_nothing(tmp_path, results):
    speaker = Speaker()
    with FlakyStore(tmp_path / "flaky.sqlite3") as store:
        job = submit(store, text_of(4))
        runner = runner_of(store, speaker, results)
        try:
            drive(runner, finished(store, job))
        finally:
            runner.close()
        assert status(store, job) == SUCCEEDED and store.failures == 0
    assert len(speaker.sent) == 4  # (recorded once the store answered: none made twice)


def test_a_stopped_runner_leaves_its_job_to_the_next_at_once(store, results):
    speaker = Speaker()
    speaker.gate, speaker.free = threading.Event(), 2
    job = submit(store, text_of(4))
    runner = runner_of(store, speaker, results, slots=1)
    drive(runner, lambda: store.done_segments(job.id) == {0, 1})
    speaker.gate.set()
    runner.close(drain=1.0)
    running = store.get(job.id, OWNER)
    assert running is not None and running.status == RUNNING
    taken = store.claim_next("box:2", 30.0, time.time() + 0.01)  # not 30 s on: the lease is given back
    assert taken is not None and taken.id == job.id and taken.attempts == 2


def test_run_makes_jobs_until_stopped(store, results):
    job = submit(store, text_of(3))
    runner = runner_of(store, Speaker(), results)
    stop = threading.Event()
    thread = threading.Thread(target=runner.run, args=(stop,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while status(store, job) != SUCCEEDED:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive() and runner.closed


class FullDisk:
    """A results writer that fails as a full disk does for files whose path has ``part``."""

    def __init__(self, part: str) -> None:
        self.part = part

    def __call__(self, path: Path, data, **kwargs) -> None:
        if self.part in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        write_atomic(path, data, **kwargs)


@pytest.mark.parametrize("part", ["plan.json", "seg-00002", "audio."])
def test_a_full_disk_fails_the_job_with_the_reason(store, tmp_path, part):
    full = submit(store, text_of(3))
    later = submit(store, text_of(2, "word"))
    results = Results(tmp_path / "results", writer=FullDisk(f"{full.id}/{part}"))
    runner = runner_of(store, Speaker(), results, slots=1)
    try:
        drive(runner, finished(store, full, later))
        settle(runner)
    finally:
        runner.close()
    failed = store.get(full.id, OWNER)
    assert failed is not None and failed.status == FAILED and failed.error is not None
    assert failed.error.startswith("the disk is full: free space on ")
    assert "No space left on device" in failed.error
    assert status(store, later) == SUCCEEDED
    assert not results.folder(full.id).exists()


FORMATS = [fmt for fmt in ("flac", "pcm", "mp3", "opus") if not available(fmt)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_result_is_in_the_jobs_format(store, results, fmt):
    job = submit(store, text_of(3), response_format=fmt)
    runner = runner_of(store, Speaker(), results)
    try:
        drive(runner, finished(store, job))
    finally:
        runner.close()
    done = store.get(job.id, OWNER)
    assert done is not None and done.status == SUCCEEDED
    path = Path(str(done.result_path))
    assert path.name == f"audio.{fmt}"
    samples = 3 * PIECE - 2 * FADE
    if fmt == "pcm":
        assert path.stat().st_size == 2 * samples
        return
    audio, rate = soundfile.read(io.BytesIO(path.read_bytes()), dtype="float32")
    assert rate == RATE
    if fmt == "flac":
        assert audio.size == samples
    else:  # (lossy codecs pad their first and last frames)
        assert abs(audio.size - samples) < 2400


def test_results_sizes_and_removal(results):
    assert results.size() == 0 and results.remove("job_nothing_here_at_all") == 0
    results.write_segment("job_a", 0, wav(0.1))
    results.write_segment("job_b", 0, wav(0.1))
    (results.folder("job_b") / "seg-00002.wav").write_bytes(b"not audio")
    assert results.has_segment("job_a", 0) and not results.has_segment("job_b", 1)
    assert not results.has_segment("job_a", 5)
    assert results.size() == tree_size(results.root) == 2 * len(wav(0.1)) + len(b"not audio")
    assert results.remove("job_a") == len(wav(0.1))
    assert results.size() == len(wav(0.1)) + len(b"not audio")
    with pytest.raises(ValueError):
        results.folder("../elsewhere")
