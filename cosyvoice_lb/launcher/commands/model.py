"""`cosyvoice-lb prepare-model`: parse, call :func:`~cosyvoice_lb.launcher.model.prepare.prepare`, say what it did."""

from __future__ import annotations

from pathlib import Path

import click

from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.model.prepare import Preparation, prepare
from cosyvoice_lb.launcher.options import options


@click.command("prepare-model")
@options("model_dir", "load_vllm", "load_trt", "fp16", "python", "cosyvoice_root")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The model dir to make: links to --model-dir's files, and what --load-vllm / --load-trt write "
    "(replaced when it was made from something else; its parent must be writable).",
)
def prepare_model_command(
    model_dir: str, load_vllm: bool, load_trt: bool, fp16: bool, python: str, cosyvoice_root: str, out: Path
) -> None:
    """Make a model dir --load-vllm / --load-trt can load from when --model-dir is read-only: upstream's
    export for vLLM and its TensorRT engine (built for this GPU) are written into --out by upstream's own
    code in --python; the instances then run with --model-dir OUT. Does nothing when OUT is up to date."""
    if not model_dir:
        raise ClusterError("prepare-model needs --model-dir: the model dir to prepare (it is only read)")
    job = Preparation(
        model_dir=Path(model_dir).expanduser(),
        out=out.expanduser(),
        load_vllm=load_vllm,
        load_trt=load_trt,
        fp16=fp16,
        python=python,
        cosyvoice_root=cosyvoice_root,
    )
    outcome = prepare(job)
    what = ", ".join(outcome.made)
    if outcome.fresh:
        click.echo(f"prepared {outcome.out} from {job.model_dir} ({what}) in {outcome.seconds:.0f} s")
    else:
        click.echo(f"{outcome.out} is up to date with {job.model_dir} ({what}): nothing to do")
    click.echo(f"run the instances with --model-dir {outcome.out}")
