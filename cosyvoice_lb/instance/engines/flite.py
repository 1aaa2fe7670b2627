"""The embedded engine ``flite``: Debian's Festival Lite, real English speech with no model
weights, in four voices.

Beside espeak-ng it is the voice a recogniser understands (pocketsphinx's English model
transcribes its ``slt`` voice nearly word for word, espeak-ng's hardly at all), so the speech
check is tested on real speech. Each sentence is one run of ``flite`` (text and audio in
files: from a pipe flite writes a WAV header it cannot go back to fill in, and on an empty
pipe it waits forever), yielded as soon as it is made. It speaks English only: text with no
letter or digit of a Latin script is refused as unspeakable (422), and runs of other
scripts are left out.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from cosyvoice_lb.instance.engines import EngineError, SynthesisRequest, Unspeakable
from cosyvoice_lb.instance.engines.tool import mono, run_tool

SAMPLE_RATE = 16000
# The speakers (mode sft), the default first -> flite's voice ("kal" is 8 kHz; "kal16" is
# the same voice at 16 kHz).
VOICES = {"slt": "slt", "rms": "rms", "awb": "awb", "kal": "kal16"}
# A sentence ends at . ! ? ; or a line break, followed by space.
_SENTENCES = re.compile(r"[^.!?;\n]*(?:[.!?;]+|\n|$)")
_SPEAKABLE = re.compile(r"[A-Za-z0-9]")
# What flite reads: Latin-script text; anything else is dropped rather than spelled as noise.
_OTHER_SCRIPTS = re.compile(r"[^\x00-\x7f\u00a0-\u024f\u2018-\u201d]+")


def sentences(text: str) -> list[str]:
    """``text`` cut into what flite speaks in one run each: its sentences, with something to say."""
    spoken = _OTHER_SCRIPTS.sub(" ", text)
    return [s.strip() for s in _SENTENCES.findall(spoken) if _SPEAKABLE.search(s)]


class FliteEngine:
    name = "flite"
    sample_rate = SAMPLE_RATE
    modes = ("sft",)  # built-in voices only; no cloning

    def __init__(self, binary: str = "flite", timeout: float = 60.0):
        self.binary = binary
        self.timeout = timeout

    def speakers(self) -> list[str]:
        return list(VOICES)

    def load(self) -> None:
        path = shutil.which(self.binary)
        if path is None:
            raise EngineError(f"{self.binary} not found: install it (Debian/Ubuntu: apt-get install flite)")
        self.binary = path
        listed = run_tool([self.binary, "-lv"], self.timeout).decode(errors="replace")
        missing = [v for v in VOICES.values() if v not in listed.split()]
        if missing:
            raise EngineError(f"flite lacks the voice(s) {', '.join(missing)}: it lists {listed.strip()}")
        self._speak("slt", "ready", 1.0)  # one real synthesis proves it speaks here

    def synthesize(self, request: SynthesisRequest) -> Iterator[np.ndarray]:
        pieces = sentences(request.text)
        if not pieces:
            raise Unspeakable(
                "the flite engine speaks English only and this text has no Latin letter or digit: "
                "send English text, or start the cluster with --engine espeak or a CosyVoice model"
            )
        voice = VOICES.get(request.speaker or "slt", "slt")
        for piece in pieces:
            if request.cancel is not None and request.cancel.is_set():
                return
            yield self._speak(voice, piece, request.speed)

    def _speak(self, voice: str, text: str, speed: float) -> np.ndarray:
        stretch = 1.0 / speed if speed > 0 else 1.0
        with tempfile.TemporaryDirectory(prefix="cvlb-flite-") as scratch:
            said, wav = Path(scratch, "text.txt"), Path(scratch, "speech.wav")
            said.write_text(text, encoding="utf-8")
            argv = [self.binary, "-voice", voice, "--setf", f"duration_stretch={stretch:.4f}", "-f", str(said)]
            run_tool([*argv, "-o", str(wav)], self.timeout)
            return mono(wav.read_bytes() if wav.exists() else b"", SAMPLE_RATE, "flite")
