"""Several syntheses at once in one model on upstream's code: what the engine's layer
(``cosyvoice_lb/instance/engines/upstream_tts.py``) gives, as one JSON object.

    <upstream env python> concurrency_probe.py --cosyvoice-root CHECKOUT --model-dir DIR --greedy-dir DIR

``--greedy-dir``: the same model with greedy sampling (top-1, no repetition fallback), so
a synthesis is a function of its input and runs can be compared sample for sample; the
flow and vocoder draw their noise from buffers fixed at load. ``--model-dir``: the model
as built, with upstream's random sampling, for the seeded case.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Short texts: the random-weight LLM runs to its length limit (20 speech tokens a text
# token), so each is a few seconds of CPU; still long enough for three chunks or more.
TEXTS = [
    "Hello there, first voice test.",
    "A second one, longer than the first.",
    "Third one here.",
]


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("cosyvoice_lb"):
            self.messages.append(record.getMessage())


def engine(args, model_dir: str, concurrency: int = 4):
    from cosyvoice_lb.instance.engines.cosyvoice import CosyVoiceEngine

    made = CosyVoiceEngine(  # (the flow and HiFT batched too: outputs must not cross there either)
        model_dir=model_dir, cosyvoice_root=args.cosyvoice_root, concurrency=concurrency, token2wav_batch=concurrency
    )
    made.load()
    return made


def request(prompt: str, text: str, stream: bool = True, seed: int | None = None, voice_id: str = ""):
    from cosyvoice_lb.instance.engines import SynthesisRequest

    return SynthesisRequest(
        text=text,
        mode="zero_shot",
        prompt_wav=prompt,
        prompt_text="希望你以后能够做的比我还好呦。",
        stream=stream,
        seed=seed,
        voice_id=voice_id,
    )


def chunks(eng, req) -> list:
    return [c.copy() for c in eng.synthesize(req)]


def together(eng, requests: list) -> list[list]:
    """Each request's chunks, all started at once, one thread each."""
    results: list[list] = [[] for _ in requests]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = chunks(eng, requests[i])
        except BaseException as exc:  # noqa: BLE001 - reported
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if errors:
        raise errors[0]
    return results


def same(a: list, b: list) -> bool:
    import numpy as np

    return len(a) == len(b) and all(x.shape == y.shape and np.allclose(x, y, atol=1e-5) for x, y in zip(a, b))


def sizes(result: list) -> list[int]:
    return [int(c.size) for c in result]


def concurrent_facts(eng, prompt: str) -> dict:
    """Streams and whole syntheses beside others vs the same alone (greedy model)."""
    streams = [request(prompt, t) for t in TEXTS]
    alone = [chunks(eng, r) for r in streams]
    side_by_side = together(eng, streams)
    wholes = [request(prompt, t, stream=False) for t in TEXTS[:2]]
    whole_alone = [chunks(eng, r) for r in wholes]
    whole_together = together(eng, wholes + streams[:1])
    return {
        "chunk_sizes_alone": [sizes(r) for r in alone],
        "chunk_sizes_together": [sizes(r) for r in side_by_side],
        "streams_same_together": [same(a, b) for a, b in zip(alone, side_by_side)],
        "whole_same_together": [same(a, b) for a, b in zip(whole_alone, whole_together)],
        "repeat_same": same(alone[0], chunks(eng, streams[0])),
    }


def voice_facts(eng, prompt: str, other_prompt: str) -> dict:
    """Two saved voices spoken at once from the speaker cache, each as it sounds alone."""
    first = request(prompt, TEXTS[0], voice_id="voice_a")
    second = request(other_prompt, TEXTS[0], voice_id="voice_b")
    alone = [chunks(eng, first), chunks(eng, second)]
    both = together(eng, [first, second])
    return {
        "voices_differ": not same(alone[0], alone[1]),
        "voices_same_together": [same(alone[i], both[i]) for i in range(2)],
        "cached": sorted(eng.cached),
    }


def seeded_facts(eng, prompt: str) -> dict:
    """A seeded request alone and while unseeded ones run (random sampling model)."""
    seeded = request(prompt, TEXTS[1], seed=7)
    alone = chunks(eng, seeded)
    results = together(eng, [request(prompt, TEXTS[0]), seeded, request(prompt, TEXTS[2])])
    return {
        "seeded_same_beside_others": same(alone, results[1]),
        "seeded_repeat_same": same(alone, chunks(eng, seeded)),
    }


def poll_free(eng, prompt: str) -> str:
    """A stream with upstream's module-level time.sleep made to fail: 'ok' when never called."""
    import cosyvoice.cli.model as upstream_model

    class NoSleep:
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def sleep(_seconds):
            raise AssertionError("time.sleep was called")

    real = upstream_model.time
    upstream_model.time = NoSleep()
    try:
        chunks(eng, request(prompt, TEXTS[0]))
        return "ok"
    except AssertionError as exc:
        return str(exc)
    finally:
        upstream_model.time = real


def llm_failure(eng, prompt: str) -> str:
    """How a synthesis ends when upstream's LLM thread raises (upstream's own path polls on)."""
    llm = eng.model.model.llm
    real = llm.inference

    def broken(*args, **kwargs):
        raise RuntimeError("the LLM broke")
        yield  # pragma: no cover - a generator, as upstream's

    llm.inference = broken
    outcome: list[str] = []

    def run() -> None:
        try:
            chunks(eng, request(prompt, TEXTS[0]))
            outcome.append("ok")
        except RuntimeError as exc:
            outcome.append(f"raised: {exc}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    llm.inference = real
    return outcome[0] if outcome else "hung"


def left_early(eng, prompt: str) -> dict:
    """A reader that stops after the first chunk: its state goes, its LLM thread ends."""
    inner = eng.model.model
    before = threading.active_count()
    stream = eng.synthesize(request(prompt, TEXTS[1] * 3))
    next(stream)
    stream.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (inner.tts_speech_token_dict or threading.active_count() > before):
        time.sleep(0.05)
    return {"state_left": len(inner.tts_speech_token_dict), "threads_left": threading.active_count() - before}


def fallback_facts(args, prompt: str) -> dict:
    """Upstream's internals in another shape (token2wav without its named parameters): one
    warning, and upstream's own path still speaks."""
    import cosyvoice.cli.model as upstream_model

    cls = upstream_model.CosyVoice3Model
    real = cls.token2wav

    def token2wav(self, *args, **kwargs):
        return real(self, *args, **kwargs)

    cls.token2wav = token2wav
    handler = Warnings()
    logging.getLogger().addHandler(handler)
    try:
        eng = engine(args, args.greedy_dir, concurrency=2)
        made = together(eng, [request(prompt, TEXTS[0]), request(prompt, TEXTS[2])])
    finally:
        cls.token2wav = real
        logging.getLogger().removeHandler(handler)
    return {
        "own_path": eng.own_path,
        "warnings": handler.messages,
        "spoke": [sum(sizes(r)) > 0 for r in made],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cosyvoice-root", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--greedy-dir", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--other-prompt", required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    greedy = engine(args, args.greedy_dir)
    facts = {"own_path": greedy.own_path}
    facts.update(concurrent_facts(greedy, args.prompt))
    facts.update(voice_facts(greedy, args.prompt, args.other_prompt))
    facts["poll"] = poll_free(greedy, args.prompt)
    facts["llm_failure"] = llm_failure(greedy, args.prompt)
    facts["left_early"] = left_early(greedy, args.prompt)
    facts.update(seeded_facts(engine(args, args.model_dir), args.prompt))
    facts["fallback"] = fallback_facts(args, args.prompt)
    print(json.dumps(facts))
    sys.stdout.flush()
    os._exit(0)  # (daemon LLM threads of the hung cases must not hold the exit)


if __name__ == "__main__":
    main()
