"""The control panel's jobs: every owner's jobs read from the jobs process's own socket (the
real jobs API over a SqliteStore, served by uvicorn on a unix socket), owners shown by kind
only, a cancel; and the socket's /admin/jobs answered outside the gate that guards the API."""

from __future__ import annotations

import json
import time

import pytest
from conftest import uvicorn_serving
from starlette.testclient import TestClient

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.instance.access.auth import SHARED_OWNER, Policy, PolicyFile, digest
from cosyvoice_lb.jobs import model
from cosyvoice_lb.jobs.service import Config, build_app, known_owners, owner_kind
from cosyvoice_lb.jobs.store import SqliteStore
from cosyvoice_lb.launcher.cluster.status import ClusterStatus
from cosyvoice_lb.launcher.panel.metrics import ClusterView
from cosyvoice_lb.launcher.panel.server import build_app as panel_app
from cosyvoice_lb.launcher.plan.planner import Budget, Inventory, plan
from cosyvoice_lb.launcher.render.cluster import jobs_socket
from cosyvoice_lb.launcher.render.credentials import write_admin_access
from cosyvoice_lb.launcher.state import record
from cosyvoice_lb.launcher.state.layout import Layout

GiB = 2**30
ANN = "ann-token-0123456789abcdef"
TEXT = "One sentence of a job. Another sentence of it."


def policy_file(tmp_path) -> PolicyFile:
    path = tmp_path / "access.json"
    path.write_text(Policy(frozenset({digest(ANN)}), {"carol": "$2b$04$x"}, b"s" * 32).to_json())
    return PolicyFile(str(path))


def test_an_owner_is_shown_by_its_kind_and_every_known_owner_is_asked(tmp_path):
    assert owner_kind("token:0123456789abcdef") == "token" and owner_kind("user:carol") == "user"
    assert owner_kind(SHARED_OWNER) == SHARED_OWNER
    assert known_owners(None) == [SHARED_OWNER]
    assert known_owners(policy_file(tmp_path)) == ["token:" + digest(ANN)[:16], "user:carol", SHARED_OWNER]


def make(store: SqliteStore, owner: str, at: float) -> model.Job:
    job = model.new_job(owner, TEXT, 2, at, params={"voice": "alloy", "response_format": "mp3"})
    store.create(job, TEXT)
    return job


@pytest.fixture
def cluster(tmp_path):
    """A layout with the admin credentials, and the jobs API on run/jobs.sock over a real store."""
    layout = Layout(tmp_path)
    settings = Settings(state_dir=str(tmp_path))
    inventory = Inventory(gpus=(), cpu_cores=4, ram_total=16 * GiB, ram_available=16 * GiB, source="none")
    layout.run.mkdir(parents=True)
    layout.cluster_json.write_text(record.dump(settings, plan(inventory, Budget(GiB, GiB), instances=1)))
    write_admin_access(settings, layout)
    store = SqliteStore(tmp_path / "jobs" / "jobs.sqlite3")
    now = time.time()
    jobs = {
        "ann": make(store, "token:" + digest(ANN)[:16], now - 30),
        "carol": make(store, "user:carol", now - 20),
        "local": make(store, SHARED_OWNER, now - 10),
    }
    app = build_app(store, Config(state_dir=tmp_path, max_chars=5000), policy_file(tmp_path))
    panel = panel_app(layout, view=lambda: ClusterView(status=ClusterStatus(running=True), now=time.time()))
    with (
        uvicorn_serving(app, uds=str(jobs_socket(layout))),
        TestClient(panel, base_url="http://127.0.0.1:8080", follow_redirects=False) as client,
    ):
        yield client, layout, store, jobs, app
    store.close()


def admin(layout: Layout) -> dict[str, str]:
    return {"Authorization": f"Bearer {layout.admin_token.read_text().splitlines()[-1]}"}


def test_the_panel_lists_every_owners_jobs_newest_first_by_owner_kind_only(cluster):
    client, layout, _, jobs, _ = cluster
    assert client.get("/admin/api/jobs").status_code == 401
    answer = client.get("/admin/api/jobs", headers=admin(layout))
    assert answer.status_code == 200, answer.text
    data = answer.json()["data"]
    assert [j["id"] for j in data] == [jobs["local"].id, jobs["carol"].id, jobs["ann"].id]
    assert [j["owner"] for j in data] == ["local", "user", "token"]
    assert data[0]["status"] == "queued" and data[0]["progress"] == {"done": 0, "total": 2}
    assert digest(ANN)[:16] not in answer.text and "carol" not in answer.text
    page = client.get("/admin/jobs", headers=admin(layout))
    assert page.status_code == 200 and "/admin/api/jobs" in page.text


def test_the_panel_cancels_a_running_job_and_not_a_finished_one(cluster):
    client, layout, store, jobs, _ = cluster
    target = jobs["carol"].id
    answer = client.post(f"/admin/api/jobs/{target}/cancel", headers=admin(layout))
    assert answer.status_code == 200 and answer.json()["status"] == "cancelled"
    assert store.get(target, "user:carol").status == "cancelled"
    again = client.post(f"/admin/api/jobs/{target}/cancel", headers=admin(layout))
    assert again.status_code == 409 and "cancelled already" in again.json()["error"]["message"]
    assert store.get(target, "user:carol") is not None  # (the panel never removes a finished job)
    gone = client.post("/admin/api/jobs/job_nosuchjob0123456789ab/cancel", headers=admin(layout))
    assert gone.status_code == 404
    assert client.get("/admin/api/jobs/x/cancel", headers=admin(layout)).status_code == 405


def test_a_cancel_with_the_panels_cookie_needs_its_header(cluster):
    client, layout, _, jobs, _ = cluster
    token = layout.admin_token.read_text().splitlines()[-1]
    login = client.post("/admin/login", data={"token": token})
    assert login.status_code == 303
    refused = client.post(f"/admin/api/jobs/{jobs['ann'].id}/cancel")
    assert refused.status_code == 403
    done = client.post(f"/admin/api/jobs/{jobs['ann'].id}/cancel", headers={"X-Cvlb-Admin": "1"})
    assert done.status_code == 200 and done.json()["owner"] == "token" and done.json()["status"] == "cancelled"


def test_the_sockets_admin_route_is_outside_the_gate_and_the_api_is_not(cluster):
    _, _, _, jobs, app = cluster
    with TestClient(app) as direct:
        assert direct.get("/v1/audio/jobs").status_code == 401  # (the API asks credentials)
        listed = direct.get("/admin/jobs")
        assert listed.status_code == 200 and len(listed.json()["data"]) == 3
        assert direct.post("/admin/jobs").status_code == 405
        # (whatever nginx passed, it set X-Real-IP on: never the admin's)
        assert direct.get("/admin/jobs", headers={"X-Real-IP": "127.0.0.1"}).status_code == 403
        assert direct.delete("/admin/jobs/not-an-id").status_code == 404
        assert json.loads(direct.get("/admin/jobs").text)["object"] == "list"


def test_a_jobs_process_that_does_not_answer_is_a_503_that_names_its_log(cluster):
    client, layout, _, _, _ = cluster
    jobs_socket(layout).unlink()
    answer = client.get("/admin/api/jobs", headers=admin(layout))
    assert answer.status_code == 503 and "logs/jobs.log" in answer.json()["error"]["message"]
