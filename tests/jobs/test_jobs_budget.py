"""Jobs' results count toward --outputs-max-size (cosyvoice_lb/jobs/budget.py): the rule, and
a sweep over real files and a real SqliteStore, as the API then shows the expired job."""

from __future__ import annotations

from starlette.testclient import TestClient

from cosyvoice_lb.instance.access.auth import SHARED_OWNER
from cosyvoice_lb.jobs import model
from cosyvoice_lb.jobs.__main__ import Retention
from cosyvoice_lb.jobs.budget import Budget, Held, to_free
from cosyvoice_lb.jobs.service import Config, build_app
from cosyvoice_lb.jobs.store import SqliteStore

TEXT = "One sentence here. Another one there."


def test_the_oldest_finished_go_first_until_within_the_budget():
    held = [Held("a", 400), Held("b", 0), Held("c", 300), Held("d", 500)]
    assert to_free(held, used=1000, budget=2000) == []
    assert to_free(held, used=1000, budget=1000) == []
    assert to_free(held, used=1001, budget=1000) == ["a"]
    assert to_free(held, used=1500, budget=900) == ["a", "c"]  # (b holds nothing: skipped)
    assert to_free(held, used=5000, budget=100) == ["a", "c", "d"]  # (all there is: still over)


def make(store, results, at: float, size: int, finish: bool = True) -> model.Job:
    job = model.new_job(SHARED_OWNER, TEXT, 1, at, params={"response_format": "wav"})
    store.create(job, TEXT)
    claimed = store.claim_next("runner", 30.0, at)
    assert claimed is not None and claimed.id == job.id
    folder = results / job.id
    folder.mkdir(parents=True)
    if not finish:
        (folder / "seg-00001.wav").write_bytes(b"s" * size)
        return job
    store.segment_done(job.id, 0, at)
    (folder / "audio.wav").write_bytes(b"a" * size)
    (folder / "plan.json").write_text("{}")
    store.finish(job.id, "runner", model.SUCCEEDED, at + 1, result=model.Result(str(folder / "audio.wav"), size))
    return job


def test_a_sweep_expires_the_oldest_results_never_a_running_job(tmp_path):
    outputs, results = tmp_path / "outputs", tmp_path / "jobs" / "results"
    outputs.mkdir(parents=True)
    (outputs / "20260101-000000-7860-abc.wav").write_bytes(b"o" * 3000)
    store = SqliteStore(tmp_path / "jobs" / "jobs.sqlite3")
    try:
        old = make(store, results, 100.0, 4000)
        newer = make(store, results, 200.0, 4000)
        running = make(store, results, 50.0, 6000, finish=False)  # (the oldest of all: running)
        budget = Budget(outputs, results, 14_000, shown="14KB")
        Retention(store, results, max_age=10**9, budget=budget).sweep(now=300.0)
        # 3000 + 4000 + 4000 + 6000 (+ plans) > 14000: the oldest finished goes, and that is enough
        assert not (results / old.id / "audio.wav").exists()
        assert (results / newer.id / "audio.wav").exists()
        assert (results / running.id / "seg-00001.wav").exists()
        assert (outputs / "20260101-000000-7860-abc.wav").exists()  # (the instances' own sweep keeps those)
        assert budget.enforce(store, 300.0) == []  # within it now

        with TestClient(build_app(store, Config(state_dir=tmp_path))) as client:
            shown = client.get(f"/v1/audio/jobs/{old.id}").json()
            assert shown["status"] == "expired" and shown["bytes"] is None
            assert "--outputs-max-size 14KB" in shown["error"]["message"]
            content = client.get(f"/v1/audio/jobs/{old.id}/content")
            assert content.status_code == 410 and "expired" in content.json()["error"]["message"]
            assert client.get(f"/v1/audio/jobs/{newer.id}/content").status_code == 200
            listed = {job["id"]: job["status"] for job in client.get("/v1/audio/jobs").json()["data"]}
            assert listed == {old.id: "expired", newer.id: "succeeded", running.id: "running"}
            assert client.delete(f"/v1/audio/jobs/{old.id}").json()["deleted"] is True
        assert not (results / old.id).exists()
    finally:
        store.close()


def test_on_a_pods_shared_volume_the_budget_counts_the_volume_and_the_results_in_it_once(tmp_path):
    from cosyvoice_lb.common.settings import Settings
    from cosyvoice_lb.jobs.__main__ import outputs_budget
    from cosyvoice_lb.launcher.state.layout import Layout

    volume = tmp_path / "outputs"
    environ = {"POD_NAME": "pod-a", "COSYVOICE_LB_OUTPUTS_DIR": str(volume / "pod-a")}
    settings = Settings(job_results=str(volume / ".jobs"), outputs_max_size="10KiB")
    budget = outputs_budget(settings, Layout(tmp_path / "state"), environ)
    assert budget.outputs == volume and budget.results == volume / ".jobs"  # (every pod's dir, as the sweep)
    assert outputs_budget(Settings(), Layout(tmp_path / "state"), {}).outputs == tmp_path / "state" / "outputs"
    for pod in ("pod-a", "pod-b"):
        (volume / pod).mkdir(parents=True)
        (volume / pod / "20260101-000000-7860-abc.wav").write_bytes(b"o" * 2000)
    store = SqliteStore(tmp_path / "jobs.sqlite3")
    try:
        job = make(store, budget.results, 100.0, 5000)
        # 2000 + 2000 + 5000 (+ its plan) is within 10 KiB: counted twice, it would not be
        assert budget.enforce(store, 300.0) == []
        (volume / "pod-b" / "20260101-000001-7860-abd.wav").write_bytes(b"o" * 2000)  # now past it
        assert budget.enforce(store, 300.0) == [job.id]
    finally:
        store.close()
