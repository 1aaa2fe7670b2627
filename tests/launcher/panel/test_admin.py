"""The control panel's HTTP edge (cosyvoice_lb/launcher/panel/server.py) in-process, with its real access
files: never open, the scrape token reads /metrics only, the login cookie changes nothing
without the panel's header, actions on instances, log tails."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import ROOT
from starlette.testclient import TestClient

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.cluster.status import ClusterStatus, InstanceStatus
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.panel.control import Actions
from cosyvoice_lb.launcher.panel.metrics import ClusterView
from cosyvoice_lb.launcher.panel.server import COOKIE, build_app
from cosyvoice_lb.launcher.plan.planner import Budget, Inventory, plan
from cosyvoice_lb.launcher.render.credentials import write_admin_access
from cosyvoice_lb.launcher.state import markers, record
from cosyvoice_lb.launcher.state.layout import Layout

GiB = 2**30


class SlowRestart:
    """Stands in for lifecycle.restart (a drained restart of a real cluster is tested with one):
    holds until released, then ends as told."""

    def __init__(self):
        self.release, self.asked, self.fail = threading.Event(), [], ""

    def __call__(self, layout, names, on_progress):
        self.asked.append(names)
        on_progress(type("P", (), {"detail": "waiting for instance-0 (loading)"})())
        self.release.wait(10)
        if self.fail:
            raise ClusterError(self.fail)
        return names


def serving(*names: str) -> ClusterStatus:
    return ClusterStatus(
        running=True,
        instances=[
            InstanceStatus(f"instance-{i}", 7860 + i, None, 42 + i, "RUNNING", True, f"instance-{i}" in names, 0, 1.0)
            for i in range(2)
        ],
    )


@pytest.fixture
def panel(tmp_path):
    layout = Layout(tmp_path)
    settings = Settings(state_dir=str(tmp_path))
    inventory = Inventory(gpus=(), cpu_cores=4, ram_total=16 * GiB, ram_available=16 * GiB, source="none")
    layout.run.mkdir(parents=True)
    layout.cluster_json.write_text(record.dump(settings, plan(inventory, Budget(GiB, GiB), instances=2)))
    write_admin_access(settings, layout)
    layout.logs.mkdir()
    layout.log("instance-0").write_text("".join(f"line {i}\n" for i in range(500)))
    status = ClusterStatus(
        running=True,
        url="http://127.0.0.1:8080",
        instances=[
            InstanceStatus("instance-0", 7860, None, 42, "RUNNING", True, True, 0, 12.0),
            InstanceStatus("instance-1", 7861, None, 43, "RUNNING", True, True, 0, 12.0),
        ],
    )
    restart = SlowRestart()
    app = build_app(layout, view=lambda: ClusterView(status=status, now=time.time()), actions=Actions(layout, restart))
    with TestClient(app, base_url="http://127.0.0.1:8080", follow_redirects=False) as client:
        yield client, layout, restart
    restart.release.set()


def token(layout: Layout) -> str:
    return layout.admin_token.read_text().splitlines()[-1]


def bearer(value: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {value}"}


def test_nothing_is_open_without_the_admin_token(panel):
    client, layout, _ = panel
    page = client.get("/admin", headers={"Accept": "text/html"})
    assert page.status_code == 303 and page.headers["location"] == "/admin/login"
    for path in ("/admin", "/admin/api/status", "/admin/api/logs/instance-0", "/metrics", "/metrics/instance-0"):
        answer = client.get(path)
        assert answer.status_code == 401, path
        assert (
            answer.headers["www-authenticate"].startswith("Bearer")
            and "admin token" in answer.json()["error"]["message"]
        )
    assert client.post("/admin/api/instances/instance-0/restart").status_code == 401
    assert client.get("/admin/api/status", headers=bearer("x" * 40)).status_code == 401
    assert not layout.drained("instance-0").exists()


def test_the_generated_tokens_are_private_and_distinct(panel):
    _, layout, _ = panel
    assert layout.admin_token.stat().st_mode & 0o777 == 0o600 and layout.scrape_token.stat().st_mode & 0o777 == 0o600
    scrape = layout.scrape_token.read_text()
    assert (
        scrape.strip() != token(layout) and "\n" not in scrape.strip() and "#" not in scrape
    )  # (read whole by Prometheus)
    assert token(layout) not in layout.admin_policy.read_text()  # digests only


def test_the_scrape_token_reads_metrics_and_nothing_else(panel):
    client, layout, _ = panel
    scrape = bearer(layout.scrape_token.read_text().strip())
    metrics = client.get("/metrics", headers=scrape)
    assert metrics.status_code == 200 and 'cosyvoice_lb_instance_up{name="instance-0"} 1.0' in metrics.text
    assert client.get("/admin/api/status", headers=scrape).status_code == 401
    assert client.post("/admin/api/instances/instance-0/drain", headers=scrape).status_code == 401
    assert not layout.drained("instance-0").exists()


def test_the_admin_token_drains_and_returns_an_instance(panel):
    client, layout, _ = panel
    admin = bearer(token(layout))
    answer = client.post("/admin/api/instances/instance-1/drain", headers=admin)
    assert answer.status_code == 200 and answer.json()["state"] == "done"
    assert markers.drained_by_hand(layout, "instance-1")
    assert client.post("/admin/api/instances/instance-1/undrain", headers=admin).status_code == 200
    assert not markers.drained_by_hand(layout, "instance-1")
    status = client.get("/admin/api/status", headers=admin).json()
    assert [i["name"] for i in status["instances"]] == ["instance-0", "instance-1"]
    assert status["instances"][1]["action"]["action"] == "undrain"


def test_a_restart_runs_in_the_background_one_at_a_time(panel):
    client, layout, restart = panel
    admin = bearer(token(layout))
    first = client.post("/admin/api/instances/instance-0/restart", headers=admin)
    assert first.status_code == 202 and first.json()["state"] == "running"
    again = client.post("/admin/api/instances/instance-0/drain", headers=admin)
    assert again.status_code == 409 and "busy" in again.json()["error"]["message"]
    action = client.get("/admin/api/status", headers=admin).json()["instances"][0]["action"]
    assert action["state"] == "running" and "loading" in action["detail"]
    restart.release.set()
    deadline = time.monotonic() + 5
    while client.get("/admin/api/status", headers=admin).json()["instances"][0]["action"]["state"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert restart.asked == [["instance-0"]]
    assert client.get("/admin/api/status", headers=admin).json()["instances"][0]["action"]["state"] == "done"


def test_a_failed_restart_says_why(panel):
    client, layout, restart = panel
    restart.fail = "instance-0 could not start: CUDA out of memory"
    restart.release.set()
    client.post("/admin/api/instances/instance-0/restart", headers=bearer(token(layout)))
    deadline = time.monotonic() + 5
    while (action := client.get("/admin/api/status", headers=bearer(token(layout))).json()["instances"][0]["action"])[
        "state"
    ] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert action["state"] == "failed" and "CUDA out of memory" in action["detail"]


@pytest.mark.parametrize(
    "path, status, words",
    [
        ("/admin/api/instances/instance-9/restart", 404, "no instance named 'instance-9'"),
        ("/admin/api/instances/instance-0/reboot", 404, "no action 'reboot'"),
    ],
)
def test_unknown_instances_and_actions_are_404(panel, path, status, words):
    client, layout, _ = panel
    answer = client.post(path, headers=bearer(token(layout)))
    assert answer.status_code == status and words in answer.json()["error"]["message"]


def test_an_action_is_a_post(panel):
    client, layout, _ = panel
    answer = client.get("/admin/api/instances/instance-0/restart", headers=bearer(token(layout)))
    assert answer.status_code == 405 and answer.json()["error"]["status"] == 405


def test_the_login_sets_a_strict_cookie_that_changes_nothing_without_the_panels_header(panel):
    client, layout, _ = panel
    assert "Admin token" in client.get("/admin/login").text
    wrong = client.post("/admin/login", data={"token": "not-the-token-at-all"})
    assert wrong.status_code == 401 and "not an admin token" in wrong.text
    login = client.post("/admin/login", data={"token": token(layout)})
    assert login.status_code == 303 and login.headers["location"] == "/admin"
    cookie = login.headers["set-cookie"]
    assert f"{COOKIE}=" in cookie and "Path=/admin" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert client.get("/admin").status_code == 200 and "Instances" in client.get("/admin").text
    refused = client.post("/admin/api/instances/instance-0/drain")  # a form on another site could do this much
    assert refused.status_code == 403 and not markers.drained_by_hand(layout, "instance-0")
    assert client.post("/admin/api/instances/instance-0/drain", headers={"X-Cvlb-Admin": "1"}).status_code == 200
    assert client.get("/metrics").status_code == 401  # (the cookie is the panel's: Path=/admin)
    client.post("/admin/logout")
    assert client.get("/admin/api/status").status_code == 401


def test_a_new_admin_token_file_locks_out_the_old_token_and_its_sessions(panel, tmp_path):
    client, layout, _ = panel
    old = token(layout)
    client.post("/admin/login", data={"token": old})
    tokens = tmp_path / "admin-tokens"
    tokens.write_text("# rotated\n" + "n" * 40 + "\n")
    tokens.chmod(0o600)
    write_admin_access(Settings(state_dir=str(tmp_path), admin_token_file=str(tokens)), layout)
    assert client.get("/admin/api/status").status_code == 401  # the session of the old token
    assert client.get("/admin/api/status", headers=bearer(old)).status_code == 401
    assert client.get("/admin/api/status", headers=bearer("n" * 40)).status_code == 200


def test_log_tails(panel):
    client, layout, _ = panel
    admin = bearer(token(layout))
    tail = client.get("/admin/api/logs/instance-0?lines=3", headers=admin)
    assert tail.status_code == 200 and tail.text == "line 497\nline 498\nline 499\n"
    assert client.get("/admin/api/logs/instance-0?lines=x", headers=admin).status_code == 400
    missing = client.get("/admin/api/logs/access", headers=admin)
    assert missing.status_code == 404 and "no log named 'access'" in missing.json()["error"]["message"]
    assert client.get("/admin/api/logs/..%2Frun%2Fadmin", headers=admin).status_code == 404


def test_an_unknown_instances_metrics_are_404(panel):
    client, layout, _ = panel
    answer = client.get("/metrics/instance-7", headers=bearer(token(layout)))
    assert answer.status_code == 404 and "instance-0, instance-1" in answer.json()["error"]["message"]


def test_the_page_is_the_panel(panel):
    client, layout, _ = panel
    page = client.get("/admin", headers=bearer(token(layout)))
    assert page.status_code == 200 and page.headers["cache-control"] == "no-store"
    assert (ROOT / "templates" / "admin.html").read_text() == page.text


def test_the_panel_never_takes_the_last_instance_serving(panel, tmp_path):
    _, layout, restart = panel
    actions = Actions(layout, restart, read_status=lambda _: serving("instance-0"))
    for action in ("restart", "drain"):
        with pytest.raises(RuntimeError, match="only instance serving: a .* now would leave none"):
            actions.start("instance-0", action)
    assert actions.start("instance-1", "drain").state == "done"  # it serves nothing: free to go
    assert restart.asked == [] and not markers.drained_by_hand(layout, "instance-0")


def test_one_restart_at_a_time(panel):
    _, layout, restart = panel
    actions = Actions(layout, restart, read_status=lambda _: serving("instance-0", "instance-1"))
    assert actions.start("instance-0", "restart").state == "running"
    with pytest.raises(RuntimeError, match="instance-0 is restarting: one restart at a time"):
        actions.start("instance-1", "restart")
    restart.release.set()


def test_a_drain_that_cannot_be_written_fails_without_leaving_the_instance_busy(panel, monkeypatch):
    _, layout, restart = panel
    actions = Actions(layout, restart, read_status=lambda _: serving("instance-0", "instance-1"))

    def full_disk(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("cosyvoice_lb.launcher.cluster.lifecycle.set_drained", full_disk)
    failed = actions.start("instance-1", "drain")
    assert failed.state == "failed" and "No space left" in failed.detail
    monkeypatch.undo()
    assert actions.start("instance-1", "drain").state == "done"


def test_a_slow_view_holds_one_caller_and_the_others_get_the_last_one():
    from cosyvoice_lb.launcher.panel.server import Cached

    now, calls, gate = [0.0], [], threading.Event()

    def make():
        calls.append(1)
        if len(calls) == 2:
            gate.wait(10)  # the second read hangs
        return ClusterView(status=ClusterStatus(running=True), now=len(calls))

    cached = Cached(make, seconds=1.0, clock=lambda: now[0])
    assert cached.get().now == 1 and cached.get().now == 1 and len(calls) == 1
    now[0] = 5.0
    slow = threading.Thread(target=cached.get)
    slow.start()
    while len(calls) < 2:
        time.sleep(0.01)
    assert cached.get().now == 1  # not held: the value before
    gate.set()
    slow.join(5)
    assert cached.get().now == 2 and len(calls) == 2
