"""Build a small CosyVoice3 model dir that upstream's ``AutoModel`` loads as CosyVoice3.

    <upstream env python> build_model.py --cosyvoice-root CHECKOUT --out DIR

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


def build_qwen(where: Path, vocab_size: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=None,
        **QWEN_DIMS,
    )
    Qwen2ForCausalLM(config).save_pretrained(str(where))


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
    with torch.no_grad():
        for layer in llm.llm.model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embedding = llm.speech_embedding.weight
        embedding.copy_(torch.randn(embedding.shape, generator=generator))
        embedding[:, 0] = 3.0  # one constant dimension: what the stop logits read
        decoder = llm.llm_decoder.weight
        decoder.copy_(0.2 * torch.randn(decoder.shape, generator=generator))
        decoder[:, 0] = 0.0
        decoder[rows:, :] = 0.0
        decoder[rows, 0] = 1.2  # the stop token upstream holds back until the minimum length
        decoder[rows + 1 :, 0] = -10.0  # the others: never


def build(root: Path, out: Path) -> None:
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
    build_qwen(qwen, max(151936, len(tokenizer.tokenizer)))
    shutil.copy(HERE / "cosyvoice3.yaml", work / "cosyvoice3.yaml")
    with open(work / "cosyvoice3.yaml") as f:
        configs = load_hyperpyyaml(f, overrides={"qwen_pretrain_path": str(qwen)})
    speak_like_a_trained_model(configs["llm"])
    for name in ("llm", "flow", "hift"):
        torch.save(configs[name].state_dict(), work / f"{name}.pt")
    torch.save({}, work / "spk2info.pt")
    build_onnx(work)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(work, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cosyvoice-root", required=True, type=Path, help="an upstream CosyVoice checkout")
    parser.add_argument("--out", required=True, type=Path, help="the model dir to write")
    args = parser.parse_args()
    started = time.monotonic()
    build(args.cosyvoice_root.resolve(), args.out.resolve())
    print(f"built {args.out} in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
