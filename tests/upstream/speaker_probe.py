"""The speech check's speaker model (cosyvoice_lb/instance/quality/speaker.py) on a model
dir's real ``campplus.onnx``, in upstream's Python, beside upstream's own embedding of the
same prompt (``CosyVoiceFrontEnd._extract_spk_embedding``).

    <python> speaker_probe.py --cosyvoice-root CHECKOUT --model-dir DIR --prompt WAV --scratch DIR

Prints one JSON object of facts for tests/instance/quality/test_speaker_similarity.py to judge.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this package, as the instance runs it


def upstreams_embedding(root: str, session, wav: str) -> list[float]:
    """Upstream's frontend's own embedding of ``wav``, with the same onnx session."""
    sys.path[:0] = [root, str(Path(root) / "third_party" / "Matcha-TTS")]
    from cosyvoice.cli.frontend import CosyVoiceFrontEnd

    frontend = types.SimpleNamespace(campplus_session=session, device="cpu")
    return CosyVoiceFrontEnd._extract_spk_embedding(frontend, wav).reshape(-1).tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cosyvoice-root", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--scratch", required=True)
    args = parser.parse_args()

    import numpy as np
    import soundfile

    from cosyvoice_lb.instance.quality.checker import SpeechChecker
    from cosyvoice_lb.instance.quality.speaker import SpeakerError, SpeakerModel, speaker_model_for

    model = speaker_model_for(args.model_dir)
    assert isinstance(model, SpeakerModel), f"no campplus.onnx in {args.model_dir}"
    audio, rate = soundfile.read(args.prompt, dtype="float32")
    # the prompt at 24 kHz (what CosyVoice3 answers at): upstream resamples it to 16 kHz as we do
    at_24k = str(Path(args.scratch) / "prompt-24k.wav")
    n = int(round(audio.size * 24000 / rate))
    soundfile.write(at_24k, np.interp(np.arange(n) * rate / 24000, np.arange(audio.size), audio), 24000)
    t = np.arange(24000 * 3) / 24000
    other = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * np.random.default_rng(1).standard_normal(t.size)).astype(
        np.float32
    )

    embedding = model.embed(audio, rate)
    facts: dict = {
        "shape": list(embedding.shape),
        "finite": bool(np.isfinite(embedding).all()),
        "self": model.similarity(audio, rate, args.prompt),
        "other": model.similarity(other, 24000, args.prompt),
        "cached": model.embed_prompt(args.prompt) is model.embed_prompt(args.prompt),
    }
    with open(args.prompt, "rb") as held:  # (how a live answer's prompt reaches the check)
        facts["self_held"] = model.similarity(audio, rate, held)
    for name, wav in (("16k", args.prompt), ("24k", at_24k)):
        ours, theirs = (
            model.embed_prompt(wav),
            np.asarray(upstreams_embedding(args.cosyvoice_root, model._session, wav)),
        )
        facts[f"upstream_{name}"] = float(np.max(np.abs(ours - theirs)) / max(float(np.max(np.abs(theirs))), 1e-30))
    try:
        model.embed(np.zeros(100, dtype=np.float32), 16000)
        facts["too_short"] = ""
    except SpeakerError as exc:
        facts["too_short"] = str(exc)
    checker = SpeechChecker(None, speaker=model)
    check = checker.check_now("canary", "hello", audio, rate, timeout=120, prompt=args.prompt)
    facts["check"] = check.summary()
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
