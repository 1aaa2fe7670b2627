"""Retention of results across pods (cosyvoice_lb/instance/audio/sweep.py, outputs.py): on a
volume shared by pods, one sweeper at a time (a real flock) keeps every pod's dir within the
age and size bounds, the dirs of pods that are gone included, and removes those once empty;
a write under way and a live pod's fresh results stay.

Two pods, each with its own state dir, write to one outputs volume in tmp as `k8s render`
lays it out (``VOLUME/$POD_NAME``); the clock is injected, file times are set."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_lb.instance.audio.outputs import Outputs
from cosyvoice_lb.instance.audio.sweep import ALIVE, ALIVE_GRACE, LOCK, Listed, doomed, pod_volume
from cosyvoice_lb.launcher.state.layout import Layout

AUDIO = np.zeros(2400, dtype=np.float32)  # 4844 bytes as a WAV file
SIZE = 4844
DAY = 86400.0


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Pod:
    """One pod: its state dir, and an instance's outputs on the shared volume."""

    def __init__(self, root: Path, name: str, clock: Clock, max_bytes: int = 2**30):
        self.name, self.layout = name, Layout(root / f"state-{name}")
        self.layout.root.mkdir(parents=True)
        self.dir = root / "outputs" / name
        self.outputs = Outputs(
            str(self.dir), 7860, max_age=DAY, max_bytes=max_bytes, clock=clock, environ={"POD_NAME": name}
        )

    def save(self, age: float) -> str:
        """A result written ``age`` seconds before the clock's now."""
        name = self.outputs.save(AUDIO, 24000)
        then = self.outputs.clock() - age
        os.utime(self.dir / name, (then, then))
        return name

    def files(self) -> set[str]:
        return {p.name for p in self.dir.iterdir()} - {ALIVE, ".prompts"} if self.dir.exists() else set()

    def gone(self, for_seconds: float = 2 * ALIVE_GRACE) -> None:
        """The pod ended ``for_seconds`` ago: its instances let go of .alive."""
        self.outputs.close()
        then = time.time() - for_seconds
        os.utime(self.dir / ALIVE, (then, then))


@pytest.fixture
def pods(tmp_path):
    clock = Clock(time.time())
    made: list[Pod] = []

    def make(name: str, **kwargs) -> Pod:
        pod = Pod(tmp_path, name, clock, **kwargs)
        pod.outputs.sweep_every = float("inf")  # (sweeps only when a test asks)
        made.append(pod)
        return pod

    yield make, clock, tmp_path / "outputs"
    for pod in made:
        pod.outputs.close()


def test_the_dir_is_one_pods_on_a_volume_when_named_after_the_pod(tmp_path):
    assert pod_volume(tmp_path / "outputs" / "tts-7d9-abcde", {"POD_NAME": "tts-7d9-abcde"}) == tmp_path / "outputs"
    assert pod_volume(tmp_path / "outputs", {"POD_NAME": "tts-7d9-abcde"}) is None  # a box (or --outputs-dir)
    assert pod_volume(tmp_path / "outputs", {}) is None


def test_a_live_pod_sweeps_the_old_results_of_a_gone_one_and_removes_its_dir(pods):
    make, clock, volume = pods
    alive, gone = make("tts-a"), make("tts-b")
    old = [gone.save(age=2 * DAY), gone.save(age=DAY + 60)]
    (gone.dir / ".prompts").mkdir(exist_ok=True)
    (gone.dir / ".prompts" / "prompt-7860-x.wav").write_bytes(b"RIFF")  # a gone pod's prompt upload
    gone.gone()
    fresh = alive.save(age=10)

    swept = alive.outputs.sweep(force=True)
    assert sorted(swept) == sorted([f"tts-b/{n}" for n in old] + ["tts-b/"])
    assert not gone.dir.exists()  # emptied: its .alive and prompt uploads went with it
    assert alive.files() == {fresh} and (alive.dir / ALIVE).exists()  # the live pod's own stay
    assert (volume / LOCK).exists()


def test_the_size_bound_is_the_whole_volumes_oldest_first_across_pods(pods):
    make, clock, volume = pods
    a, b = make("tts-a", max_bytes=2 * SIZE), make("tts-b")
    b_oldest, b_newer = b.save(age=300), b.save(age=100)
    a_older, a_newest = a.save(age=200), a.save(age=50)
    b.gone()

    swept = a.outputs.sweep(force=True)
    assert sorted(swept) == sorted([f"tts-b/{b_oldest}", f"tts-a/{a_older}"])
    assert b.files() == {b_newer} and a.files() == {a_newest}  # a gone pod's dir stays while it holds some
    assert b.dir.exists()


def test_one_sweeper_at_a_time_a_second_one_skips_the_round(pods):
    make, clock, volume = pods
    a, b = make("tts-a"), make("tts-b")
    expired = b.save(age=2 * DAY)
    fd = os.open(volume / LOCK, os.O_RDWR | os.O_CREAT, 0o600)  # another pod's sweeper holds the volume
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert a.outputs.sweep(force=True) == []
        assert b.files() == {expired}
    finally:
        os.close(fd)
    assert a.outputs.sweep(force=True) == [f"tts-b/{expired}"]


def test_a_live_pods_dir_is_never_removed_nor_a_write_under_way_deleted(pods):
    make, clock, volume = pods
    a, b = make("tts-a", max_bytes=0), make("tts-b")  # a bound nothing fits: every result goes
    writing = b.dir / ".20240603-090000-7860-abc.wav.k2j3.tmp"  # atomic.py's temp file, being written
    writing.write_bytes(b"x" * 100)
    left = b.dir / ".20240601-090000-7860-def.wav.q9w8.tmp"  # one a crash left, two days ago
    left.write_bytes(b"x" * 100)
    os.utime(left, (clock.now - 2 * DAY, clock.now - 2 * DAY))
    then = time.time() - 2 * ALIVE_GRACE  # b's instances started long ago, and still run
    os.utime(b.dir / ALIVE, (then, then))
    result = b.save(age=5)

    swept = a.outputs.sweep(force=True)
    assert sorted(swept) == sorted([f"tts-b/{result}", f"tts-b/{left.name}"])
    assert writing.exists() and b.files() == {writing.name}
    assert a.outputs.sweep(force=True) == [] and b.dir.exists()  # live (its .alive held): kept, though empty


def test_a_pod_restarting_its_instances_is_not_taken_for_gone(pods):
    make, clock, volume = pods
    a, b = make("tts-a"), make("tts-b")
    expired = b.save(age=2 * DAY)
    b.outputs.close()  # every instance of b down a moment (a restart): .alive touched at their start
    assert a.outputs.sweep(force=True) == [f"tts-b/{expired}"]
    assert b.dir.exists() and (b.dir / ALIVE).exists()  # emptied, not removed


def test_dirs_without_a_liveness_mark_are_swept_but_kept(pods):
    make, clock, volume = pods
    a = make("tts-a")
    legacy = volume / "tts-old-pod"  # a pod of a version before this one, gone or not
    legacy.mkdir()
    (legacy / ".prompts").mkdir()
    (legacy / "20240101-000000-7860-aaa.wav").write_bytes(b"x" * 10)
    os.utime(legacy / "20240101-000000-7860-aaa.wav", (clock.now - 2 * DAY, clock.now - 2 * DAY))
    (volume / "lost+found").mkdir(mode=0o000)  # an ext4 volume's, unreadable
    try:
        assert a.outputs.sweep(force=True) == ["tts-old-pod/20240101-000000-7860-aaa.wav"]
    finally:
        (volume / "lost+found").chmod(0o700)
    assert legacy.exists() and (legacy / ".prompts").exists()


def test_on_a_box_the_outputs_dir_alone_is_swept_with_no_lock_or_mark(tmp_path):
    clock = Clock(time.time())
    box = Outputs(str(tmp_path / "outputs"), 7860, max_age=DAY, max_bytes=2**30, clock=clock, environ={})
    name = box.save(AUDIO, 24000)
    crashed = tmp_path / "outputs" / ".x.wav.abcd.tmp"
    crashed.write_bytes(b"x")
    os.utime(crashed, (clock.now - 2 * DAY, clock.now - 2 * DAY))
    sibling = tmp_path / "other"  # the state dir's other dirs are no pods'
    sibling.mkdir()
    (sibling / "old.wav").write_bytes(b"x")
    os.utime(sibling / "old.wav", (clock.now - 2 * DAY, clock.now - 2 * DAY))
    clock.now += 60
    assert box.sweep(force=True) == [crashed.name]
    assert {p.name for p in (tmp_path / "outputs").iterdir()} == {name}
    assert (sibling / "old.wav").exists()


@pytest.mark.parametrize(
    "files, max_bytes, gone, files_out, dirs_out",
    [
        # by age in every pod's dir; a gone pod's dir emptied goes
        ([Listed("a", "1.wav", 0, 10), Listed("b", "2.wav", 95, 10)], 100, {"a"}, [("a", "1.wav")], ["a"]),
        # by size, oldest first across dirs
        (
            [Listed("a", "1.wav", 80, 10), Listed("b", "2.wav", 70, 10), Listed("b", "3.wav", 90, 10)],
            15,
            set(),
            [("a", "1.wav"), ("b", "2.wav")],
            [],
        ),
        # a write under way is never deleted, and its bytes count toward the bound
        (
            [Listed("a", ".1.wav.x.tmp", 99, 10), Listed("b", "2.wav", 90, 10)],
            15,
            {"a", "b"},
            [("b", "2.wav")],
            ["b"],
        ),
        # a temp file past the age bound goes
        ([Listed("a", ".1.wav.x.tmp", 0, 10)], 100, {"a"}, [("a", ".1.wav.x.tmp")], ["a"]),
        ([], 0, {"a"}, [], ["a"]),
    ],
)
def test_what_to_delete_given_a_listing_and_the_bounds(files, max_bytes, gone, files_out, dirs_out):
    found = doomed(files, now=100, max_age=60, max_bytes=max_bytes, gone=gone)
    assert list(found.files) == files_out and list(found.dirs) == dirs_out
