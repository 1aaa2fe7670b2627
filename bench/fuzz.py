#!/usr/bin/env python3
"""Fuzz ``POST /v1/tts`` from the instance's own OpenAPI description, through nginx.

    python bench/fuzz.py [--cases 1000] [--seed N] [--instances 2] [--workers N]
                         [--max-seconds 300] [--engine espeak|simulated] [--save DIR]

It starts its own cluster with the CLI (``cosyvoice-lb up --engine espeak``) on a free
127.0.0.1 port block and a short state dir under /tmp, reads ``/openapi.json`` through
nginx, and builds its cases with hypothesis from the two request body schemas there
(``application/json`` and ``multipart/form-data``, via hypothesis-jsonschema's
``from_schema``). Each case is one of:

  valid-json         a body the JSON schema accepts
  random-json        any JSON value (NaN and ±Infinity literals included)
  replaced-field     a valid body with one field replaced by a random JSON value
  extra-fields       a valid body with random extra fields
  edge-literal       a valid body with one value replaced by an edge-case literal written
                     as raw JSON text (NaN, 1e999, thousands of digits, lone surrogates,
                     deep nesting, ...)
  random-bytes       random bytes under a random Content-Type
  valid-multipart    a form the multipart schema accepts, with no prompt_audio, random
                     bytes, or a small WAV (odd rates, 0 frames, truncated) as prompt_audio
  broken-multipart   such a form truncated, with a wrong boundary, or with bytes flipped

The cases go to the cluster from a few threads, at most ``--cases`` of them and at most
``--max-seconds``. Printed: the command, the cluster's command line, a table of the answers
by category and status, and every server error (5xx) and unanswered request with its
request. Exit 0 when no answer was a 5xx, every request was answered and the instances'
pids and restart counts did not change; else 1. The cluster is taken down (and its state
dir removed) in all cases, also on errors, Ctrl-C and SIGTERM.

``--save DIR`` keeps every 5xx and unanswered request as files, to replay them. The same
seed gives the same cases only for the same code: hypothesis mixes literals it finds in
the loaded source files (this one's included) into what it generates.

``tests/integration/test_fuzz.py`` runs the same generator (``generate``/``send``) at CI size.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import requests
import soundfile
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from urllib3.filepost import encode_multipart_formdata

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import Interrupted, cli_command, free_port_block, stop_on_sigterm  # noqa: E402  (bench/load.py)

UP_TIMEOUT_S = 300.0
DOWN_TIMEOUT_S = 120.0
CLIENT_TIMEOUT_S = 60.0
PLACEHOLDER = "__cvlb_fuzz_placeholder__"
CONTENT_TYPES = (
    None,
    "application/json",
    "application/json; charset=utf-16",
    "text/plain",
    "application/xml",
    "application/octet-stream",
    "application/x-www-form-urlencoded",
    "multipart/form-data",
    "multipart/form-data; boundary=fuzz",
    "audio/wav",
)


# --- the cases ---------------------------------------------------------------------------


@dataclass
class Case:
    """One request: its category, its body as sent, and its Content-Type (None: no header)."""

    kind: str
    body: bytes
    content_type: str | None

    def describe(self, limit: int = 300) -> str:
        shown = self.body[:limit]
        more = f"… ({len(self.body)} bytes)" if len(self.body) > limit else ""
        return f"[{self.kind}] Content-Type: {self.content_type} body: {shown!r}{more}"


@dataclass(frozen=True)
class Schemas:
    """The two request body schemas of POST /v1/tts, as the OpenAPI description gives them."""

    json: dict[str, Any]
    form: dict[str, Any]

    @classmethod
    def from_openapi(cls, openapi: dict[str, Any]) -> Schemas:
        content = openapi["paths"]["/v1/tts"]["post"]["requestBody"]["content"]
        return cls(json=content["application/json"]["schema"], form=content["multipart/form-data"]["schema"])

    @property
    def fields(self) -> list[str]:
        return sorted(self.json["properties"])

    @property
    def form_fields_schema(self) -> dict[str, Any]:
        """The form's text fields (prompt_audio, a file, is generated apart)."""
        props = {k: v for k, v in self.form["properties"].items() if v.get("format") != "binary"}
        return {**self.form, "properties": props, "required": [r for r in self.form.get("required", []) if r in props]}

    @property
    def file_fields(self) -> list[str]:
        return sorted(k for k, v in self.form["properties"].items() if v.get("format") == "binary")


def fetch_schemas(url: str, session: requests.Session | None = None) -> Schemas:
    session = session or plain_session()
    r = session.get(url + "/openapi.json", timeout=30)
    r.raise_for_status()
    return Schemas.from_openapi(r.json())


def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON value; floats include NaN and ±Infinity (json.dumps writes them as such)."""
    leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40)
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
        max_leaves=max_leaves,
    )


def edge_literals() -> st.SearchStrategy[str]:
    """Raw JSON text that json.dumps would never write, or that parsers treat specially."""
    fixed = st.sampled_from(
        [
            "NaN",
            "Infinity",
            "-Infinity",
            "1e999",
            "-1e999",
            "1e-999",
            "-0",
            "-0.0",
            "0e0",
            "1E+2",
            "4294967296",
            "-1",
            "18446744073709551616",
            '"\\ud800"',
            '"\\udfff"',
            '"\\u0000"',
            '"\\u202e\\u200b\\ufeff"',
            '"\\ud83d\\ude00"',
            "true",
            "null",
            "[]",
            "{}",
            '""',
            '" "',
        ]
    )
    # lengths at the edges: past int64, past a float's range (309 digits), past Python's
    # int/str conversion limit (4300 digits), and anything up to 6000
    lengths = st.sampled_from([19, 20, 39, 309, 310, 400, 4300, 4301, 6000]) | st.integers(1, 6000)
    digits = lengths.map(lambda n: "9" * n)
    negative_digits = lengths.map(lambda n: "-" + "1" * n)
    exponent = st.integers(0, 10**6).map(lambda n: f"1e{n}")
    nested = st.tuples(st.integers(1, 5000), st.sampled_from("[{")).map(
        lambda t: ("[" * t[0] + "]" * t[0]) if t[1] == "[" else ('{"a":' * t[0] + "1" + "}" * t[0])
    )
    return st.one_of(fixed, digits, negative_digits, exponent, nested)


def wav_prompts() -> st.SearchStrategy[bytes]:
    """Small WAV files, some odd: low and high rates, 0 frames, several channels, truncated,
    a header that lies about its rate."""

    def make(rate: int, frames: int, channels: int, subtype: str, cut: int | None, lie: int | None) -> bytes:
        t = np.arange(frames) / rate
        audio = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
        if channels > 1:
            audio = np.repeat(audio[:, None], channels, axis=1)
        buffer = io.BytesIO()
        soundfile.write(buffer, audio, rate, format="WAV", subtype=subtype)
        data = bytearray(buffer.getvalue())
        if lie is not None:
            data[24:28] = struct.pack("<I", lie)  # the fmt chunk's sample rate
        if cut is not None:
            data = data[: min(cut, len(data))]
        return bytes(data)

    return st.builds(
        make,
        rate=st.sampled_from([8000, 16000, 22050, 24000, 44100, 48000, 192000]),
        frames=st.integers(0, 8000),
        channels=st.integers(1, 3),
        subtype=st.sampled_from(["PCM_16", "PCM_U8", "PCM_24"]),  # (FLOAT: libsndfile stamps the time)
        cut=st.none() | st.integers(0, 2000),
        lie=st.none() | st.sampled_from([0, 1, 8000, 2**31, 2**32 - 1]),
    )


def prompt_files(file_fields: list[str]) -> st.SearchStrategy[list[tuple[str, tuple[str, bytes, str]]]]:
    """What goes in the form's file part(s): nothing, random bytes, or a (possibly odd) WAV."""
    content = st.one_of(st.binary(max_size=2048), wav_prompts())
    one = st.tuples(
        st.sampled_from(file_fields),
        st.tuples(
            st.sampled_from(["prompt.wav", "x.txt", "", "../../etc/passwd"]),
            content,
            st.sampled_from(["audio/wav", "application/octet-stream", "text/plain"]),
        ),
    )
    return st.lists(one, max_size=2)


def multipart(fields: dict[str, Any], files: list[tuple[str, tuple[str, bytes, str]]], boundary: str) -> bytes:
    """A multipart/form-data body; a field that is not a string (the form schema allows extra
    fields of any JSON type) is sent as its JSON text."""
    parts: list[tuple[str, Any]] = [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in fields.items()]
    parts += [(name, spec) for name, spec in files]
    body, _ = encode_multipart_formdata(parts, boundary=boundary)
    return body


def case_strategy(schemas: Schemas) -> st.SearchStrategy[Case]:
    """Every category, the valid ones weighted up a little (they exercise synthesis)."""
    valid = from_schema(schemas.json)
    names = schemas.fields

    def dumps(value: Any) -> bytes:
        return json.dumps(value).encode("utf-8", "surrogatepass")

    valid_json = valid.map(lambda v: Case("valid-json", dumps(v), "application/json"))
    random_json = json_values().map(lambda v: Case("random-json", dumps(v), "application/json"))
    replaced = st.tuples(valid, st.sampled_from(names), json_values(6)).map(
        lambda t: Case("replaced-field", dumps({**t[0], t[1]: t[2]}), "application/json")
    )
    extra = st.tuples(
        valid,
        st.dictionaries(st.text(max_size=16).filter(lambda k: k not in names), json_values(4), min_size=1, max_size=4),
    ).map(lambda t: Case("extra-fields", dumps({**t[0], **t[1]}), "application/json"))
    edge = st.tuples(valid, st.sampled_from(names), edge_literals()).map(
        lambda t: Case(
            "edge-literal",
            dumps({**t[0], t[1]: PLACEHOLDER}).replace(f'"{PLACEHOLDER}"'.encode(), t[2].encode()),
            "application/json",
        )
    )
    raw = st.tuples(st.binary(max_size=4096), st.sampled_from(CONTENT_TYPES)).map(
        lambda t: Case("random-bytes", t[0], t[1])
    )
    form_fields = from_schema(schemas.form_fields_schema).filter(lambda d: isinstance(d, dict))
    boundary = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=8, max_size=30)
    form = st.tuples(form_fields, prompt_files(schemas.file_fields), boundary)
    valid_form = form.map(
        lambda t: Case("valid-multipart", multipart(t[0], t[1], t[2]), f"multipart/form-data; boundary={t[2]}")
    )

    def broken(t: tuple[tuple[dict, list, str], str, int, int]) -> Case:
        (fields, files, bnd), how, position, byte = t
        body = multipart(fields, files, bnd)
        content_type = f"multipart/form-data; boundary={bnd}"
        if how == "truncated":
            body = body[: position % max(len(body), 1)]
        elif how == "wrong-boundary":
            content_type = f"multipart/form-data; boundary={bnd}x"
        elif how == "no-boundary":
            content_type = "multipart/form-data"
        else:  # a flipped byte
            at = position % max(len(body), 1)
            body = body[:at] + bytes([byte]) + body[at + 1 :]
        return Case("broken-multipart", body, content_type)

    broken_form = st.tuples(
        form,
        st.sampled_from(["truncated", "wrong-boundary", "no-boundary", "flipped"]),
        st.integers(0, 2**20),
        st.integers(0, 255),
    ).map(broken)
    return st.one_of(
        valid_json, valid_json, random_json, replaced, extra, edge, raw, valid_form, valid_form, broken_form
    )


def generate(schemas: Schemas, count: int, seed: int) -> list[Case]:
    """``count`` cases, the same ones for the same seed and schemas."""
    cases: list[Case] = []
    strategy = case_strategy(schemas)
    attempt = 0
    while len(cases) < count and attempt < 10:

        @hypothesis_seed(seed + attempt)
        @settings(
            max_examples=count - len(cases),
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
            print_blob=False,
        )
        @given(strategy)
        def collect(case: Case) -> None:
            cases.append(case)

        collect()
        attempt += 1
    return cases[:count]


# --- sending them ------------------------------------------------------------------------


def plain_session() -> requests.Session:
    session = requests.Session()
    session.trust_env = False  # loopback only: no proxy from the environment
    return session


@dataclass
class Outcome:
    case: Case
    status: int | None  # None: no answer
    detail: str  # the answer's start, or the exception
    seconds: float

    @property
    def server_error(self) -> bool:
        return self.status is not None and self.status >= 500

    @property
    def unanswered(self) -> bool:
        return self.status is None


@dataclass
class Results:
    outcomes: list[Outcome] = field(default_factory=list)
    skipped: int = 0  # not sent: the time ran out
    seconds: float = 0.0

    @property
    def statuses(self) -> Counter:
        return Counter("no answer" if o.status is None else o.status for o in self.outcomes)

    @property
    def server_errors(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.server_error]

    @property
    def unanswered(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.unanswered]

    @property
    def without_message(self) -> list[Outcome]:
        """4xx answers whose body is not {"error": {"message": ...}}."""
        return [o for o in self.outcomes if o.status is not None and 400 <= o.status < 500 and not has_message(o)]


def has_message(outcome: Outcome) -> bool:
    try:
        return isinstance(json.loads(outcome.detail)["error"]["message"], str)
    except (ValueError, KeyError, TypeError):
        return False


def post(session: requests.Session, url: str, case: Case) -> Outcome:
    headers = {"Content-Type": case.content_type} if case.content_type else {}
    started = time.monotonic()
    try:
        r = session.post(url + "/v1/tts", data=case.body, headers=headers, timeout=CLIENT_TIMEOUT_S)
        is_audio = r.headers.get("content-type", "").startswith("audio/")
        detail = f"audio, {len(r.content)} bytes" if is_audio else r.text[: 2**20]
        return Outcome(case, r.status_code, detail, time.monotonic() - started)
    except requests.RequestException as exc:
        return Outcome(case, None, repr(exc), time.monotonic() - started)


def send(url: str, cases: list[Case], workers: int = 2, max_seconds: float = 300.0) -> Results:
    """POST every case (from ``workers`` threads) until done or ``max_seconds`` are spent."""
    results = Results()
    deadline = time.monotonic() + max_seconds
    local = threading.local()
    lock = threading.Lock()

    def one(case: Case) -> None:
        if time.monotonic() > deadline:
            with lock:
                results.skipped += 1
            return
        if not hasattr(local, "session"):
            local.session = plain_session()
        outcome = post(local.session, url, case)
        with lock:
            results.outcomes.append(outcome)

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, cases))
    results.seconds = time.monotonic() - started
    return results


# --- the report --------------------------------------------------------------------------


def table_rows(results: Results) -> tuple[list[str], list[list[str]]]:
    statuses = sorted(results.statuses, key=lambda s: (isinstance(s, str), s))
    kinds = sorted({o.case.kind for o in results.outcomes})
    by = Counter((o.case.kind, "no answer" if o.status is None else o.status) for o in results.outcomes)
    header = ["category", *[str(s) for s in statuses], "total"]
    rows = [
        [kind, *[str(by[(kind, s)]) for s in statuses], str(sum(by[(kind, s)] for s in statuses))] for kind in kinds
    ]
    rows.append(["all", *[str(results.statuses[s]) for s in statuses], str(len(results.outcomes))])
    return header, rows


def print_table(results: Results) -> None:
    header, rows = table_rows(results)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        return
    table = Table(title="POST /v1/tts answers by category and status")
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=160).print(table)


def save_problems(results: Results, directory: str) -> int:
    """Every 5xx and unanswered request as DIR/NNN.body (the body as sent) and DIR/NNN.txt
    (category, Content-Type, status, answer), to replay with e.g.
    ``curl --data-binary @DIR/NNN.body -H 'Content-Type: ...' URL/v1/tts``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    problems = results.server_errors + results.unanswered
    for n, outcome in enumerate(problems):
        (out / f"{n:03d}.body").write_bytes(outcome.case.body)
        (out / f"{n:03d}.txt").write_text(
            f"category: {outcome.case.kind}\ncontent-type: {outcome.case.content_type}\n"
            f"status: {outcome.status}\nanswer: {outcome.detail[:4000]}\n",
            encoding="utf-8",
        )
    return len(problems)


def report_problems(results: Results, limit: int = 20) -> None:
    for title, items in (
        ("server error (5xx)", results.server_errors),
        ("no answer", results.unanswered),
        ("4xx without error.message", results.without_message),
    ):
        for outcome in items[:limit]:
            print(f"{title}: {outcome.status} {outcome.case.describe()}\n    -> {outcome.detail[:400]!r}")
        if len(items) > limit:
            print(f"{title}: … and {len(items) - limit} more")


# --- the cluster -------------------------------------------------------------------------


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE_LB_")}


def instance_pids(state_dir: Path, command: Callable[..., list[str]]) -> dict[str, tuple[int, int]]:
    """{name: (pid, restarts)} from ``cosyvoice-lb status --json``."""
    done = subprocess.run(
        command("status", "--json", "--state-dir", str(state_dir)),
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
        check=False,
    )
    body = json.loads(done.stdout)
    return {i["name"]: (i["pid"], i["restarts"]) for i in body["instances"]}


def up_args(instances: int, port: int, base: int, state_dir: Path, engine: str) -> list[str]:
    args = [
        "up",
        "--engine",
        engine,
        "--instances",
        str(instances),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-port",
        str(base),
        "--state-dir",
        str(state_dir),
    ]
    if engine == "simulated":
        args += ["--simulated-ms-per-char", "0"]
    return args


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Fuzz POST /v1/tts of a real cluster on 127.0.0.1 from its OpenAPI description."
    )
    parser.add_argument("--cases", type=int, default=1000, help="cases to send (default 1000)")
    parser.add_argument("--seed", type=int, default=None, help="generator seed (default: random, printed)")
    parser.add_argument("--instances", type=int, default=2, help="instances in the cluster (default 2)")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="client threads (default: one per instance, so that no instance's queue fills and "
        "every 503 is a finding, not backpressure)",
    )
    parser.add_argument("--max-seconds", type=float, default=300.0, help="stop sending after this long (default 300)")
    parser.add_argument(
        "--save",
        metavar="DIR",
        help="write every 5xx and unanswered request (body and what came back) into DIR, to replay",
    )
    parser.add_argument(
        "--engine",
        choices=["espeak", "simulated"],
        default="espeak",
        help="the instances' engine (simulated runs with --simulated-ms-per-char 0)",
    )
    args = parser.parse_args(argv)
    if args.workers is None:
        args.workers = args.instances
    if args.cases < 1 or args.instances < 1 or args.workers < 1 or args.max_seconds <= 0:
        parser.error("--cases, --instances and --workers must be at least 1, --max-seconds above 0")
    if args.seed is None:
        args.seed = random.randrange(2**31)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    print("command: " + shlex.join([sys.executable, *(sys.argv if argv is None else [__file__, *argv])]))
    cli = cli_command()

    def command(*a: str) -> list[str]:
        return [*cli, *a]

    base = free_port_block(args.instances + 1)
    state_dir = Path(tempfile.mkdtemp(prefix="fz", dir="/tmp"))  # short: supervisord's socket lives in it
    url = f"http://127.0.0.1:{base}"
    up = up_args(args.instances, base, base + 1, state_dir, args.engine)
    print("cluster: " + shlex.join(["cosyvoice-lb", *up]))
    print(
        f"settings: {args.cases} cases, seed {args.seed}, {args.workers} client threads, at most "
        f"{args.max_seconds:g} s of sending, client timeout {CLIENT_TIMEOUT_S:g} s"
    )
    sys.stdout.flush()
    problems: list[str] = []
    results = Results()
    started = time.monotonic()
    try:
        done = subprocess.run(
            command(*up), capture_output=True, text=True, timeout=UP_TIMEOUT_S, env=clean_env(), check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"cosyvoice-lb up exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
        before = instance_pids(state_dir, command)
        schemas = fetch_schemas(url)
        t0 = time.monotonic()
        cases = generate(schemas, args.cases, args.seed)
        generated_s = time.monotonic() - t0
        print(f"generated {len(cases)} cases in {generated_s:.1f} s")
        sys.stdout.flush()
        results = send(url, cases, workers=args.workers, max_seconds=args.max_seconds)
        after = instance_pids(state_dir, command)
        if after != before:
            problems.append(f"instances changed (name: (pid, restarts)): before {before}, after {after}")
    except Exception as exc:
        problems.append(f"run: {type(exc).__name__}: {exc}")
    except (KeyboardInterrupt, Interrupted):
        problems.append("interrupted")
    finally:
        try:
            down = subprocess.run(
                command("down", "--state-dir", str(state_dir)),
                capture_output=True,
                text=True,
                timeout=DOWN_TIMEOUT_S,
                env=clean_env(),
                check=False,
            )
            print(f"down: {(down.stdout + down.stderr).strip()}", file=sys.stderr)
        except subprocess.TimeoutExpired:
            problems.append(f"down did not finish within {DOWN_TIMEOUT_S:.0f} s")
        shutil.rmtree(state_dir, ignore_errors=True)
    wall = time.monotonic() - started
    print()
    if results.outcomes:
        print_table(results)
    report_problems(results)
    if args.save and (results.server_errors or results.unanswered):
        print(f"saved {save_problems(results, args.save)} request(s) into {args.save}")
    for problem in problems:
        print(f"problem: {problem}")
    print(
        f"fuzz: {len(results.outcomes)} cases sent in {results.seconds:.1f} s "
        f"({results.skipped} not sent: time ran out), {len(results.server_errors)} server errors (5xx), "
        f"{len(results.unanswered)} unanswered, {len(results.without_message)} 4xx without error.message; "
        f"wall {wall:.1f} s, seed {args.seed}"
    )
    return 1 if results.server_errors or results.unanswered or problems or not results.outcomes else 0


if __name__ == "__main__":
    sys.exit(main())
