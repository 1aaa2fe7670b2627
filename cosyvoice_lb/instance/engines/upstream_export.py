"""What upstream writes into a model dir at its first load with --load-vllm or --load-trt,
written ahead by upstream's own code, into a model dir that may be written.

Upstream's ``load_vllm`` exports the LLM to ``<model dir>/vllm`` (``export_cosyvoice2_vllm``,
skipped when that dir exists) and ``load_trt`` builds the flow decoder's TensorRT engine
``<model dir>/flow.decoder.estimator.{fp16|fp32}.mygpu.plan`` from its ONNX file
(``convert_onnx_to_trt``, skipped when the file is there and not empty). A model volume
mounted read-only cannot take either, so `cosyvoice-lb prepare-model` makes a model dir of
links to the read-only one and runs this module there, in the model's Python, to write both;
an instance loading from that dir then finds them and writes nothing.

Run by path (``PYTHON upstream_export.py --model-dir DIR ...``) where cosyvoice-lb is not
installed: the standard library at the top, torch and upstream's code inside :func:`main`.
The last line it prints is JSON: what it made, or ``{"error": ...}`` with exit status 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

VLLM_DIR = "vllm"  # upstream's load_vllm('{model_dir}/vllm')
ONNX = "flow.decoder.estimator.fp32.onnx"  # what upstream's load_trt converts, fp16 or not
NO_GPU = (
    "--load-trt builds a TensorRT engine for the GPU it runs on, and this Python sees none "
    "(torch.cuda.is_available() is False): run prepare-model where the instances' GPU is (on "
    "Kubernetes the initContainer gets the pod's GPU), with the GPU's driver and CUDA torch"
)


def plan_name(fp16: bool) -> str:
    """The engine file upstream's load_trt reads (and writes when missing)."""
    return f"flow.decoder.estimator.{'fp16' if fp16 else 'fp32'}.mygpu.plan"


def generated(load_vllm: bool, load_trt: bool, fp16: bool) -> list[str]:
    """The entries of the model dir these flags make upstream write."""
    return [VLLM_DIR] * load_vllm + [plan_name(fp16)] * load_trt


class ExportError(Exception):
    """What keeps the export from being made, with what to do."""


def _import_upstream(root: str) -> tuple[object, object, object]:
    if root:  # what upstream's scripts do before importing cosyvoice
        for path in (Path(root) / "third_party" / "Matcha-TTS", Path(root)):
            sys.path.insert(0, str(path.resolve()))
    try:
        from cosyvoice.cli.cosyvoice import AutoModel
        from cosyvoice.utils.file_utils import convert_onnx_to_trt, export_cosyvoice2_vllm
    except ImportError as exc:
        raise ExportError(
            f"cannot import upstream CosyVoice ({exc}): pass --cosyvoice-root with the checkout that holds "
            "cosyvoice/ and third_party/Matcha-TTS, and --python with its environment"
        ) from None
    return AutoModel, export_cosyvoice2_vllm, convert_onnx_to_trt


def export(model_dir: str, root: str, load_vllm: bool, load_trt: bool, fp16: bool) -> list[str]:
    """Load the model as upstream does (no vLLM, no TensorRT) and write what those flags make
    upstream write at its first load; the entries made."""
    import torch

    if load_trt:
        if not torch.cuda.is_available():
            raise ExportError(NO_GPU)
        try:
            import tensorrt  # noqa: F401 - upstream's load_trt imports it
        except ImportError as exc:
            raise ExportError(
                f"--load-trt needs TensorRT in this Python ({exc}): upstream's requirements.txt names it"
            ) from None
    auto_model, export_vllm, convert = _import_upstream(root)
    model = auto_model(model_dir=model_dir, fp16=fp16)  # type: ignore[operator]
    made = []
    if load_vllm:
        if not hasattr(model.model, "load_vllm"):
            raise ExportError(f"{model_dir} is a CosyVoice v1 model: --load-vllm is for CosyVoice2 and 3 models")
        export_vllm(model.model.llm, os.path.join(model_dir, VLLM_DIR), model.model.device)  # type: ignore[operator]
        made.append(VLLM_DIR)
    if load_trt:
        plan = os.path.join(model_dir, plan_name(fp16))
        convert(plan, model.model.get_trt_kwargs(), os.path.join(model_dir, ONNX), fp16)  # type: ignore[operator]
        made.append(plan_name(fp16))
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--cosyvoice-root", default="")
    parser.add_argument("--load-vllm", action="store_true")
    parser.add_argument("--load-trt", action="store_true")
    parser.add_argument("--fp16", action="store_true")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        made = export(args.model_dir, args.cosyvoice_root, args.load_vllm, args.load_trt, args.fp16)
    except ExportError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 3
    print(json.dumps({"made": made, "seconds": round(time.monotonic() - started, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
