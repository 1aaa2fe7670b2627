"""Backups of voices and jobs, for real: a voice registry and an SQLite job store in a state
dir, written to while the backup is taken; the backup restored into another state dir and
read back through the same registry and store the cluster uses; the CLI as a subprocess."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.instance.speech.voices import Registry
from cosyvoice_lb.jobs import model
from cosyvoice_lb.jobs.model import Result
from cosyvoice_lb.jobs.store import SqliteStore, sqlite_path
from cosyvoice_lb.launcher.cluster.backup import MANIFEST, BackupError, Sources, read_manifest, restore, take

T0 = 1_800_000_000.0
TONE = (0.2 * np.sin(np.linspace(0, 2 * np.pi * 220 * 3, 16000 * 3))).astype(np.float32)


def cluster_data(state: Path) -> tuple[Sources, SqliteStore, str, str]:
    """A state dir with one saved voice and two jobs, one finished with its audio on disk."""
    sources = Sources.of(state, Settings())
    voice = Registry(sources.voices).create("narrator", TONE, 16000, "the transcript", consent="yes")
    store = SqliteStore(sqlite_path(state))
    done = model.new_job("token:a", "One. Two.", 2, T0)
    store.create(done, "One. Two.")
    store.create(model.new_job("token:b", "Three.", 1, T0 + 1), "Three.")
    sources.results.mkdir(parents=True)
    audio = sources.results / f"{done.id}.wav"
    audio.write_bytes(b"RIFF" + b"\0" * 100)
    claimed = store.claim_next("runner-1", 60, T0 + 2)
    assert claimed is not None and claimed.id == done.id
    for index in range(2):
        store.segment_done(done.id, index, T0 + 2)
    store.finish(done.id, "runner-1", model.SUCCEEDED, T0 + 1, result=Result(path=str(audio), bytes=104))
    return sources, store, voice.id, done.id


def test_a_backup_taken_while_the_store_is_open_restores_voices_and_jobs(tmp_path):
    sources, store, voice_id, job_id = cluster_data(tmp_path / "state")
    # a voice half built and one half deleted: never in a backup
    (sources.voices / f".new-{voice_id[:-1]}0").mkdir()
    (sources.voices / f".gone-{voice_id}-abcd1234").mkdir()
    assert Path(f"{sqlite_path(tmp_path / 'state')}-wal").exists()  # the jobs are (partly) in the WAL

    manifest = take(sources, tmp_path / "backup", clock=lambda: T0 + 5)
    store.close()

    assert (manifest.voices, manifest.jobs, manifest.results, manifest.redis) == (1, 2, 1, False)
    assert read_manifest(tmp_path / "backup") == manifest
    assert sorted(p.name for p in (tmp_path / "backup" / "voices").iterdir()) == [".names", voice_id]
    assert stat.S_IMODE(os.stat(tmp_path / "backup" / "jobs" / "jobs.sqlite3").st_mode) == 0o600
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]

    # restored into the same place after a loss: everything back, the same paths
    lost = tmp_path / "state"
    for path in (sources.voices, sources.results.parent):
        subprocess.run(["rm", "-rf", str(path)], check=True)
    lines = restore(tmp_path / "backup", sources, clock=lambda: T0 + 9)
    assert lines[0].startswith("voices: 1 added")
    assert Registry(sources.voices).require("narrator").id == voice_id
    back = SqliteStore(sqlite_path(lost))
    try:
        job = back.get(job_id, "token:a")
        assert (
            job is not None
            and job.status == model.SUCCEEDED
            and Path(job.result_path or "").read_bytes()[:4] == b"RIFF"
        )
        assert back.counts()["queued"] == 1
    finally:
        back.close()


def test_restoring_keeps_voices_there_and_moves_the_old_store_aside(tmp_path):
    sources, store, voice_id, _ = cluster_data(tmp_path / "state")
    take(sources, tmp_path / "backup")
    store.close()
    other = Sources.of(tmp_path / "other", Settings())
    mine = Registry(other.voices).create("mine", TONE, 16000, "text", consent="yes")
    SqliteStore(other.store or Path()).close()

    lines = restore(tmp_path / "backup", other, clock=lambda: 1234)
    assert {v.id for v in Registry(other.voices).all()} == {voice_id, mine.id}
    assert (other.store or Path()).with_name("jobs.sqlite3.before-restore-1234").exists()
    assert any("moved aside" in line for line in lines)
    # the jobs name their audio where the backup's cluster kept it: said, with the fix
    assert any(f"--job-results {sources.results}" in line for line in lines)
    # restoring twice adds nothing twice
    assert restore(tmp_path / "backup", other, clock=lambda: 1235)[0].startswith("voices: 0 added")


def test_a_backup_never_overwrites_and_a_failed_one_leaves_nothing(tmp_path):
    sources, store, _, _ = cluster_data(tmp_path / "state")
    (tmp_path / "taken").mkdir()
    with pytest.raises(BackupError, match="exists: give a new directory"):
        take(sources, tmp_path / "taken")
    with pytest.raises(BackupError, match="is not a directory: create it first"):
        take(sources, tmp_path / "nowhere" / "backup")
    # a store that is not a database: the backup fails whole, no partial directory stays
    store.close()
    sqlite_path(tmp_path / "state").write_bytes(b"not a database at all" * 100)
    for suffix in ("-wal", "-shm"):
        Path(f"{sqlite_path(tmp_path / 'state')}{suffix}").unlink(missing_ok=True)
    with pytest.raises(BackupError, match="nothing was written"):
        take(sources, tmp_path / "backup")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state", "taken"]


def test_jobs_in_redis_are_left_to_redis_and_said_so(tmp_path):
    sources = Sources.of(tmp_path / "state", Settings(jobs_redis="redis://127.0.0.1:1/0"))
    assert sources.store is None
    manifest = take(sources, tmp_path / "backup")
    assert manifest.jobs is None and manifest.redis
    assert "in Redis, not copied (back it up with Redis: BGSAVE)" in " ".join(manifest.lines(tmp_path / "backup"))


def test_a_directory_that_is_not_a_backup_is_refused(tmp_path):
    with pytest.raises(BackupError, match="is not a backup"):
        restore(tmp_path, Sources.of(tmp_path / "state", Settings()))
    (tmp_path / MANIFEST).write_text("{")
    with pytest.raises(BackupError, match="the backup is damaged"):
        restore(tmp_path, Sources.of(tmp_path / "state", Settings()))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cosyvoice_lb.launcher.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_the_cli_backs_up_and_restores_a_state_dir(tmp_path):
    state = tmp_path / "state"
    sources, store, voice_id, _ = cluster_data(state)
    store.close()
    done = cli("backup", "--state-dir", str(state), str(tmp_path / "b"))
    assert done.returncode == 0, done.stderr
    assert "voices: 1" in done.stdout and "jobs: 2" in done.stdout
    again = cli("backup", "--state-dir", str(state), str(tmp_path / "b"))
    assert again.returncode != 0 and "exists: give a new directory" in again.stderr
    assert json.loads((tmp_path / "b" / MANIFEST).read_text())["voices"] == 1

    fresh = tmp_path / "fresh"
    back = cli("restore", "--state-dir", str(fresh), str(tmp_path / "b"))
    assert back.returncode == 0, back.stderr
    assert Registry(fresh / "voices").require("narrator").id == voice_id
    refused = cli("restore", "--state-dir", str(fresh), str(tmp_path / "state"))
    assert refused.returncode != 0 and "is not a backup" in refused.stderr
