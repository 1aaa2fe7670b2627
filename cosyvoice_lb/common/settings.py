"""Every setting declared once: field, default, help, flag and environment variable.

The CLI options, the ``COSYVOICE_LB_*`` environment variables, ``cluster.json`` and the
README's table all come from :class:`Settings`, so they cannot drift apart; so does every instance's command line (built by
:func:`instance_args`, parsed back by :func:`instance_parser`), and each setting carries
the check that refuses a value that cannot work.

No click here: the instance imports this module in the model's Python environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cosyvoice_lb.common.sizes import parse_size

ENV_PREFIX = "COSYVOICE_LB_"

# Default memory one instance needs, per engine: GPU memory on GPU boxes, host RAM on
# CPU-only boxes. The espeak engine uses no GPU: on a GPU box it stands in for
# CosyVoice3 and is planned with CosyVoice3's footprint, so its plan is the model's plan.
# CosyVoice3 (plain, no TRT/vLLM): ~4.5 GB peak reported on an RTX 3060 (DESIGN.md §3),
# rounded up for fragmentation and the warm-up peak.
ENGINE_FOOTPRINTS: dict[str, dict[str, str]] = {
    # espeak's host figure is measured: an instance's peak RSS (espeak-ng, Gradio UI), sampled
    # every 50 ms, while 20,000-character texts go through `up --instances 2` (the script of
    # tests/integration/test_long_text_memory.py, which holds the bound): ~200 MiB at rest,
    # 425/488 MiB one text at a time, 433/471 MiB two at once; one instance alone (its own
    # balancer) 422 MiB, two at once 585 MiB. 640 MiB covers them all.
    "espeak": {"gpu": "5GiB", "host": "640MiB"},
    # CosyVoice3 on CPU (no GPU): weights plus activations in host RAM.
    "cosyvoice3": {"gpu": "5GiB", "host": "6GiB"},
    # The benchmark load model stands in for CosyVoice3 on a GPU box, like espeak.
    "simulated": {"gpu": "5GiB", "host": "256MiB"},
}
# Added per instance by CosyVoice's engine flags (DESIGN notes, upstream issues):
# one TensorRT context of the flow decoder ~4.5 GB (v2 reports; trt_concurrent=1);
# vLLM is started with gpu_memory_utilization=0.2 (upstream cli/model.py), i.e. it
# reserves a fifth of the card per instance whatever the model needs.
TRT_EXTRA = "4.5GiB"
VLLM_CARD_FRACTION = 0.2
ENGINES = ("auto", "espeak", "cosyvoice3", "simulated")


# --- validators: each returns what is wrong with a value ("" when nothing) ------------------

Check = Callable[[str, Any], str]


def finite(flag: str, value: Any) -> str:
    return "" if math.isfinite(value) else f"{flag} must be a finite number, got {value}"


def above_zero(flag: str, value: Any) -> str:
    return finite(flag, value) or ("" if value > 0 else f"{flag} must be above 0 seconds, got {value}")


def not_negative(flag: str, value: Any) -> str:
    return finite(flag, value) or ("" if value >= 0 else f"{flag} cannot be negative, got {value}")


def at_least(least: int) -> Check:
    def check(flag: str, value: Any) -> str:
        return "" if value >= least else f"{flag} must be at least {least}, got {value}"

    return check


def tcp_port(flag: str, value: Any) -> str:
    return "" if 1 <= value <= 65535 else f"{flag} {value} is not a TCP port (1-65535)"


def size(flag: str, value: Any) -> str:
    if value == "":
        return ""
    try:
        parse_size(value)
    except ValueError as exc:
        return f"{flag}: {exc}"
    return ""


def rate(flag: str, value: Any) -> str:
    if value == "" or re.fullmatch(r"[1-9][0-9]{0,6}r/[sm]", value):
        return ""
    return f"{flag} {value!r} is not a rate: write requests per second or minute, e.g. 10r/s or 120r/m"


def private_file(flag: str, value: Any) -> str:
    """A secrets file: there, and readable by its owner only (as ssh asks of a key)."""
    if value == "":
        return ""
    try:
        mode = os.stat(os.path.expanduser(value)).st_mode
    except OSError as exc:
        return f"{flag} {value}: {exc.strerror or exc}"
    if not stat.S_ISREG(mode):
        return f"{flag} {value} is not a file"
    if mode & 0o077:
        return f"{flag} {value} is readable by others (mode {stat.S_IMODE(mode):04o}): run chmod 600 {value}"
    return ""


# CosyVoice3 is made to clone from 3 s of speech; upstream checks no lower bound, and a
# shorter prompt gives a voice that is not the speaker's. The one figure for the prompt
# rules (validation.prompt_span), the UI, and the check below.
MIN_PROMPT_SECONDS = 3.0


def prompt_seconds(flag: str, value: Any) -> str:
    if MIN_PROMPT_SECONDS <= value <= 30:
        return ""
    return (
        f"{flag} must be at least {MIN_PROMPT_SECONDS:g} (shorter prompts are refused) and at most 30 "
        f"(upstream refuses longer prompts), got {value}"
    )


def voice_map(flag: str, value: Any) -> str:
    try:
        parse_voice_map(value)
    except ValueError as exc:
        return f"{flag}: {exc}"
    return ""


def parse_voice_map(value: str) -> dict[str, str]:
    """``alloy=narrator,nova=voice_...`` -> {"alloy": "narrator", "nova": "voice_..."}."""
    mapping: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, target = (x.strip() for x in item.partition("="))
        if not sep or not name or not target:
            raise ValueError(f"{item!r} is not NAME=VOICE (e.g. alloy=narrator)")
        mapping[name] = target
    return mapping


def setting(
    default: Any,
    help: str,
    *,
    type: Any = None,
    is_flag: bool = False,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    check: Check | None = None,
    instance: bool | str = False,
) -> Any:
    """One setting. ``check`` refuses values that cannot work; ``instance`` passes it to every
    instance's command line (a string: only to instances of that engine)."""
    return field(
        default=default,
        metadata={
            "help": help,
            "type": type,
            "is_flag": is_flag,
            "choices": choices,
            "metavar": metavar,
            "check": check,
            "instance": instance,
        },
    )


@dataclass(frozen=True)
class Settings:
    """The whole configuration of one cluster."""

    engine: str = setting(
        "auto",
        "Speech engine of every instance: cosyvoice3 (with --model-dir; v2 and v1 model "
        "dirs work too), espeak (embedded, no weights); auto picks cosyvoice3 when "
        "--model-dir is given. simulated is a load model for benchmarks, not speech "
        "(silence after a wait proportional to the text).",
        choices=ENGINES,
        instance=True,
    )
    model_dir: str = setting(
        "",
        "CosyVoice model dir (local, holding cosyvoice3.yaml, cosyvoice2.yaml or cosyvoice.yaml).",
        metavar="DIR",
        instance="cosyvoice3",
    )
    cosyvoice_root: str = setting(
        "",
        "Upstream CosyVoice checkout (holds cosyvoice/ and third_party/Matcha-TTS); "
        "not needed when --python's env imports cosyvoice already.",
        metavar="DIR",
        instance="cosyvoice3",
    )
    load_trt: bool = setting(
        False, "CosyVoice: TensorRT flow decoder (more GPU memory per instance).", is_flag=True, instance="cosyvoice3"
    )
    load_vllm: bool = setting(
        False,
        "CosyVoice2/3: vLLM for the LLM (reserves 0.2 x the card per instance).",
        is_flag=True,
        instance="cosyvoice3",
    )
    fp16: bool = setting(False, "CosyVoice: half precision.", is_flag=True, instance="cosyvoice3")
    simulated_ms_per_char: float = setting(
        4.0,
        "--engine simulated: milliseconds of service time per character of text.",
        type=float,
        check=not_negative,
        instance="simulated",
    )
    simulated_base_ms: float = setting(
        0.0,
        "--engine simulated: milliseconds of service time per request.",
        type=float,
        check=not_negative,
        instance="simulated",
    )
    simulated_load_seconds: float = setting(
        0.0,
        "--engine simulated: seconds its model load takes (CosyVoice3 takes minutes), for roll-out benchmarks.",
        type=float,
        check=not_negative,
        instance="simulated",
    )
    simulated_faults: bool = setting(
        False,
        "--engine simulated: a text holding CRASH-NOW kills the instance, HANG-NOW hangs it (chaos runs).",
        is_flag=True,
        instance="simulated",
    )
    instances: str = setting(
        "auto",
        "How many instances serve: a number, or 'auto' for as many as fit (less --spares); "
        "with --min-instances, the most that serve.",
        metavar="N|auto",
    )
    gpus: str = setting(
        "",
        "Plan for these GPUs instead of asking NVML, e.g. 24GiB,24GiB (a card's total; free is taken as total).",
        metavar="SIZES",
    )
    footprint: str = setting(
        "",
        "Memory per instance (GPU memory, or host RAM on a CPU-only box); default: the engine's.",
        metavar="SIZE",
        check=size,
    )
    reserve: str = setting(
        "1GiB", "Memory kept free on every GPU (and in RAM on a CPU-only box).", metavar="SIZE", check=size
    )
    max_instances: int = setting(
        0,
        "Never plan more than this many instances, spares and surge slots included (0: no cap).",
        type=int,
        check=at_least(0),
    )
    min_instances: int = setting(
        0,
        "Elastic instances: serve with at least this many, adding one (up to --instances, or as many as fit) "
        "when every instance "
        "has had a queue for --scale-up-after, and stopping one (its memory freed) after --idle-release "
        "without requests (0: a fixed number).",
        type=int,
        check=at_least(0),
    )
    scale_up_after: float = setting(
        30.0, "Elastic: seconds every instance has had a queue before one more starts.", type=float, check=above_zero
    )
    idle_release: float = setting(
        600.0, "Elastic: seconds without requests before one instance is stopped.", type=float, check=above_zero
    )
    spares: int = setting(
        0,
        "Warm spares: loaded instances kept out of rotation; one enters it within a probe interval when an "
        "instance is taken out (hang, crash, recycle), and the replacement loads in the background.",
        type=int,
        check=at_least(0),
    )
    surge: int = setting(
        0,
        "Roll-outs (up with changed settings, restart --rolling) start up to N replacements on spare ports, "
        "put them in rotation, and only then drain the old ones; the slots are planned where memory allows.",
        type=int,
        check=at_least(0),
    )
    force: bool = setting(False, "Start --instances N even when fewer fit.", is_flag=True)
    base_port: int = setting(
        7860, "Port of the first instance; instance i listens on base+i (127.0.0.1).", type=int, check=tcp_port
    )
    port: int = setting(8080, "The port nginx listens on.", type=int, check=tcp_port)
    host: str = setting(
        "",
        "The address nginx listens on (default 127.0.0.1: this box only; 0.0.0.0 with --public). "
        "An address other machines reach needs credentials, as --public does.",
        metavar="ADDR",
    )
    public: bool = setting(
        False,
        "Listen on every address (0.0.0.0). Without --api-token-file an API token is generated "
        "into the state dir (0600) and `up` says how to use it.",
        is_flag=True,
    )
    no_auth: bool = setting(
        False,
        "Serve a public address without credentials: anyone who reaches it can synthesize (said at `up` and `status`).",
        is_flag=True,
    )
    api_token_file: str = setting(
        "",
        "API tokens, one per line (# comments); every route that synthesizes then needs "
        "'Authorization: Bearer TOKEN'. Re-read by `up` without a restart; readable by its owner only.",
        metavar="FILE",
        check=private_file,
    )
    ui_auth: str = setting(
        "",
        "Users who may log in to the UI, in htpasswd format with bcrypt hashes (htpasswd -B); "
        "the API token logs in too.",
        metavar="FILE",
        check=private_file,
    )
    admin_token_file: str = setting(
        "",
        "Tokens of the control panel (/admin) and the cluster's /metrics, one per line: a bearer "
        "token, or the password of the panel's login. Without it `up` generates one into the state "
        "dir (0600) and `status` says where. Readable by its owner only.",
        metavar="FILE",
        check=private_file,
    )
    rate_limit: str = setting(
        "",
        "Requests per client (per API token when one is sent) to what synthesizes, e.g. 10r/s "
        "or 120r/m; past it 429 with Retry-After (empty: no limit).",
        metavar="RATE",
        check=rate,
    )
    rate_burst: int = setting(
        20, "Requests a client may send at once beyond --rate-limit before it gets 429.", type=int, check=not_negative
    )
    max_body: str = setting(
        "20MiB",
        "Largest request body nginx accepts (413 past it); must hold --max-upload and the form around it.",
        metavar="SIZE",
        check=size,
    )
    state_dir: str = setting(".", "Where configs, logs, sockets and state live.", metavar="DIR")
    python: str = setting(sys.executable, "Python that runs the instances.", metavar="PATH")
    nginx: str = setting("nginx", "The nginx binary.", metavar="PATH")
    max_chars: int = setting(500, "Longest text one request may ask for.", type=int, check=at_least(1), instance=True)
    max_long_chars: int = setting(
        20000,
        "Longest text a request may send: a text past --max-chars is split at sentence boundaries and "
        "its segments are synthesized in parallel across the instances (0: no long texts).",
        type=int,
        check=at_least(0),
        instance=True,
    )
    segment_chars: int = setting(
        200,
        "Long texts are split into segments of about this many characters (the first one half as long, "
        "so its audio comes sooner); at most --max-chars.",
        type=int,
        check=at_least(20),
        instance=True,
    )
    voices_dir: str = setting(
        "",
        "Where saved voices live (default: voices/ in the state dir); every instance reads it, so it "
        "may be a volume several hosts share.",
        metavar="DIR",
        instance=True,
    )
    openai_voices: str = setting(
        "",
        "OpenAI voice names (alloy, nova, ...) mapped to saved voices or built-in speakers, e.g. "
        "alloy=narrator,nova=voice_0123456789abcdef01234567; an unmapped name speaks in the model's default voice.",
        metavar="MAP",
        check=voice_map,
        instance=True,
    )
    max_prompt_seconds: float = setting(
        15.0,
        "Longer prompt audio is trimmed to this many seconds (with a notice).",
        type=float,
        check=prompt_seconds,
        instance=True,
    )
    max_upload: str = setting("10MiB", "Largest prompt audio upload.", metavar="SIZE", check=size, instance=True)
    instance_concurrency: int = setting(
        1,
        "Syntheses one instance runs at once (upstream's streaming shares "
        "state between requests: scale with instances instead).",
        type=int,
        check=at_least(1),
        instance=True,
    )
    max_queue: int = setting(
        2,
        "API requests one instance lets wait for its engine; past that it answers 503 "
        "at once and nginx tries another instance (all full: the client gets 503 with "
        "Retry-After instead of an unbounded wait).",
        type=int,
        check=not_negative,
        instance=True,
    )
    outputs_dir: str = setting(
        "", "Where instances keep every result (default: outputs/ in the state dir).", metavar="DIR", instance=True
    )
    outputs_max_age: float = setting(
        86400.0, "Results older than this many seconds are deleted.", type=float, check=above_zero, instance=True
    )
    outputs_max_size: str = setting(
        "2GiB",
        "The outputs dir is kept under this size (oldest deleted first).",
        metavar="SIZE",
        check=size,
        instance=True,
    )
    mps: bool = setting(
        False,
        "GPU boxes: one CUDA MPS control daemon per GPU, so the instances' kernels run concurrently "
        "instead of time-slicing the card.",
        is_flag=True,
    )
    mps_thread_percentage: int = setting(
        0,
        "With --mps: the share of a GPU's SMs one instance may use (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; 0: all).",
        type=int,
        check=lambda flag, value: "" if 0 <= value <= 100 else f"{flag} must be 0..100 (percent), got {value}",
    )
    stagger: bool = setting(
        False,
        "Start instances one after another, each loaded before the next "
        "(N model loads at once can exhaust host memory).",
        is_flag=True,
    )
    probe_interval: float = setting(
        1.0, "Seconds between two health probes of an instance.", type=float, check=above_zero
    )
    probe_timeout: float = setting(
        2.0, "Seconds a probe may take before it counts as failed.", type=float, check=above_zero
    )
    fail_threshold: int = setting(
        3, "Failed probes in a row that take an instance out and restart it.", type=int, check=at_least(1)
    )
    recover_threshold: int = setting(
        2, "Good probes in a row that put an instance back in rotation.", type=int, check=at_least(1)
    )
    hang_timeout: float = setting(
        60.0,
        "A synthesis that yields no audio for this many seconds means the instance "
        "is hung: it is taken out and restarted, and nginx retries its requests "
        "elsewhere (keep it below --request-timeout so there is time for that).",
        type=float,
        check=above_zero,
    )
    request_timeout: float = setting(
        90.0,
        "Longest an API request waits for its answer (or a stream for its first "
        "chunk), counted from its arrival at nginx, retries included; past it "
        "the client gets a 504 that says so.",
        type=float,
        check=above_zero,
        instance=True,
    )
    startup_timeout: float = setting(
        300.0,
        "Seconds an instance may take to load before it counts as failed (never killed for being slow before that).",
        type=float,
        check=above_zero,
    )
    max_requests: int = setting(
        0,
        "Recycle an instance (a drained restart, one at a time) after this many "
        "requests, against slow leaks (0: never).",
        type=int,
        check=not_negative,
    )
    max_requests_jitter: int = setting(
        0, "Add 0..N to --max-requests per instance, so they do not all recycle together.", type=int, check=not_negative
    )
    max_memory: str = setting(
        "",
        "Recycle an instance whose RSS (or GPU memory, per process) grows past this, e.g. 12GiB (empty: never).",
        metavar="SIZE",
        check=size,
    )
    drain_timeout: float = setting(
        30.0,
        "Seconds in-flight requests get to finish when an instance stops.",
        type=float,
        check=not_negative,
        instance=True,
    )
    start_retries: int = setting(
        3, "Failed starts in a row before supervisord gives an instance up.", type=int, check=at_least(0)
    )
    retries: int = setting(
        3,
        "Instances nginx tries for one request (refused, dead or loading); with --routing work "
        "an API request may try every instance and then the last resort.",
        type=int,
        check=at_least(1),
    )
    routing: str = setting(
        "work",
        "How /v1/ picks an instance: work (each instance knows the seconds of work it holds, "
        "its texts' lengths times its own measured seconds per character, and declines a "
        "request another instance would start sooner; nginx then tries that one) or "
        "least-conn (nginx's least connections alone).",
        choices=("work", "least-conn"),
    )
    route_slack: float = setting(
        0.05,
        "Seconds another instance must start a request sooner before one declines it (--routing work).",
        type=float,
        check=not_negative,
    )

    @property
    def staggered(self) -> bool:
        """One instance loads at a time: asked for, or forced by TensorRT/vLLM, whose first
        load writes engine files into the model dir that parallel loads would race on."""
        return self.stagger or (self.resolved_engine == "cosyvoice3" and (self.load_trt or self.load_vllm))

    @property
    def listen_host(self) -> str:
        """The address nginx listens on."""
        return self.host or ("0.0.0.0" if self.public else "127.0.0.1")

    @property
    def exposed(self) -> bool:
        """Other machines may reach nginx."""
        return not is_loopback(self.listen_host)

    @property
    def auth_required(self) -> bool:
        """Every route that synthesizes needs credentials."""
        return bool(self.api_token_file or self.ui_auth) or (self.exposed and not self.no_auth)

    @property
    def resolved_engine(self) -> str:
        if self.engine != "auto":
            return self.engine
        return "cosyvoice3" if self.model_dir else "espeak"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> Settings:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names and v is not None})


def absolute(settings: Settings) -> Settings:
    """Paths made absolute now: supervisord runs everything from the state dir."""
    paths: dict[str, Any] = {}
    for name in (
        "model_dir",
        "cosyvoice_root",
        "outputs_dir",
        "voices_dir",
        "api_token_file",
        "ui_auth",
        "admin_token_file",
    ):
        value = getattr(settings, name)
        if value:
            paths[name] = str(Path(value).expanduser().resolve())
    return dataclasses.replace(settings, **paths)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


def envvar(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def declarations() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(Settings)


def problems(settings: Settings) -> list[str]:
    """What is wrong with these settings, each setting checked by its own declaration, then
    what no single setting can say ([] when they can work)."""
    found = [
        message
        for f in declarations()
        if f.metadata["check"]
        for message in [f.metadata["check"](flag(f.name), getattr(settings, f.name))]
        if message
    ]
    if settings.resolved_engine == "cosyvoice3" and not settings.model_dir:
        found.append("--engine cosyvoice3 needs --model-dir (a local CosyVoice model dir)")
    if settings.public and settings.host and is_loopback(settings.host):
        found.append(f"--public and --host {settings.host} contradict each other: drop one")
    if settings.no_auth and (settings.api_token_file or settings.ui_auth):
        found.append("--no-auth with --api-token-file or --ui-auth: drop --no-auth to require the credentials")
    if settings.mps_thread_percentage and not settings.mps:
        found.append("--mps-thread-percentage needs --mps: add --mps, or drop the percentage")
    if settings.min_instances and settings.max_instances and settings.min_instances > settings.max_instances:
        found.append(
            f"--min-instances {settings.min_instances} is above --max-instances {settings.max_instances}: "
            "lower one of them"
        )
    if settings.max_long_chars and settings.max_long_chars < settings.max_chars:
        found.append(
            f"--max-long-chars {settings.max_long_chars} is below --max-chars {settings.max_chars}: raise it, "
            "or 0 for no long texts"
        )
    if not size(" ", settings.max_body) and not size(" ", settings.max_upload):
        if parse_size(settings.max_upload) + 2**20 > parse_size(settings.max_body):
            found.append(
                f"--max-body {settings.max_body} cannot hold a --max-upload {settings.max_upload} prompt and the "
                "form around it: raise --max-body (at least 1MiB above --max-upload)"
            )
    return found


def instance_settings(engine: str) -> list[dataclasses.Field]:
    """The settings an instance of ``engine`` takes on its command line."""
    return [f for f in declarations() if f.metadata["instance"] in (True, engine)]


def instance_args(settings: Settings, **resolved: Any) -> list[str]:
    """The instance's share of ``settings`` as command-line flags (``resolved``: values the
    launcher worked out, e.g. the engine ``auto`` stands for, or the default outputs dir)."""
    values = {**dataclasses.asdict(settings), "engine": settings.resolved_engine, **resolved}
    args: list[str] = []
    for f in instance_settings(values["engine"]):
        value = values[f.name]
        if f.metadata["is_flag"]:
            args += [flag(f.name)] if value else []
        elif value != "":  # (empty: the instance's default, which is empty too)
            args += [flag(f.name), str(value)]
    return args


def instance_parser(description: str) -> argparse.ArgumentParser:
    """Parses what :func:`instance_args` writes: the same names, types and defaults (plus
    what only an instance has: its port and address, and its starts file)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--starts-file", default="", help="a line is appended here at every start (restart counting)")
    parser.add_argument("--ledger-dir", default="", help="marks of running syntheses, shared by all instances")
    parser.add_argument("--auth-file", default="", help="the access policy (tokens, users): all but /ping need them")
    parser.add_argument("--balancer", default="", help="nginx's URL on this box: long texts' segments go there")
    parser.add_argument("--peers", type=int, default=1, help="instances in the cluster: segments out at once")
    parser.add_argument("--segment-key-file", default="", help="the key segments carry (nginx knows them by it)")
    parser.add_argument("--board", default="", help="the routing board shared by the box's instances")
    parser.add_argument("--slot", type=int, default=-1, help="this instance's row on the routing board")
    for f in declarations():
        if not f.metadata["instance"]:
            continue
        meta = f.metadata
        if meta["is_flag"]:
            parser.add_argument(flag(f.name), dest=f.name, action="store_true", help=meta["help"])
        else:
            parser.add_argument(
                flag(f.name),
                dest=f.name,
                default=f.default,
                type=meta["type"] or str,
                choices=meta["choices"],
                metavar=meta["metavar"],
                help=meta["help"],
            )
    # Sizes in MiB, as instances of earlier versions were started with: an instance that
    # supervisord restarts from such a config while `up` rolls out new code still starts.
    for old, name in (("--max-upload-mib", "max_upload"), ("--outputs-max-mib", "outputs_max_size")):
        parser.add_argument(old, dest=f"{name}_mib", type=float, default=None, help=argparse.SUPPRESS)
    return parser


def parse_instance_args(argv: list[str] | None = None) -> tuple[Settings, argparse.Namespace]:
    """An instance's settings from its command line, and the namespace (port, host, starts file)."""
    args = instance_parser("One cosyvoice-lb instance (run by supervisord).").parse_args(argv)
    for name in ("max_upload", "outputs_max_size"):
        mib = getattr(args, f"{name}_mib")
        if mib is not None:
            setattr(args, name, f"{mib:g}MiB")
    names = {f.name for f in declarations() if f.metadata["instance"]}
    return Settings.from_mapping({k: v for k, v in vars(args).items() if k in names}), args


PLAN_OPTIONS = (
    "engine",
    "model_dir",
    "load_trt",
    "load_vllm",
    "fp16",
    "instances",
    "gpus",
    "footprint",
    "reserve",
    "max_instances",
    "min_instances",
    "spares",
    "surge",
    "force",
    "base_port",
    "state_dir",
)
CLUSTER_OPTIONS = PLAN_OPTIONS + tuple(f.name for f in dataclasses.fields(Settings) if f.name not in PLAN_OPTIONS)


def markdown_table() -> str:
    """The README's settings table (``python -m cosyvoice_lb.common.settings`` prints it)."""
    rows = ["| flag | environment | default | what |", "|---|---|---|---|"]
    for f in dataclasses.fields(Settings):
        default = "the launcher's Python" if f.name == "python" else (f.default if f.default != "" else "—")
        rows.append(f"| `--{f.name.replace('_', '-')}` | `{envvar(f.name)}` | `{default}` | {f.metadata['help']} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
