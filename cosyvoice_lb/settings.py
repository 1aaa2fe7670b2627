"""Every setting declared once: field, default, help, flag and environment variable.

The CLI options, the ``COSYVOICE_LB_*`` environment variables, ``cluster.json`` and the
README's table all come from :class:`Settings`, so they cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import click

ENV_PREFIX = "COSYVOICE_LB_"

# Default memory one instance needs, per engine: GPU memory on GPU boxes, host RAM on
# CPU-only boxes. The espeak engine uses no GPU: on a GPU box it stands in for
# CosyVoice3 and is planned with CosyVoice3's footprint, so its plan is the model's plan.
# CosyVoice3 (plain, no TRT/vLLM): ~4.5 GB peak reported on an RTX 3060 (DESIGN.md §3),
# rounded up for fragmentation and the warm-up peak.
ENGINE_FOOTPRINTS: dict[str, dict[str, str]] = {
    "espeak": {"gpu": "5GiB", "host": "512MiB"},
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


def setting(default: Any, help: str, *, type: Any = None, is_flag: bool = False,
            choices: tuple[str, ...] | None = None, metavar: str | None = None) -> Any:
    return field(default=default, metadata={
        "help": help, "type": type, "is_flag": is_flag, "choices": choices, "metavar": metavar,
    })


@dataclass(frozen=True)
class Settings:
    """The whole configuration of one cluster."""

    engine: str = setting("auto", "Speech engine of every instance: cosyvoice3 (with --model-dir; v2 and v1 model "
                                  "dirs work too), espeak (embedded, no weights); auto picks cosyvoice3 when "
                                  "--model-dir is given. simulated is a load model for benchmarks, not speech "
                                  "(silence after a wait proportional to the text).", choices=ENGINES)
    model_dir: str = setting("", "CosyVoice model dir (local, holding cosyvoice3.yaml, cosyvoice2.yaml or "
                                 "cosyvoice.yaml).", metavar="DIR")
    cosyvoice_root: str = setting("", "Upstream CosyVoice checkout (holds cosyvoice/ and third_party/Matcha-TTS); "
                                      "not needed when --python's env imports cosyvoice already.", metavar="DIR")
    load_trt: bool = setting(False, "CosyVoice: TensorRT flow decoder (more GPU memory per instance).",
                             is_flag=True)
    load_vllm: bool = setting(False, "CosyVoice2/3: vLLM for the LLM (reserves 0.2 x the card per instance).",
                              is_flag=True)
    fp16: bool = setting(False, "CosyVoice: half precision.", is_flag=True)
    simulated_ms_per_char: float = setting(4.0, "--engine simulated: milliseconds of service time per character "
                                                "of text.", type=float)
    simulated_base_ms: float = setting(0.0, "--engine simulated: milliseconds of service time per request.",
                                       type=float)
    instances: str = setting("auto", "How many instances: a number, or 'auto' for as many as fit.",
                             metavar="N|auto")
    gpus: str = setting("", "Plan for these GPUs instead of asking NVML, e.g. 24GiB,24GiB "
                            "(a card's total; free is taken as total).", metavar="SIZES")
    footprint: str = setting("", "Memory per instance (GPU memory, or host RAM on a CPU-only box); "
                                 "default: the engine's.", metavar="SIZE")
    reserve: str = setting("1GiB", "Memory kept free on every GPU (and in RAM on a CPU-only box).",
                           metavar="SIZE")
    max_instances: int = setting(0, "Never plan more than this many instances (0: no cap).", type=int)
    force: bool = setting(False, "Start --instances N even when fewer fit.", is_flag=True)
    base_port: int = setting(7860, "Port of the first instance; instance i listens on base+i (127.0.0.1).",
                             type=int)
    port: int = setting(8080, "The public port nginx listens on.", type=int)
    host: str = setting("0.0.0.0", "The address nginx listens on.")
    state_dir: str = setting(".", "Where configs, logs, sockets and state live.", metavar="DIR")
    python: str = setting(sys.executable, "Python that runs the instances.", metavar="PATH")
    nginx: str = setting("nginx", "The nginx binary.", metavar="PATH")
    max_chars: int = setting(500, "Longest text one request may ask for.", type=int)
    max_prompt_seconds: float = setting(15.0, "Longer prompt audio is trimmed to this many seconds (with a notice).",
                                        type=float)
    max_upload: str = setting("10MiB", "Largest prompt audio upload.", metavar="SIZE")
    instance_concurrency: int = setting(1, "Syntheses one instance runs at once (upstream's streaming shares "
                                           "state between requests: scale with instances instead).", type=int)
    max_queue: int = setting(2, "API requests one instance lets wait for its engine; past that it answers 503 "
                                "at once and nginx tries another instance (all full: the client gets 503 with "
                                "Retry-After instead of an unbounded wait).", type=int)
    outputs_dir: str = setting("", "Where instances keep every result (default: outputs/ in the state dir).",
                               metavar="DIR")
    outputs_max_age: float = setting(86400.0, "Results older than this many seconds are deleted.", type=float)
    outputs_max_size: str = setting("2GiB", "The outputs dir is kept under this size (oldest deleted first).",
                                    metavar="SIZE")
    stagger: bool = setting(False, "Start instances one after another, each loaded before the next "
                                   "(N model loads at once can exhaust host memory).", is_flag=True)
    probe_interval: float = setting(1.0, "Seconds between two health probes of an instance.", type=float)
    probe_timeout: float = setting(2.0, "Seconds a probe may take before it counts as failed.", type=float)
    fail_threshold: int = setting(3, "Failed probes in a row that take an instance out and restart it.",
                                  type=int)
    recover_threshold: int = setting(2, "Good probes in a row that put an instance back in rotation.",
                                     type=int)
    hang_timeout: float = setting(60.0, "A synthesis that yields no audio for this many seconds means the instance "
                                        "is hung: it is taken out and restarted, and nginx retries its requests "
                                        "elsewhere (keep it below --request-timeout so there is time for that).",
                                  type=float)
    request_timeout: float = setting(90.0, "Longest an API request waits for its answer (or a stream for its first "
                                           "chunk), counted from its arrival at nginx, retries included; past it "
                                           "the client gets a 504 that says so.", type=float)
    startup_timeout: float = setting(300.0, "Seconds an instance may take to load before it counts as "
                                            "failed (never killed for being slow before that).", type=float)
    max_requests: int = setting(0, "Recycle an instance (a drained restart, one at a time) after this many "
                                   "requests, against slow leaks (0: never).", type=int)
    max_requests_jitter: int = setting(0, "Add 0..N to --max-requests per instance, so they do not all recycle "
                                          "together.", type=int)
    max_memory: str = setting("", "Recycle an instance whose RSS (or GPU memory, per process) grows past this, "
                                  "e.g. 12GiB (empty: never).", metavar="SIZE")
    drain_timeout: float = setting(30.0, "Seconds in-flight requests get to finish when an instance stops.",
                                   type=float)
    start_retries: int = setting(3, "Failed starts in a row before supervisord gives an instance up.",
                                 type=int)
    retries: int = setting(3, "Instances nginx tries for one API request (refused, dead or loading).",
                           type=int)

    @property
    def staggered(self) -> bool:
        """One instance loads at a time: asked for, or forced by TensorRT/vLLM, whose first
        load writes engine files into the model dir that parallel loads would race on."""
        return self.stagger or (self.resolved_engine == "cosyvoice3" and (self.load_trt or self.load_vllm))

    @property
    def resolved_engine(self) -> str:
        if self.engine != "auto":
            return self.engine
        return "cosyvoice3" if self.model_dir else "espeak"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> "Settings":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names and v is not None})


def envvar(name: str) -> str:
    return ENV_PREFIX + name.upper()


def options(*names: str) -> Callable:
    """Click options for the named settings, each with its ``COSYVOICE_LB_*`` variable."""
    by_name = {f.name: f for f in dataclasses.fields(Settings)}

    def decorate(command: Callable) -> Callable:
        for name in reversed(names):
            f = by_name[name]
            meta = f.metadata
            kwargs: dict[str, Any] = {
                "envvar": envvar(name), "show_envvar": True, "help": meta["help"],
                "default": f.default, "show_default": not meta["is_flag"] and name != "python",
            }
            if meta["is_flag"]:
                kwargs["is_flag"] = True
            elif meta["choices"]:
                kwargs["type"] = click.Choice(meta["choices"])
            elif meta["type"]:
                kwargs["type"] = meta["type"]
            if meta["metavar"]:
                kwargs["metavar"] = meta["metavar"]
            command = click.option("--" + name.replace("_", "-"), name, **kwargs)(command)
        return command

    return decorate


PLAN_OPTIONS = ("engine", "model_dir", "load_trt", "load_vllm", "fp16", "instances", "gpus", "footprint", "reserve",
                "max_instances", "force", "base_port", "state_dir")
CLUSTER_OPTIONS = PLAN_OPTIONS + tuple(
    f.name for f in dataclasses.fields(Settings) if f.name not in PLAN_OPTIONS
)


def markdown_table() -> str:
    """The README's settings table (``python -m cosyvoice_lb.settings`` prints it)."""
    rows = ["| flag | environment | default | what |", "|---|---|---|---|"]
    for f in dataclasses.fields(Settings):
        default = "the launcher's Python" if f.name == "python" else (f.default if f.default != "" else "—")
        rows.append(f"| `--{f.name.replace('_', '-')}` | `{envvar(f.name)}` | `{default}` | {f.metadata['help']} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
