"""A model roll-out's canary in the rendered configs: its slot runs the new settings, stays out
of the serving pools, and nginx mirrors (or shares) synthesis requests to it; the real nginx
accepts every variant."""

from __future__ import annotations

import re
import shlex

import pytest
from test_render import (
    NGINX,
    PROGRAMS,
    Layout,
    cpu_plan,
    nginx_test,
    parse_nginx,
    public_server,
    state_dir,  # noqa: F401  (a fixture)
    supervisor_sections,
    upstream_servers,
    write,
)

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.plan.planner import Budget, Inventory, plan
from cosyvoice_lb.launcher.render.cluster import render, render_upstreams
from cosyvoice_lb.launcher.render.credentials import write_segment_key
from cosyvoice_lb.launcher.state.canary import Canary

SETTINGS = Settings(engine="flite")
GiB = 1 << 30
CANARY_FLAG = re.compile(r"--canary(?![-\w])")


def parked_plan():
    """Two serving CPU slots and one parked (--surge 1): instance-2 is the canary's room."""
    inventory = Inventory(gpus=(), cpu_cores=8, ram_total=64 * GiB, ram_available=64 * GiB, source="none")
    return plan(inventory, Budget(5 * GiB, 512 << 20), instances=2, surge=1)


def canary(mode="mirror", percent=10.0, slot="instance-2") -> Canary:
    return Canary((slot,), {"engine": "simulated", "asr": "pocketsphinx"}, mode, percent)


def commands(files: dict[str, str], root) -> dict[str, list[str]]:
    sections = supervisor_sections(files["run/supervisord.conf"])
    return {
        name.split(":", 1)[1]: shlex.split(sections.get(name, "command"))
        for name in sections.sections()
        if name.startswith("program:instance-")
    }


def test_the_canary_slot_runs_its_settings_and_routes_nothing_on(tmp_path):
    files = render(SETTINGS, parked_plan(), Layout(tmp_path), PROGRAMS, canary=canary())
    argv = commands(files, tmp_path)
    assert argv["instance-2"][argv["instance-2"].index("--engine") + 1] == "simulated"
    assert argv["instance-2"][argv["instance-2"].index("--asr") + 1] == "pocketsphinx"
    assert "--canary" in argv["instance-2"] and "--board" not in argv["instance-2"]
    assert "--balancer" not in argv["instance-2"]  # (its copies never fan out to the serving side)
    for name in ("instance-0", "instance-1"):
        assert argv[name][argv[name].index("--engine") + 1] == "flite" and "--canary" not in argv[name]
        assert "--board" in argv[name]


def test_without_a_canary_nothing_is_marked_and_nothing_is_mirrored(tmp_path):
    files = render(SETTINGS, parked_plan(), Layout(tmp_path), PROGRAMS)
    server = public_server(parse_nginx(files["nginx/nginx.conf"]).one("http"))
    assert ["X-Cvlb-Cohort", ""] in server.values("proxy_set_header")  # (a client's own mark is dropped)
    assert not server.one("location", "/v1/").all("mirror")
    assert "cvlb_canary" not in files["nginx/upstreams.conf"]
    assert not CANARY_FLAG.search(files["run/supervisord.conf"])


def test_a_canary_on_a_slot_that_serves_is_not_rendered(tmp_path):
    files = render(SETTINGS, parked_plan(), Layout(tmp_path), PROGRAMS, canary=canary(slot="instance-1"))
    assert not CANARY_FLAG.search(files["run/supervisord.conf"]) and "mirror" not in files["nginx/nginx.conf"]


def test_mirror_copies_picked_synthesis_requests_to_the_canary_alone(tmp_path):
    files = render(SETTINGS, parked_plan(), Layout(tmp_path), PROGRAMS, canary=canary("mirror", 12.5))
    http = parse_nginx(files["nginx/nginx.conf"]).one("http")
    split = http.one("split_clients")
    assert split.values("12.5%") == [["canary"]] and split.values("*") == [[""]]
    server = public_server(http)
    api = server.one("location", "/v1/")
    assert api.values("mirror") == [["/_cvlb/canary"]] and api.values("proxy_pass") == [["http://$cvlb_api_pool"]]
    copy = server.one("location", "=", "/_cvlb/canary")
    assert copy.values("proxy_pass") == [["http://cvlb_canary$request_uri"]]
    assert copy.values("proxy_next_upstream") == [["off"]]  # never retried on a serving instance
    assert ["X-Cvlb-Cohort", "canary"] in copy.values("proxy_set_header")
    assert ["X-Cvlb-Cohort", "$cvlb_cohort"] in server.values("proxy_set_header")
    upstreams = parse_nginx(files["nginx/upstreams.conf"])
    ports = {s.name: s.port for s in parked_plan().slots}
    for pool in ("cvlb_api", "cvlb_ui", "cvlb_segments", "cvlb_instances"):
        assert ports["instance-2"] not in upstream_servers(upstreams, pool), pool
    assert list(upstream_servers(upstreams, "cvlb_canary")) == [ports["instance-2"]]
    assert not upstreams.one("upstream", "cvlb_canary").all("server", f"127.0.0.1:{ports['instance-0']}")


def test_share_serves_the_canary_with_the_serving_instances_as_its_backups(tmp_path):
    ports = {s.name: s.port for s in parked_plan().slots}
    files = render(SETTINGS, parked_plan(), Layout(tmp_path), PROGRAMS, canary=canary("share", 5))
    http = parse_nginx(files["nginx/nginx.conf"]).one("http")
    split = http.one("split_clients")
    assert split.values("5%") == [["canary"], ["serving"]]
    api = public_server(http).one("location", "/v1/")
    assert api.values("proxy_pass") == [["http://$cvlb_pool"]] and not api.all("mirror")
    text = render_upstreams(parked_plan().slots, frozenset({"instance-1"}), canary=canary("share", 5))
    share = parse_nginx(text).one("upstream", "cvlb_canary_share").values("server")
    assert [f"127.0.0.1:{ports['instance-2']}", "max_fails=0"] in share
    assert [f"127.0.0.1:{ports['instance-0']}", "max_fails=0", "backup"] in share
    assert not [a for a in share if a[0].endswith(f":{ports['instance-1']}")]  # (out of rotation: no backup)


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed")
@pytest.mark.parametrize(("mode", "percent"), [("mirror", 10.0), ("share", 33.33), ("mirror", 100.0)])
def test_nginx_accepts_the_canary_configs(state_dir, mode, percent):  # noqa: F811
    the_plan = parked_plan()
    write(state_dir, render(SETTINGS, the_plan, Layout(state_dir), PROGRAMS, canary=canary(mode, percent)))
    write_segment_key(Layout(state_dir))
    done = nginx_test(state_dir)
    assert done.returncode == 0, done.stderr
    # the canary out of its pool (loading, or taken out): still a config nginx loads
    everyone = frozenset(s.name for s in the_plan.slots)
    Layout(state_dir).upstreams_conf.write_text(render_upstreams(the_plan.slots, everyone, canary=canary(mode)))
    done = nginx_test(state_dir)
    assert done.returncode == 0, done.stderr


def test_a_cpu_plan_without_parked_slots_takes_no_canary(tmp_path):
    files = render(SETTINGS, cpu_plan(), Layout(tmp_path), PROGRAMS, canary=canary(slot="instance-1"))
    assert "cvlb_canary" not in files["nginx/upstreams.conf"]
