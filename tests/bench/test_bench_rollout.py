"""bench/rollout.py's pure parts: reading nginx's rotation, the capacity trace's figures, the SVG."""

from __future__ import annotations

import math
import sys
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import jinja2
import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import rollout  # noqa: E402

SVG = "{http://www.w3.org/2000/svg}"


def render_upstreams(ports: list[int], out: set[str]) -> str:
    """The real template, as render.py fills it."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(ROOT / "templates")),
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["nq"] = str  # (render.py quotes paths with blanks; these have none)
    slots = [SimpleNamespace(name=f"instance-{i}", port=p, index=i) for i, p in enumerate(ports)]
    return env.get_template("upstreams.conf.j2").render(
        slots=slots, out_of_rotation=frozenset(out), overflow="/state/run/overflow.sock"
    )


def test_rotation_reads_the_api_upstream_of_the_real_template():
    text = render_upstreams([7861, 7862, 7863, 7864, 7865], {"instance-1", "instance-4"})
    assert rollout.rotation(text) == ["instance-0", "instance-2", "instance-3"]
    assert rollout.rotation(render_upstreams([7861, 7862], set())) == ["instance-0", "instance-1"]


def test_rotation_without_a_name_comment_or_the_block():
    text = (
        "upstream cvlb_api {\n    least_conn;\n    server 127.0.0.1:9 max_fails=0;\n"
        "    server 127.0.0.1:10 max_fails=0 down;\n}\nupstream other {\n    server 127.0.0.1:11;\n}\n"
    )
    assert rollout.rotation(text) == ["127.0.0.1:9"]
    assert rollout.rotation("") == []


TRACE = [(-0.5, 4), (0.0, 4), (0.5, 3), (1.0, 3), (1.5, 4), (2.0, 3), (2.5, 4), (3.0, 4)]


def test_trace_figures():
    assert rollout.level_before(TRACE) == 4
    assert rollout.seconds_below(TRACE, 4) == pytest.approx(1.5)  # 0.5..1.5 and 2.0..2.5
    assert rollout.seconds_below(TRACE, 4, start=0.75, end=2.25) == pytest.approx(1.0)
    assert rollout.seconds_below(TRACE, 3) == 0
    assert rollout.first_at(TRACE, 4, after=0.5) == 1.5
    assert rollout.first_at(TRACE, 5) is None


def test_latency_says_what_its_p99_rests_on():
    lat = rollout.Latency.of([0.1] * 99 + [1.0])
    assert lat.samples == 100 and lat.p50_ms == pytest.approx(100) and lat.at_or_above_p99 == 1
    assert rollout.Latency.of([]).samples == 0 and math.isnan(rollout.Latency.of([]).p99_ms)


def test_table_cells_put_variants_side_by_side_with_the_ratio():
    drain = rollout.Outcome("drain-first", [], below_s=8.0, restart_s=40.0)
    surge = rollout.Outcome("surge 1", [], below_s=0.0, restart_s=50.0)
    rows = {name: (cells, r) for name, cells, r in rollout.cells([drain, surge], rollout.ROLLING_ROWS)}
    assert rows["restart wall s"] == (["40.0", "50.0"], "1.25")
    assert rows["s below starting capacity"] == (["8.0", "0.0"], "0.00")
    rows = {name: (cells, r) for name, cells, r in rollout.cells([drain, "not run: no --surge"], rollout.ROLLING_ROWS)}
    assert rows["restart wall s"] == (["40.0", "not run: no --surge"], "—")


def test_svg_draws_one_step_line_per_variant_with_a_legend():
    text = rollout.svg(
        [
            ("rolling", "seconds since the restart", {"drain-first": TRACE, "surge 1": [(0, 4), (1, 5)]}),
            ("crash", "seconds since the kill", {"no spare": TRACE}),
        ]
    )
    root = ET.fromstring(text)  # well-formed
    lines = root.findall(f"{SVG}polyline")
    assert len(lines) == 3 and len({line.get("stroke") for line in lines[:2]}) == 2
    labels = [t.text for t in root.findall(f"{SVG}text")]
    assert {"drain-first", "surge 1", "no spare", "seconds since the kill"} <= set(labels)
    width, height = (float(v) for v in root.get("viewBox").split()[2:])
    for line in lines:
        points = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
        assert all(0 <= x <= width and 0 <= y <= height for x, y in points)
    first = [tuple(map(float, p.split(","))) for p in lines[0].get("points").split()]
    assert len(first) == 2 * (len(TRACE) - 1)  # a step: each sample holds until the next
    assert first[0][1] == first[1][1] and first[1][0] == first[2][0]  # flat, then vertical
    assert "5" in labels and "6" not in labels  # y axis 0..5
