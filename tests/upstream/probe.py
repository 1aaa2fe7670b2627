"""What a CosyVoice checkout's ``AutoModel`` does with the calls the engine adapter makes.

    <python> probe.py --cosyvoice-root CHECKOUT --model-dir DIR --prompt WAV

Run against upstream's checkout (on the small model build_model.py makes) and against the
contract fake, it prints the same facts as one JSON object, so a test can set them side by
side: the classes and signatures, what each mode yields, streaming, seeds, speed, the
speaker cache, and how bad input fails. Nothing here knows which checkout it runs.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
import threading

ENDOFPROMPT = "<|endofprompt|>"
SYSTEM = "You are a helpful assistant."
TRANSCRIPT = f"{SYSTEM}{ENDOFPROMPT}希望你以后能够做的比我还好呦。"  # upstream example.py's v3 form
TEXT = "Hello there, this is a test of the voice."


def describe(outputs) -> dict:
    """What a generator of upstream's outputs yielded."""
    import torch

    items = list(outputs)
    speech = [item["tts_speech"] for item in items]
    joined = torch.cat([s.reshape(-1) for s in speech]) if speech else torch.zeros(0)
    return {
        "items": len(items),
        "keys": sorted({key for item in items for key in item}),
        "types": sorted({type(s).__name__ for s in speech}),
        "dtypes": sorted({str(s.dtype) for s in speech}),
        "shapes": sorted({f"{s.dim()}d, {s.shape[0]} row(s)" for s in speech}),
        "samples": int(joined.numel()),
        "finite": bool(torch.isfinite(joined).all()),
        "within_one": bool(joined.abs().max() <= 1.0) if joined.numel() else True,
    }


def failure(call) -> str:
    """How a call fails: 'ok', or the exception's class and the start of its message."""
    try:
        for _ in call():
            pass
    except Exception as exc:  # noqa: BLE001 - the fact is which exception upstream raises
        return f"{type(exc).__name__}: {str(exc)[:60]}"
    return "ok"


def hangs(call, seconds: float) -> bool:
    """The call neither returns nor raises within ``seconds`` (left running in a daemon thread)."""
    done = threading.Event()

    def run() -> None:
        try:
            for _ in call():
                pass
        except Exception:  # noqa: BLE001 - a failure is an answer too
            pass
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return not done.wait(seconds)


def write_wav(path: str, rate: int, seconds: float) -> str:
    import numpy as np
    import soundfile

    t = np.arange(int(rate * seconds)) / rate
    soundfile.write(path, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), rate)
    return path


def probe(model_dir: str, prompt: str) -> dict:
    import torch
    from cosyvoice.cli.cosyvoice import AutoModel
    from cosyvoice.utils.common import set_all_random_seed

    model = AutoModel(model_dir=model_dir)
    loaded_hop = getattr(model.model, "token_hop_len", None)
    cls = type(model)
    facts: dict = {
        "class": cls.__name__,
        "sample_rate": model.sample_rate,
        "signatures": {
            name: list(inspect.signature(getattr(cls, name)).parameters)
            for name in (
                "__init__",
                "inference_zero_shot",
                "inference_cross_lingual",
                "inference_instruct2",
                "add_zero_shot_spk",
                "list_available_spks",
            )
        },
        "speakers": model.list_available_spks(),
    }
    zero_shot = lambda **kw: model.inference_zero_shot(TEXT, TRANSCRIPT, prompt, **kw)  # noqa: E731
    facts["zero_shot"] = describe(zero_shot())
    facts["zero_shot_stream"] = describe(zero_shot(stream=True))
    # the streaming chunk size (tokens) as loaded, then after one stream: upstream doubles it
    # after every streamed chunk and leaves it there (the adapter resets it for each stream)
    facts["stream_chunk_tokens"] = {
        "loaded": loaded_hop,
        "after": getattr(model.model, "token_hop_len", None),
        "chunks": facts["zero_shot_stream"]["items"],
    }
    facts["cross_lingual"] = describe(model.inference_cross_lingual(f"{SYSTEM}{ENDOFPROMPT}{TEXT}", prompt))
    facts["instruct2"] = describe(model.inference_instruct2(TEXT, f"{SYSTEM} Speak slowly.{ENDOFPROMPT}", prompt))

    def seeded(seed: int, **kw):
        """The whole zero-shot audio after upstream's own seeding."""
        set_all_random_seed(seed)
        return torch.cat([o["tts_speech"] for o in zero_shot(**kw)], dim=1)

    first, again, other, fast = seeded(7), seeded(7), seeded(8), seeded(7, speed=2.0)
    facts["same_seed_same_audio"] = bool(first.shape == again.shape and torch.equal(first, again))
    facts["other_seed_other_audio"] = not (first.shape == other.shape and torch.equal(first, other))
    facts["speed_2_length_ratio"] = round(fast.shape[1] / first.shape[1], 1)
    facts["stream_with_speed"] = failure(lambda: zero_shot(stream=True, speed=2.0))

    facts["punctuation_only"] = describe(model.inference_zero_shot("。！？", TRANSCRIPT, prompt))["items"]
    # v3's cross-lingual form holds a special token: upstream's text frontend skips itself
    facts["punctuation_only_cross_lingual"] = describe(
        model.inference_cross_lingual(f"{SYSTEM}{ENDOFPROMPT}。！？", prompt)
    )["items"]
    facts["no_endofprompt"] = failure(lambda: model.inference_zero_shot(TEXT, "希望你以后能够做的比我还好呦。", prompt))
    facts["no_endofprompt_stream_hangs"] = hangs(
        lambda: model.inference_zero_shot(TEXT, "希望你以后能够做的比我还好呦。", prompt, stream=True), 5.0
    )
    with tempfile.TemporaryDirectory() as scratch:
        low = write_wav(os.path.join(scratch, "low.wav"), 8000, 3)
        long = write_wav(os.path.join(scratch, "long.wav"), 16000, 31)
        facts["prompt_8khz"] = failure(lambda: model.inference_cross_lingual(TEXT, low))
        facts["prompt_31s"] = failure(lambda: model.inference_cross_lingual(TEXT, long))

    facts["add_zero_shot_spk"] = model.add_zero_shot_spk(TRANSCRIPT, prompt, "voice_a")
    facts["speakers_after_add"] = model.list_available_spks()
    facts["cached_zero_shot"] = describe(model.inference_zero_shot(TEXT, "", "", zero_shot_spk_id="voice_a"))
    facts["cached_cross_lingual"] = describe(
        model.inference_cross_lingual(f"{SYSTEM}{ENDOFPROMPT}{TEXT}", "", zero_shot_spk_id="voice_a")
    )
    facts["unknown_cached_id"] = failure(lambda: model.inference_zero_shot(TEXT, "", "", zero_shot_spk_id="nobody"))
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cosyvoice-root", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--prompt", required=True, help="a 16 kHz or better WAV of a few seconds")
    args = parser.parse_args()
    root = os.path.abspath(args.cosyvoice_root)
    sys.path[:0] = [os.path.join(root, "third_party", "Matcha-TTS"), root]
    facts = probe(args.model_dir, args.prompt)
    print(json.dumps(facts, ensure_ascii=False, sort_keys=True))
    sys.stdout.flush()
    os._exit(0)  # a hung upstream call may still hold a thread: leave without joining it


if __name__ == "__main__":
    main()
