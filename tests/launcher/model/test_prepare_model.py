"""`cosyvoice-lb prepare-model` (cosyvoice_lb/launcher/model/prepare.py) before it runs upstream:
what it refuses and how it says so (nothing written), what counts as "up to date", the links it
makes and the swap into place. Upstream's export itself, on a read-only copy of the small model,
and the TensorRT refusal without a GPU: tests/integration/test_prepare_model_cluster.py."""

from __future__ import annotations

import json
import os

import pytest
from conftest import cli_here

from cosyvoice_lb.instance.engines.upstream_export import ONNX, generated, plan_name
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.model.prepare import (
    RECORD,
    Preparation,
    check,
    fingerprint,
    link_model,
    swap_in,
    up_to_date,
)


@pytest.fixture
def model(tmp_path):
    """A model dir as far as prepare-model looks before upstream loads it."""
    found = tmp_path / "ro" / "cv3"
    (found / "CosyVoice-BlankEN").mkdir(parents=True)
    for name in ("cosyvoice3.yaml", "llm.pt", "flow.pt", ONNX, "CosyVoice-BlankEN/config.json"):
        (found / name).write_text(name)
    return found


def job(model, out, **flags) -> Preparation:
    return Preparation(
        model_dir=model, out=out, python=os.path.realpath("/proc/self/exe"), **({"load_vllm": True} | flags)
    )


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda m, o: job(m, o, load_vllm=False), "nothing to prepare: give --load-vllm and/or --load-trt"),
        (lambda m, o: job(m.parent / "gone", o), "does not exist or is not a directory"),
        (lambda m, o: job(m / "CosyVoice-BlankEN", o), "has none of cosyvoice.yaml"),
        (lambda m, o: job(m, m / "prepared"), "is inside the model dir or holds it"),
        (lambda m, o: job(m, m), "is inside the model dir or holds it"),
        (lambda m, o: job(m, m.parent), "is inside the model dir or holds it"),
        (lambda m, o: Preparation(m, o, load_vllm=True, python="/no/such/python"), "--python '/no/such/python'"),
    ],
)
def test_refusals_say_what_to_change(model, tmp_path, change, says):
    with pytest.raises(ClusterError, match=says):
        check(change(model, tmp_path / "out"))


def test_trt_needs_the_onnx_file_and_vllm_a_v2_or_v3_model(model, tmp_path):
    (model / ONNX).unlink()
    with pytest.raises(ClusterError, match=f"no {ONNX}, which upstream builds the TensorRT engine from"):
        check(job(model, tmp_path / "out", load_vllm=False, load_trt=True))
    (model / "cosyvoice3.yaml").rename(model / "cosyvoice.yaml")
    with pytest.raises(ClusterError, match="is a CosyVoice v1 model: --load-vllm is for v2 and v3"):
        check(job(model, tmp_path / "out"))


def test_an_out_that_is_not_a_prepared_dir_is_never_replaced(model, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    with pytest.raises(ClusterError, match="exists and is not a dir prepare-model made: give a new path"):
        check(job(model, theirs))
    (tmp_path / "empty").mkdir()
    check(job(model, tmp_path / "empty"))  # an empty dir is taken (a mount point's parent made ahead)
    (theirs / RECORD).write_text("{}")
    check(job(model, theirs))  # one it made is replaced when stale


def test_the_made_entries_are_upstreams_names():
    assert generated(True, False, False) == ["vllm"]
    assert generated(False, True, False) == ["flow.decoder.estimator.fp32.mygpu.plan"]
    assert (
        generated(True, True, True) == ["vllm", "flow.decoder.estimator.fp16.mygpu.plan"] == ["vllm", plan_name(True)]
    )


def test_links_to_every_entry_but_those_made_here(model, tmp_path):
    (model / "vllm").mkdir()  # (an export already on the volume is made again here, not linked)
    built = tmp_path / "built"
    built.mkdir()
    link_model(job(model, tmp_path / "out"), built)
    names = sorted(p.name for p in built.iterdir())
    assert names == sorted(["cosyvoice3.yaml", "llm.pt", "flow.pt", ONNX, "CosyVoice-BlankEN"])
    assert all(p.is_symlink() and os.readlink(p) == str(model.resolve() / p.name) for p in built.iterdir())
    assert (built / "CosyVoice-BlankEN" / "config.json").read_text() == "CosyVoice-BlankEN/config.json"


def test_up_to_date_only_when_made_from_the_same_files_and_flags_and_whole(model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    wanted = job(model, out)
    link_model(wanted, out)
    (out / "vllm").mkdir()
    (out / RECORD).write_text(json.dumps(fingerprint(wanted)))
    assert not up_to_date(wanted, fingerprint(wanted))  # an export cut short: no config, no weights
    (out / "vllm" / "config.json").write_text("{}")
    (out / "vllm" / "model.safetensors").write_text("w")
    assert up_to_date(wanted, fingerprint(wanted))
    assert not up_to_date(job(model, out, fp16=True), fingerprint(job(model, out, fp16=True)))  # other flags
    os.utime(model / "llm.pt", ns=(1, 1))  # the weights changed: the export is of the old ones
    assert not up_to_date(wanted, fingerprint(wanted))
    (out / RECORD).write_text(json.dumps(fingerprint(wanted)))
    assert up_to_date(wanted, fingerprint(wanted))
    (out / "flow.pt").unlink()  # a link gone
    assert not up_to_date(wanted, fingerprint(wanted))


def test_the_built_dir_takes_outs_place_whole(tmp_path):
    out, built = tmp_path / "out", tmp_path / ".out.build-1"
    built.mkdir()
    (built / "new").write_text("new")
    swap_in(built, out)
    assert (out / "new").read_text() == "new" and not built.exists()
    again = tmp_path / ".out.build-2"
    again.mkdir()
    (again / "newer").write_text("newer")
    swap_in(again, out)
    assert sorted(p.name for p in out.iterdir()) == ["newer"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # (the old one removed)


def test_the_command_refuses_before_writing(model, tmp_path):
    out = tmp_path / "prepared" / "cv3"
    done = cli_here("prepare-model", "--out", str(out), "--load-vllm")
    assert done.returncode == 2 and "prepare-model needs --model-dir" in done.stderr
    done = cli_here("prepare-model", "--model-dir", str(tmp_path / "gone"), "--out", str(out), "--load-trt")
    assert done.returncode == 2 and "does not exist or is not a directory" in done.stderr
    done = cli_here("prepare-model", "--model-dir", str(model), "--out", str(out))
    assert done.returncode == 2 and "nothing to prepare" in done.stderr
    assert not (tmp_path / "prepared").exists()
