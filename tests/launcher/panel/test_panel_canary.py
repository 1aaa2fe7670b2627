"""The control panel's model roll-out (``panel/canary.py`` behind ``panel/server.py``), in
process with its real access files: the comparison shown while a canary runs, promote and
abort as buttons (admin only, the cookie's header, one at a time), what a failed promote says."""

from __future__ import annotations

import threading
import time

import pytest
from starlette.testclient import TestClient
from test_admin import panel, token  # noqa: F401  (a fixture and its token)

from cosyvoice_lb.launcher.canary.compare import Side, compare
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.panel.canary import CanaryControl
from cosyvoice_lb.launcher.panel.server import build_app
from cosyvoice_lb.launcher.state import canary as state
from cosyvoice_lb.launcher.state.canary import Canary, Thresholds


def samples(n: int, error: float) -> list[dict]:
    return [{"at": 10.0, "outcome": "ok", "first_chunk": 0.1, "total": 1.0, "error": error} for _ in range(n)]


class Buttons:
    """Stands in for the commands (the real ones run on a real cluster in the integration
    tests): record what was asked, hold until released, end as told."""

    def __init__(self):
        self.release, self.asked, self.fail = threading.Event(), [], ""

    def promote(self, layout, force, report):
        return self._run(("promote", force), report)

    def abort(self, layout, report):
        return self._run(("abort",), report)

    def _run(self, asked, report):
        self.asked.append(asked)
        report(type("P", (), {"detail": "starting instance-2 (surge)"})())
        self.release.wait(10)
        if self.fail:
            raise ClusterError(self.fail)


@pytest.fixture
def buttons(panel):  # noqa: F811
    _, layout, _ = panel
    fake = Buttons()
    found = compare(Side.of(samples(30, 0.1)), Side.of(samples(30, 0.9)), Thresholds())
    control = CanaryControl(layout, fake.promote, fake.abort, compare=lambda layout: found)
    app = build_app(layout, view=lambda: None, canary=control)
    with TestClient(app, base_url="http://127.0.0.1:8080", follow_redirects=False) as client:
        client.headers["authorization"] = f"Bearer {token(layout)}"
        yield client, layout, fake
    fake.release.set()


def test_without_a_canary_the_panel_says_none_and_buttons_are_refused(buttons):
    client, layout, fake = buttons
    assert client.get("/admin/api/canary").json() == {"rollout": None, "action": None}
    answer = client.post("/admin/api/canary/promote")
    assert answer.status_code == 404 and "no canary in progress" in answer.json()["error"]["message"]


def test_a_canary_in_progress_is_shown_with_both_sides_and_its_verdict(buttons):
    client, layout, fake = buttons
    state.write(layout, Canary(("instance-1",), {"engine": "simulated"}, "mirror", 10.0, time.time()))
    shown = client.get("/admin/api/canary").json()
    assert shown["rollout"]["summary"] == "instance-1 on --engine simulated (mirror 10%)"
    assert ["ASR error mean", "0.100", "0.900"] in shown["rows"]
    assert shown["verdict"] == "fail" and "speech check" in [f["name"] for f in shown["findings"] if not f["passed"]]


def test_buttons_need_the_admin_and_the_cookies_header(buttons):
    client, layout, fake = buttons
    state.write(layout, Canary(("instance-1",), {"engine": "simulated"}))
    anonymous = client.post("/admin/api/canary/abort", headers={"authorization": ""})
    assert anonymous.status_code == 401 and fake.asked == []
    assert client.post("/admin/api/canary/launch").status_code == 404


def test_promote_runs_once_at_a_time_and_says_how_it_ended(buttons):
    client, layout, fake = buttons
    state.write(layout, Canary(("instance-1",), {"engine": "simulated"}))
    started = client.post("/admin/api/canary/promote?force=1")
    assert started.status_code == 202 and started.json()["state"] == "running"
    again = client.post("/admin/api/canary/abort")
    assert again.status_code == 409 and "still running" in again.json()["error"]["message"]
    shown = client.get("/admin/api/canary").json()["action"]
    assert shown["state"] == "running" and "surge" in shown["detail"]
    fake.fail = "not promoted: the canary's verdict is fail"
    fake.release.set()

    def ended():
        return client.get("/admin/api/canary").json()["action"]["state"] != "running"

    deadline = time.monotonic() + 5
    while not ended() and time.monotonic() < deadline:
        time.sleep(0.02)
    step = client.get("/admin/api/canary").json()["action"]
    assert step["state"] == "failed" and "verdict is fail" in step["detail"]
    assert fake.asked == [("promote", True)]
