"""For bench/gpu.py on a GPU box whose torchaudio reads audio through TorchCodec only.

torchaudio 2.9 and later answer ``torchaudio.load`` with TorchCodec (and FFmpeg), whatever
``backend`` says; upstream CosyVoice's ``load_wav`` asks for ``backend='soundfile'`` and
a box with torch 2.11 alone has neither TorchCodec nor FFmpeg. With this dir on PYTHONPATH
(Python imports ``sitecustomize`` at start), ``torchaudio.load`` reads through soundfile
again, as torchaudio's own soundfile backend did: float32 in [-1, 1], channels first. It
changes nothing where TorchCodec is there or torchaudio is older, and imports nothing until
torchaudio is imported (so a Python that never uses it starts as fast as ever).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any


def needs_soundfile(version: str, torchcodec: bool) -> bool:
    """Whether torchaudio ``version`` (e.g. "2.11.0+cu130") must be given soundfile's load."""
    try:
        major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (2, 9) and not torchcodec


def soundfile_load(
    uri: Any,
    frame_offset: int = 0,
    num_frames: int = -1,
    normalize: bool = True,
    channels_first: bool = True,
    format: str | None = None,
    buffer_size: int = 4096,
    backend: str | None = None,
) -> tuple[Any, int]:
    """``torchaudio.load``'s answer, read by soundfile: (float32 tensor, sample rate)."""
    import soundfile
    import torch

    data, rate = soundfile.read(uri, start=frame_offset, frames=num_frames, dtype="float32", always_2d=True)
    audio = torch.from_numpy(data)
    return (audio.t().contiguous() if channels_first else audio), rate


class SoundfileLoad(importlib.abc.MetaPathFinder):
    """Finds torchaudio as usual, and once it is imported gives it soundfile's load if it
    needs it (see the module's docstring)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torchaudio":
            return None
        sys.meta_path.remove(self)  # (once: the real finders find it)
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            if needs_soundfile(
                str(getattr(module, "__version__", "")), importlib.util.find_spec("torchcodec") is not None
            ):
                module.load = soundfile_load

        loader.exec_module = exec_module
        return spec


if "torchaudio" not in sys.modules:
    sys.meta_path.insert(0, SoundfileLoad())
