"""Build a small CosyVoice3 model dir that upstream's ``AutoModel`` loads as CosyVoice3.

    <upstream env python> build_model.py --cosyvoice-root CHECKOUT --out DIR [--full]

Runs in the environment that runs upstream's code (torch, transformers, hyperpyyaml, onnx)
with the checkout's own classes, so the weights have exactly the shapes its code builds:

- ``cosyvoice3.yaml``: upstream's model config, small dimensions (tests/upstream/cosyvoice3.yaml);
- ``CosyVoice-BlankEN/``: a 2-layer Qwen2 and a byte-level tokenizer laid out like Qwen2's
  (151,643 ordinary tokens, then ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``), so
  upstream's CosyVoice3 tokenizer gives ``<|endofprompt|>`` the id its LLM asserts (151646);
- ``llm.pt``, ``flow.pt``, ``hift.pt``: the state dicts of the models the yaml builds, randomly
  initialised, the LLM's then set so that it ends an utterance as a trained one does
  (speak_like_a_trained_model);
- ``campplus.onnx`` (fbank [1, T, 80] -> embedding [1, 192]) and ``speech_tokenizer_v3.onnx``
  (whisper mel [1, 128, T] and its length -> tokens [1, ceil(T/4)] in 0..6560): upstream's
  input and output shapes, a few arithmetic nodes inside;
- ``spk2info.pt``: an empty speaker table (CosyVoice3 releases have no built-in speakers).

The audio it makes is noise. It is built in a sibling dir and renamed into place, so a
reader never sees half a model; it prints the dir and how long the build took.

``--llm-width N``: the small model with an N-wide LLM (its Qwen2 N wide, 2 heads: head dim
N/2), for vLLM, whose CPU attention takes head dims of 32, 64, 96, 128... (the default 32
gives 16); the flow and HiFT stay as small.

``--full``: the real model's size instead (for speed and memory figures without its weights,
bench/gpu.py): the model part of upstream's own recipe config,
examples/libritts/cosyvoice3/conf/cosyvoice3.yaml in the checkout (the 1024-wide, 22-layer
DiT flow, the 512-channel HiFT, 896-wide LLM input), and the Qwen2 of CosyVoice3's
CosyVoice-BlankEN (Qwen2-0.5B's config: 24 layers of 896, 14 heads and 2 key-value heads,
4864 in the MLP, tied embeddings, saved in bfloat16 as released), random weights set as
above; about 4.3 GB on disk, built in about a minute on 2 CPU cores. ``--device cuda``
initialises the Qwen2's weights there (the default for --full when a GPU is visible).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
QWEN_ORDINARY = 151643  # Qwen2's ordinary tokens; its specials follow from this id on
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFPROMPT_ID = 151646  # what upstream's CosyVoice3LM asserts on (cosyvoice/llm/llm.py)
SPEECH_TOKENS = 6561
QWEN_DIMS = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
# Qwen2-0.5B's config.json (CosyVoice-BlankEN's LLM; its vocabulary as the small one's)
QWEN_FULL = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
}
# Upstream's recipe config, of which --full keeps what inference reads (the rest trains).
RECIPE = Path("examples") / "libritts" / "cosyvoice3" / "conf" / "cosyvoice3.yaml"
INFERENCE_KEYS = ("llm", "flow", "hift", "get_tokenizer", "allowed_special", "feat_extractor")


def build_tokenizer(where: Path) -> None:
    """A byte-level BPE tokenizer with Qwen2's id layout (no merges: one token per byte)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    vocab.update({f"[unused{i}]": i for i in range(len(vocab), QWEN_ORDINARY)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token=None, bos_token=None
    )
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS[1:]})
    ids = tokenizer.convert_tokens_to_ids(QWEN_SPECIALS)
    assert ids == list(range(QWEN_ORDINARY, QWEN_ORDINARY + 3)), ids
    tokenizer.save_pretrained(str(where))


def build_qwen(where: Path, vocab_size: int, full: bool = False, device: str = "cpu", width: int = 0) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    dims = QWEN_FULL if full else {"max_position_embeddings": 4096, **QWEN_DIMS}
    if width and not full:
        dims.update(hidden_size=width, intermediate_size=2 * width)
    config = Qwen2Config(
        vocab_size=vocab_size, tie_word_embeddings=True, use_sliding_window=False, sliding_window=None, **dims
    )
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    if full:  # (as released: bfloat16 on disk; llm.pt holds the float32 weights that are used)
        model = model.to(torch.bfloat16)
        model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(str(where))


def inference_config(recipe: str) -> str:
    """The part of upstream's recipe config (its top-level entries) that inference reads: the
    plain settings and the seeds, the three models and the frontend's functions. The GAN, the
    data pipeline and the training settings would only be built and thrown away."""
    blocks: list[list[str]] = [[]]
    for line in recipe.splitlines(keepends=True):
        if line[:1].strip() and not line.startswith(("#", "]", "}")):  # a top-level entry starts
            blocks.append([])
        blocks[-1].append(line)
    kept = []
    for block in blocks[1:]:
        key, _, value = block[0].partition(":")
        body = [line for line in block[1:] if line.strip() and not line.lstrip().startswith("#")]
        setting = not body and (key.startswith("__set_seed") or "!" not in value)
        if key in INFERENCE_KEYS or setting:
            kept.append("".join(block))
    text = "".join(kept)
    missing = [k for k in INFERENCE_KEYS if f"\n{k}:" not in f"\n{text}"]
    if missing:
        raise SystemExit(f"upstream's recipe config has no {', '.join(missing)}: is it a CosyVoice3 config?")
    return text


def build_onnx(where: Path) -> None:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def save(graph, name: str) -> None:
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        onnx.checker.check_model(model)
        onnx.save(model, str(where / name))

    # campplus: kaldi fbank [1, T, 80] -> a 192-dim speaker embedding [1, 192]
    weight = numpy_helper.from_array(rng.standard_normal((80, 192)).astype(np.float32), "weight")
    save(
        helper.make_graph(
            [
                helper.make_node("ReduceMean", ["input"], ["mean"], axes=[1], keepdims=0),
                helper.make_node("MatMul", ["mean", "weight"], ["output"]),
            ],
            "campplus",
            [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])],
            [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 192])],
            [weight],
        ),
        "campplus.onnx",
    )

    # speech tokenizer v3: whisper log-mel [1, 128, T] at 100 frames/s and its length ->
    # one token per 4 frames (25 Hz), each in 0..6560
    consts = [
        numpy_helper.from_array(np.array(v, dtype=np.int64), n)
        for v, n in (([0], "starts"), ([2**62], "ends"), ([2], "axes"), ([4], "steps"), (SPEECH_TOKENS, "vocab"))
    ]
    consts.append(numpy_helper.from_array(np.array(997.0, dtype=np.float32), "scale"))
    save(
        helper.make_graph(
            [
                helper.make_node("Slice", ["feats", "starts", "ends", "axes", "steps"], ["frames"]),
                helper.make_node("ReduceSum", ["frames", "sum_axes"], ["energy"], keepdims=0),
                helper.make_node("Mul", ["energy", "scale"], ["scaled"]),
                helper.make_node("Abs", ["scaled"], ["magnitude"]),
                helper.make_node("Cast", ["magnitude"], ["whole"], to=TensorProto.INT64),
                helper.make_node("Mod", ["whole", "vocab"], ["indices"]),
            ],
            "speech_tokenizer_v3",
            [
                helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
                helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
            ],
            [helper.make_tensor_value_info("indices", TensorProto.INT64, [1, "N"])],
            [*consts, numpy_helper.from_array(np.array([1], dtype=np.int64), "sum_axes")],
        ),
        "speech_tokenizer_v3.onnx",
    )


def end_like_bistream(llm) -> None:
    """What upstream's bistream decode (text fed as a generator) wants besides: its end is the
    end-of-speech token (6562), never another stop token, and the text tokens it reads between
    speech tokens must not look like a stop. Here the LLM says 6562 right after the task token
    (which bistream appends once the text is done) and never else, and text tokens read like
    speech ones. Other modes keep their stop (6561) unless their last input is the task token
    (cross-lingual, instruct): those then say nothing, so this model is for zero-shot."""
    import torch

    rows = SPEECH_TOKENS
    with torch.no_grad():
        text = llm.llm.model.model.embed_tokens.weight
        text[:, 0], text[:, 1] = 3.0, 0.0
        speech = llm.speech_embedding.weight
        speech[:, 1] = 0.0
        speech[rows + 2, 1] = 3.0  # the task token (CosyVoice3LM.task_id)
        llm.llm_decoder.weight[rows + 1, 1] = 20.0  # end of speech (CosyVoice3LM.eos_token)


def speak_like_a_trained_model(llm) -> None:
    """Random weights fall into a few tokens and stop at once: 199 of the 200 stop tokens
    end an utterance before upstream's minimum length (2 speech tokens per text token; it
    holds back only token 6561). Set instead, the LLM picks its next token by the last one
    (the layers add nothing to the residual stream), near uniformly among the 6561 speech
    tokens, never a stop token but 6561, and that one about 1 step in 20, so an utterance
    runs its minimum plus a few dozen tokens, a length that follows the text."""
    import torch

    rows = SPEECH_TOKENS
    generator = torch.Generator().manual_seed(0)
    # The speech logits' spread is the small model's at any width (0.2 at 32 dimensions).
    spread = 0.2 * (32 / llm.speech_embedding.weight.shape[1]) ** 0.5
    with torch.no_grad():
        for layer in llm.llm.model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embedding = llm.speech_embedding.weight
        embedding.copy_(torch.randn(embedding.shape, generator=generator).to(embedding.device))
        embedding[:, 0] = 3.0  # one constant dimension: what the stop logits read
        decoder = llm.llm_decoder.weight
        decoder.copy_(spread * torch.randn(decoder.shape, generator=generator).to(decoder.device))
        decoder[:, 0] = 0.0
        decoder[rows:, :] = 0.0
        decoder[rows, 0] = 1.2  # the stop token upstream holds back until the minimum length
        decoder[rows + 1 :, 0] = -10.0  # the others: never


def small_config(width: int) -> str:
    """The small model's yaml, its LLM ``width`` wide (0: as written, 32)."""
    text = (HERE / "cosyvoice3.yaml").read_text()
    if not width:
        return text
    for key in ("llm_input_size", "llm_output_size"):
        line = f"{key}: {QWEN_DIMS['hidden_size']}\n"
        assert line in text, line
        text = text.replace(line, f"{key}: {width}\n")
    return text


def build(
    root: Path, out: Path, full: bool = False, device: str = "cpu", width: int = 0, bistream: bool = False
) -> None:
    for path in (root / "third_party" / "Matcha-TTS", root):
        sys.path.insert(0, str(path))
    import torch
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer
    from hyperpyyaml import load_hyperpyyaml

    work = out.parent / f".{out.name}.{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    qwen = work / "CosyVoice-BlankEN"
    qwen.mkdir(parents=True)
    build_tokenizer(qwen)
    tokenizer = get_qwen_tokenizer(str(qwen), True, "cosyvoice3")  # upstream's own, with its specials
    assert tokenizer.encode("<|endofprompt|>") == [ENDOFPROMPT_ID], tokenizer.encode("<|endofprompt|>")
    build_qwen(qwen, max(151936, len(tokenizer.tokenizer)), full, device, width)
    if full:
        (work / "cosyvoice3.yaml").write_text(inference_config((root / RECIPE).read_text()))
    else:
        (work / "cosyvoice3.yaml").write_text(small_config(width))
    # (on the CPU: upstream's Qwen2Encoder loads the Qwen2 with from_pretrained, which keeps
    # its own devices; the flow and HiFT take seconds here)
    with open(work / "cosyvoice3.yaml") as f:
        configs = load_hyperpyyaml(f, overrides={"qwen_pretrain_path": str(qwen)})
    configs["llm"].float()  # (the Qwen inside loads as its config says: bfloat16 with --full)
    speak_like_a_trained_model(configs["llm"])
    if bistream:
        end_like_bistream(configs["llm"])
    for name in ("llm", "flow", "hift"):
        torch.save({k: v.cpu() for k, v in configs[name].state_dict().items()}, work / f"{name}.pt")
    torch.save({}, work / "spk2info.pt")
    build_onnx(work)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(work, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cosyvoice-root", required=True, type=Path, help="an upstream CosyVoice checkout")
    parser.add_argument("--out", required=True, type=Path, help="the model dir to write")
    parser.add_argument("--full", action="store_true", help="the real model's dimensions (upstream's recipe config)")
    parser.add_argument(
        "--llm-width", type=int, default=0, help="the small model's LLM width (head dim half of it; 64+ for vLLM)"
    )
    parser.add_argument(
        "--bistream", action="store_true", help="an LLM that ends as upstream's bistream decode wants (zero-shot only)"
    )
    parser.add_argument(
        "--device", default="auto", help="where the weights are made: cpu, cuda (auto: cuda for --full if seen)"
    )
    args = parser.parse_args()
    started = time.monotonic()
    device = args.device
    if device == "auto":  # (the small model: on the CPU, as ever)
        import torch

        device = "cuda" if args.full and torch.cuda.is_available() else "cpu"
    if args.llm_width and (args.full or args.llm_width % 2 or args.llm_width < 32):
        parser.error("--llm-width: an even width of 32 or more, for the small model (not with --full)")
    build(args.cosyvoice_root.resolve(), args.out.resolve(), args.full, device, args.llm_width, args.bistream)
    print(f"built {args.out} in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
