"""Every setting declared once: field, default, help, flag and environment variable.

The CLI options, the ``COSYVOICE_LB_*`` environment variables, ``cluster.json`` and the
table in docs/settings.md all come from :class:`Settings`, so they cannot drift apart; so does every
instance's command line (:mod:`cosyvoice_lb.common.instance_argv`), and each setting carries
the check that refuses a value that cannot work (:mod:`cosyvoice_lb.common.checks`).

No click here: the instance imports this module in the model's Python environment.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from typing import Any

from cosyvoice_lb.common.alert_settings import AlertSettings
from cosyvoice_lb.common.checks import (
    above_zero,
    at_least,
    concurrency,
    not_negative,
    percentage,
    private_file,
    prompt_seconds,
    rate,
    size,
    tcp_port,
    voice_map,
)
from cosyvoice_lb.common.declaration import setting
from cosyvoice_lb.common.engine_settings import EngineSettings
from cosyvoice_lb.common.networks import networks
from cosyvoice_lb.common.schedule import SEPARATOR, schedule_check
from cosyvoice_lb.common.speech_check_settings import SpeechCheckSettings
from cosyvoice_lb.common.stream_settings import StreamSettings

ENV_PREFIX = "COSYVOICE_LB_"

# CosyVoice3 is made to clone from 3 s of speech; upstream checks no lower bound, and a
# shorter prompt gives a voice that is not the speaker's. The one figure for the prompt
# rules (validation.prompt_span), the UI, and the check of --max-prompt-seconds.
MIN_PROMPT_SECONDS = 3.0
# The longest text a job may hold (the job store's bound, cosyvoice_lb.jobs.model.MAX_TEXT_CHARS)
MAX_JOB_CHARS = 200_000


@dataclass(frozen=True)
class Settings(AlertSettings, StreamSettings, SpeechCheckSettings, EngineSettings):
    """The whole configuration of one cluster (the engine's share first: ``engine_settings``)."""

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
    host_memory_per_instance: str = setting(
        "",
        "Host RAM one instance takes (default: the engine's, 6GiB for cosyvoice3): `up` refuses a plan that, with 1GiB "
        "for the rest, exceeds its container's memory limit (cgroup); `k8s render` sizes the pod by it.",
        metavar="SIZE",
        check=size,
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
    schedule: str = setting(
        "",
        "Scheduled capacity, CRON=N (repeatable; in the environment variable, entries separated by ';'): "
        "from the most recent entry whose time has passed (5-field cron, the box's local time), at least N "
        "instances serve, e.g. '0 9 * * 1-5=3' and '0 22 * * *=1'. Elastic pools only (--min-instances), "
        "capped at the instances planned; with `k8s render`, N pods through a KEDA ScaledObject instead.",
        metavar="CRON=N",
        check=schedule_check,
        separator=SEPARATOR,
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
    trusted_proxies: str = setting(
        "",
        "Proxies in front of nginx (addresses or CIDRs, e.g. 10.0.0.0/8,127.0.0.1) whose X-Forwarded-For names the "
        "client: rate limits, login throttles and /ping's details then see the client, not the proxy (empty: none).",
        metavar="CIDRS",
        check=networks,
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
        check=prompt_seconds(MIN_PROMPT_SECONDS),
        instance=True,
    )
    max_upload: str = setting("10MiB", "Largest prompt audio upload.", metavar="SIZE", check=size, instance=True)
    instance_concurrency: str = setting(
        "auto",
        "Syntheses one instance runs at once in one model: N, or auto, the planner's pick for the "
        "engine and its flags (docs/planning.md: e.g. more with --load-vllm, whose batching "
        "needs several at once; 1 without a GPU). Admission and routing by work count its slots.",
        metavar="N",
        check=concurrency,
        instance=True,
    )
    canary_interval: float = setting(
        300.0,
        "Seconds between canary syntheses of an idle instance: a standard text whose audio is "
        "checked like every answer's; bad audio takes the instance out of rotation and the "
        "health loop restarts it. Never while the instance is busy; 0: off.",
        type=float,
        check=not_negative,
        instance=True,
    )
    no_ui: bool = setting(
        False,
        "Instances serve the API only, without the Gradio UI: less memory per instance, and "
        "they run in a Python without gradio (e.g. a GPU box with torch alone).",
        is_flag=True,
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
        "The outputs dir is kept under this size, oldest deleted first (on Kubernetes: the shared volume, all pods' dirs).",
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
        check=percentage,
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
    max_job_chars: int = setting(
        200_000,
        "Longest text a long-form job (POST /v1/audio/jobs) may hold; it is split like a long text "
        "and made in the background, its audio fetched when done (docs/jobs.md).",
        type=int,
        check=lambda flag, value: (
            "" if 1 <= value <= MAX_JOB_CHARS else f"{flag} must be from 1 to {MAX_JOB_CHARS}, got {value}"
        ),
    )
    job_slots: str = setting(
        "auto",
        "Segments of jobs in flight at once, cluster-wide: N (fixed), or auto: jobs yield to interactive "
        "requests, every serving synthesis slot while none comes, a quarter of them (at least 1) the moment "
        "one does, growing back after a quiet second (docs/jobs.md).",
        metavar="N|auto",
        check=concurrency,
    )
    job_max_age: float = setting(
        7 * 86400.0,
        "Finished jobs (and their audio) are removed this many seconds after they finished.",
        type=float,
        check=above_zero,
    )
    jobs_redis: str = setting(
        "",
        "Keep jobs in this Redis (redis://[:password@]host:port/db) instead of an SQLite file in the "
        "state dir: pods that share one store. Give it in the environment (it may hold a password): "
        "it reaches the jobs process through its environment, never a command line or a log.",
        metavar="URL",
    )
    job_results: str = setting(
        "",
        "Where long-form jobs keep their audio (default: jobs/results in the state dir); pods that share "
        "--jobs-redis need one directory they all mount.",
        metavar="DIR",
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


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


def envvar(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def declarations() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(Settings)


def markdown_table() -> str:
    """The settings table of docs/settings.md (``python -m cosyvoice_lb.common.settings`` prints it)."""
    rows = ["| flag | environment | default | what |", "|---|---|---|---|"]
    for f in dataclasses.fields(Settings):
        default = "the launcher's Python" if f.name == "python" else (f.default if f.default != "" else "—")
        rows.append(f"| `--{f.name.replace('_', '-')}` | `{envvar(f.name)}` | `{default}` | {f.metadata['help']} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
