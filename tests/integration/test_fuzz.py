"""POST /v1/tts fuzzed from its own OpenAPI description, at CI size, on a real cluster.

The generator is bench/fuzz.py's (hypothesis + hypothesis-jsonschema's ``from_schema`` on
the JSON and multipart request body schemas the instance serves at /openapi.json): valid
bodies, random JSON, valid bodies with a field replaced, extra fields or edge-case literals,
random bytes, valid and broken multipart forms. ``python bench/fuzz.py`` is the long run.

The seed is fixed so a failure reproduces; ``CVLB_FUZZ_SEED`` and ``CVLB_FUZZ_CASES`` change
it and the number of cases.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from conftest import ROOT, cli, free_port_block, status

pytest.importorskip("hypothesis_jsonschema", reason="the fuzz run needs hypothesis-jsonschema (pip install -e .[test])")

sys.path.insert(0, str(ROOT / "bench"))
import fuzz  # noqa: E402  (bench/fuzz.py)

INSTANCES = 2
CASES = int(os.environ.get("CVLB_FUZZ_CASES", "200"))
SEED = int(os.environ.get("CVLB_FUZZ_SEED", "20261130"))
MAX_SECONDS = 45.0


@pytest.fixture(scope="module")
def run():
    state_dir = Path(tempfile.mkdtemp(prefix="cvlb-", dir="/tmp"))  # short: supervisord's socket
    port, base = free_port_block(1), free_port_block(INSTANCES)
    url = f"http://127.0.0.1:{port}"
    try:
        done = cli(
            "up",
            "--engine",
            "espeak",
            "--instances",
            str(INSTANCES),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--base-port",
            str(base),
            "--state-dir",
            str(state_dir),
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        before = status(state_dir)[1]["instances"]
        cases = fuzz.generate(fuzz.fetch_schemas(url), CASES, SEED)
        results = fuzz.send(url, cases, workers=INSTANCES, max_seconds=MAX_SECONDS)
        after = status(state_dir)
        kinds = Counter(o.case.kind for o in results.outcomes)
        print(
            f"\nfuzz: {len(results.outcomes)} cases (seed {SEED}) in {results.seconds:.1f}s; "
            f"statuses {dict(results.statuses)}; categories {dict(kinds)}"
        )
        yield {"results": results, "cases": cases, "before": before, "after": after}
    finally:
        cli("down", "--state-dir", str(state_dir), timeout=120)
        shutil.rmtree(state_dir, ignore_errors=True)


def listing(outcomes: list[fuzz.Outcome], limit: int = 10) -> str:
    return "\n".join(f"{o.status} {o.case.describe(200)}\n    -> {o.detail[:300]!r}" for o in outcomes[:limit])


def test_every_case_was_sent_and_answered(run):
    results = run["results"]
    assert len(run["cases"]) == CASES
    assert results.skipped == 0, f"{results.skipped} cases not sent within {MAX_SECONDS}s"
    assert len(results.outcomes) == CASES
    assert results.unanswered == [], listing(results.unanswered)
    # every category of the generator was exercised
    assert {o.case.kind for o in results.outcomes} == {
        "valid-json",
        "random-json",
        "replaced-field",
        "extra-fields",
        "edge-literal",
        "random-bytes",
        "valid-multipart",
        "broken-multipart",
    }


def test_no_server_errors(run):
    errors = run["results"].server_errors
    assert errors == [], f"{len(errors)} server error(s):\n{listing(errors)}"


def test_every_refusal_says_what_is_wrong(run):
    bare = run["results"].without_message
    assert bare == [], f"{len(bare)} 4xx answer(s) without error.message:\n{listing(bare)}"


def test_the_instances_did_not_restart(run):
    code, after = run["after"]
    assert [(i["name"], i["pid"]) for i in after["instances"]] == [(i["name"], i["pid"]) for i in run["before"]]
    assert [i["restarts"] for i in after["instances"]] == [0] * INSTANCES
    assert code == 0, after["problems"]
