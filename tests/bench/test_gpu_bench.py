"""bench/gpu.py's pure parts (which setups run, the rows' order, the table's cells), the
torchaudio shim's decision (bench/gpu_site), the wheel list for the GPU box and the
full-size model's config (tests/upstream/build_model.py). The whole bench on a real cluster:
tests/integration/test_gpu_bench_smoke.py."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpu  # noqa: E402  (bench/gpu.py)


def module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


shim = module(ROOT / "bench" / "gpu_site" / "sitecustomize.py")
builder = module(ROOT / "tests" / "upstream" / "build_model.py")
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "SoundfileLoad"]  # (loading it installed one)


def reasons(gpu_seen: bool, mps: str, vllm: str) -> dict[str, str]:
    return {setup.name: why for setup, why in gpu.setups(gpu_seen, mps, vllm)}


def test_on_a_cpu_only_plain_runs_and_every_other_setup_says_why():
    assert reasons(False, "no GPU", "vllm does not import") == {
        "plain": "",
        "fp16": "no GPU (upstream runs float32 on a CPU)",
        "plain + MPS": "no GPU",
        "fp16 + MPS": "no GPU (upstream runs float32 on a CPU)",
        "vllm": "no GPU",
        "vllm + batched flow/HiFT": "no GPU",
    }


def test_on_a_gpu_mps_and_vllm_run_where_they_can():
    assert set(reasons(True, "", "").values()) == {""}
    without = reasons(True, "no nvidia-cuda-mps-control", "vllm does not import")
    assert without == {
        "plain": "",
        "fp16": "",
        "plain + MPS": "no nvidia-cuda-mps-control",
        "fp16 + MPS": "no nvidia-cuda-mps-control",
        "vllm": "vllm does not import",
        "vllm + batched flow/HiFT": "vllm does not import",
    }


def test_setups_run_in_order_of_importance_with_their_flags():
    order = [(s.name, s.flags()) for s, _ in gpu.setups(True, "", "")]
    one = ["--token2wav-batch", "1"]
    assert order == [
        ("plain", one),
        ("fp16", ["--fp16", *one]),
        ("plain + MPS", [*one, "--mps"]),
        ("fp16 + MPS", ["--fp16", *one, "--mps"]),
        ("vllm", ["--load-vllm", *one]),
        ("vllm + batched flow/HiFT", ["--load-vllm"]),
    ]


def test_rows_go_up_in_instances_then_down_at_the_next_concurrency():
    assert gpu.cells((1, 2, 4), (1, 4)) == [(1, 1), (2, 1), (4, 1), (4, 4), (2, 4), (1, 4)]
    assert gpu.cells((2, 1), (2, 1)) == [(1, 1), (2, 1), (2, 2), (1, 2)]
    full = gpu.cells(gpu.FULL.processes, gpu.FULL.concurrency)
    assert sorted(full) == sorted((p, c) for p in gpu.FULL.processes for c in gpu.FULL.concurrency)


def test_a_row_shows_its_rate_percentiles_and_samples():
    row = gpu.Row("fp16", 2, 4, requests=5, ok=4, audio_seconds=30.0, seconds=10.0, first=[0.1, 0.2, 0.3, 0.4])
    cells = row.as_dict()
    assert cells["requests"] == "4/5" and cells["rate"] == "3.00"
    assert cells["p50"] == "250" and cells["p99"] == "397 (n=4)" and cells["memory"] == "—"


def test_a_row_without_answers_or_a_skipped_setup_has_dashes():
    empty = gpu.Row("plain", 1, 1, requests=2).as_dict()
    assert (empty["requests"], empty["rate"], empty["p50"], empty["p99"]) == ("0/2", "—", "—", "—")
    skipped = gpu.skipped(gpu.Setup("vllm", False), gpu.FULL, "vllm does not import").as_dict()
    assert skipped["processes"] == "1, 2, 4" and skipped["concurrency"] == "1, 4"
    assert skipped["requests"] == "skipped: vllm does not import" and skipped["rate"] == "—"


def test_the_table_has_one_line_per_row_under_its_header():
    rows = [gpu.Row("plain", 1, 1, requests=1, ok=1, audio_seconds=2.0, seconds=1.0, first=[0.5]).as_dict()]
    lines = gpu.run.table(rows, gpu.COLUMNS).splitlines()
    assert lines[0].startswith("| setup | processes | concurrency |") and len(lines) == 3
    assert lines[2] == "| plain | 1 | 1 | 1/1 | 2.00 | 500 | 500 (n=1) | — |"


@pytest.mark.parametrize(
    "per_pid, delta, nvml, cell",
    [
        ({11: 3 * 2**30, 12: 5 * 2**30}, 0, True, "5120"),
        ({}, 8 * 2**30, True, "≈2048"),
        ({}, 0, True, "—"),
        ({}, 8 * 2**30, False, "—"),
    ],
)
def test_memory_is_per_process_else_the_card_spread_else_a_dash(per_pid, delta, nvml, cell):
    assert gpu.memory_cell(per_pid, delta, 4, nvml) == cell


@pytest.mark.parametrize(
    "version, torchcodec, needed",
    [
        ("2.11.0+cu130", False, True),
        ("2.9.0", False, True),
        ("2.11.0", True, False),
        ("2.8.0", False, False),
        ("2.3.1+cu121", False, False),
        ("3.0", False, True),
        ("", False, False),
        ("nightly", False, False),
    ],
)
def test_the_shim_gives_soundfile_to_torchaudio_from_2_9_without_torchcodec(version, torchcodec, needed):
    assert shim.needs_soundfile(version, torchcodec) is needed


WHEELS = ROOT / "bench" / "gpu_wheels.txt"
PIN = re.compile(r"^([A-Za-z0-9._-]+)==([A-Za-z0-9.+-]+)(\s+# sdist)?$")


def pins() -> dict[str, str]:
    lines = [line.strip() for line in WHEELS.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert all(PIN.match(line) for line in lines), [line for line in lines if not PIN.match(line)]
    found = [PIN.match(line).groups()[:2] for line in lines]
    assert len({name.lower() for name, _ in found}) == len(found), "a package twice: the box's pip stops"
    return dict(found)


def test_the_wheel_list_is_what_the_readme_lists_and_fits_in_64_mib():
    readme = (ROOT / "bench" / "README.md").read_text()
    rows = re.findall(r"^\| `([A-Za-z0-9._-]+)==([^`]+)` \| ([0-9.]+) \|", readme, re.M)
    listed = {name: version for name, version, _ in rows}
    assert listed == pins()
    assert sum(float(size) for *_, size in rows) <= 64


def test_the_full_model_keeps_what_inference_reads_of_a_recipe():
    recipe = """# seeds
__set_seed1: !apply:random.seed [1986]
sample_rate: 24000
llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    llm_input_size: 896
flow: !new:x.Flow
    dim: 1024
hift: !new:x.Hift
    base_channels: 512
# gan related module
hifigan: !new:x.HiFiGan
    generator: !ref <hift>
parquet_opener: !name:cosyvoice.dataset.processor.parquet_opener
get_tokenizer: !name:x.tok
    version: cosyvoice3
allowed_special: 'all'
feat_extractor: !name:x.mel
    n_fft: 1920
data_pipeline: [
    !ref <parquet_opener>,
]
train_conf:
    optim: adam
"""
    kept = builder.inference_config(recipe)
    keys = [line.split(":")[0] for line in kept.splitlines() if line[:1].strip() and not line.startswith("#")]
    assert keys == [
        "__set_seed1",
        "sample_rate",
        "llm",
        "flow",
        "hift",
        "get_tokenizer",
        "allowed_special",
        "feat_extractor",
    ]
    assert "dim: 1024" in kept and "base_channels: 512" in kept
    for dropped in ("\nhifigan:", "\nparquet_opener:", "\ndata_pipeline:", "\n]", "optim: adam"):
        assert dropped not in kept
    with pytest.raises(SystemExit, match="no hift"):
        builder.inference_config(recipe.replace("hift:", "vocoder:"))


@pytest.mark.skipif(not os.environ.get("CVLB_UPSTREAM"), reason="CVLB_UPSTREAM names no upstream checkout")
def test_upstreams_own_recipe_gives_the_real_dimensions():
    kept = builder.inference_config((Path(os.environ["CVLB_UPSTREAM"]) / builder.RECIPE).read_text())
    assert "llm_input_size: 896" in kept and "depth: 22" in kept and "base_channels: 512" in kept
    for dropped in ("\nhifigan:", "\ndata_pipeline:", "\ntrain_conf:", "\nmel_spec_transform1:"):
        assert dropped not in kept
