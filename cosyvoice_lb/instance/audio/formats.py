"""The ``response_format`` of ``/v1/audio/speech``: mp3, opus, aac, flac, wav or pcm at 24 kHz.

An engine yields mono float32 chunks in [-1, 1] at its own rate; everything leaves at
``OUTPUT_RATE`` (24 kHz, what OpenAI's endpoint answers with), so chunks are resampled first
(linear interpolation; libsndfile's Opus also takes only 8, 12, 16, 24 or 48 kHz) and clipped.

``Encoder`` turns chunks into bytes as they arrive, so an answer can stream:

- ``pcm`` is raw s16le mono; ``wav`` is the same behind a header whose sizes say "unknown"
  (0xFFFFFFFF, as streaming servers write it). Whole-audio ``encode()`` writes true sizes.
- ``mp3``, ``opus`` (Ogg) and ``flac`` go through libsndfile (soundfile), writing into
  ``_Sink``. What libsndfile 1.2 was seen to do with its file:

  * Ogg/Opus only ever appends; pages come out every 200 ms of audio (set below; the
    default is about a second).
  * MP3 appends, then at close seeks back to the start to overwrite LAME's placeholder
    first frame with the Xing/LAME info frame (length, gapless trim). Bytes a client already
    has cannot change, so a streamed mp3 keeps neither: the sink drops that rewrite and the
    placeholder frame (a header over zeros that would decode as one frame of silence) is
    never handed out. What is left is plain CBR frames, which any decoder plays.
  * FLAC seeks back at close to fill STREAMINFO (sample count, MD5, frame sizes), which is
    at the start of the file, so a flac is held back whole and comes out of ``finish()``.

- ``aac`` is ADTS from PyAV (FFmpeg's encoder), imported only when asked for: the one
  format that needs more than numpy and soundfile, see ``available()``.

Instance side: imports the standard library, numpy and soundfile only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import soundfile

from cosyvoice_lb.instance.audio.wav import pcm16, wav_header

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
CONTENT_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/opus",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
OUTPUT_RATE = 24000

MP3_KBPS = 64  # CBR; at 24 kHz mono that is plenty for speech
AAC_BITRATE = 64000
OGG_PAGE_MS = 200.0  # how much Opus audio one Ogg page (one piece of a stream) carries
# What finish() encodes when nothing was fed, so an empty answer is still a file players open
# (libsndfile and the ADTS muxer write nothing at all for no samples).
EMPTY_SAMPLES = OUTPUT_RATE // 50

_LIBSNDFILE = {  # format -> (libsndfile major format, subtype)
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
    "flac": ("FLAC", "PCM_16"),
}


class FormatUnavailable(ValueError):
    """A known format this instance's Python cannot produce; the message says what to do."""


def _choices(but: str = "") -> str:
    names = [f for f in FORMATS if f != but]
    return ", ".join(names[:-1]) + " or " + names[-1]


def _unknown(fmt: object) -> str:
    return f"response_format {fmt!r} is not supported: use one of {', '.join(FORMATS)}"


def available(fmt: str) -> str:
    """Why ``fmt`` cannot be produced here and what to ask for instead, or "" when it can:
    cheap, so a request can be refused before any synthesis."""
    if fmt not in FORMATS:
        return _unknown(fmt)
    if fmt == "aac":
        return _aac_problem()
    if fmt in _LIBSNDFILE:
        major, subtype = _LIBSNDFILE[fmt]
        if not soundfile.check_format(major, subtype):
            return (
                f"{fmt} needs libsndfile >= 1.1 with {subtype} support in the instances' Python "
                f"(pip install -U soundfile); or ask for {_choices(but=fmt)}"
            )
    return ""


def _aac_problem() -> str:
    fix = f"or ask for {_choices(but='aac')}"
    try:
        import av
    except ImportError:
        return f"aac needs PyAV in the instances' Python: pip install av; {fix}"
    try:
        av.codec.Codec("aac", "w")
    except Exception:
        return f"aac needs PyAV built with FFmpeg's aac encoder in the instances' Python: pip install -U av; {fix}"
    return ""


def _check(fmt: str) -> None:
    problem = available(fmt)
    if problem:
        raise (FormatUnavailable if fmt in FORMATS else ValueError)(problem)


# --- resampling ------------------------------------------------------------------------------


class Resampler:
    """Streaming linear-interpolation resampler: output sample ``k`` is source position
    ``k * source_rate / target_rate``, interpolated between its two neighbours.

    Exact integer positions make the result independent of how the input is cut into chunks
    (feeding pieces gives what feeding the whole gives). A chunk's last sample is held back
    until the next chunk (or ``finish()``) supplies its right neighbour. In all, ``n`` source
    samples give ``ceil(n * target_rate / source_rate)`` output samples. No anti-alias
    filter: meant for speech going up to 24 kHz or down from rates close to it.
    """

    def __init__(self, source_rate: int, target_rate: int = OUTPUT_RATE):
        if int(source_rate) <= 0 or int(target_rate) <= 0:
            raise ValueError(f"sample rates must be positive, not {source_rate} -> {target_rate}")
        common = math.gcd(int(source_rate), int(target_rate))
        self.source_rate, self.target_rate = int(source_rate), int(target_rate)
        self._step = self.source_rate // common  # output k sits at source position k * step / per
        self._per = self.target_rate // common
        self._held = np.zeros(0, dtype=np.float32)  # source samples from index _base on
        self._base = 0
        self._seen = 0  # source samples fed so far
        self._next = 0  # index of the next output sample

    def feed(self, chunk: np.ndarray) -> np.ndarray:
        audio = np.asarray(chunk, dtype=np.float32).reshape(-1)
        if self._step == self._per:
            return audio
        self._held = np.concatenate([self._held, audio])
        self._seen += audio.size
        # Only outputs whose right neighbour has arrived: position < seen - 1.
        return self._emit(max(self._seen - 1, 0))

    def finish(self) -> np.ndarray:
        """What is left: outputs up to the end, the last sample standing in for its missing
        right neighbour."""
        if self._step == self._per:
            return np.zeros(0, dtype=np.float32)
        return self._emit(self._seen)

    def _emit(self, limit: int) -> np.ndarray:
        stop = -(-limit * self._per // self._step)  # outputs whose position < limit
        if stop <= self._next:
            return np.zeros(0, dtype=np.float32)
        where = np.arange(self._next, stop, dtype=np.int64) * self._step
        left = where // self._per - self._base
        frac = ((where % self._per) / self._per).astype(np.float32)
        right = np.minimum(left + 1, self._held.size - 1)
        out = self._held[left] + frac * (self._held[right] - self._held[left])
        self._next = stop
        keep = self._next * self._step // self._per  # the next output's left neighbour
        self._held = self._held[keep - self._base :]
        self._base = keep
        return out.astype(np.float32, copy=False)


# --- byte sinks ------------------------------------------------------------------------------


class _Sink:
    """The file libsndfile or PyAV writes into, handing out what is final as it comes.

    ``stream=True``: append-only. Bytes once written never change (they may have been sent):
    a write over them is dropped, but for any part past the end, while seek/tell keep
    working so the writer carries on.
    ``stream=False``: an ordinary seekable buffer that hands out everything at the end.
    """

    def __init__(self, stream: bool):
        self.stream = stream
        self.data = bytearray()
        self.pos = 0
        self.taken = 0  # bytes handed out (or, for mp3, skipped)

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        end = self.pos + len(chunk)
        if self.pos > len(self.data):
            self.data.extend(bytes(self.pos - len(self.data)))
        if not self.stream:
            self.data[self.pos : end] = chunk
        elif end > len(self.data):
            self.data.extend(chunk[len(self.data) - self.pos :])
        self.pos = end
        return len(chunk)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: len(self.data)}[whence]
        self.pos = max(base + offset, 0)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, size: int = -1) -> bytes:
        end = len(self.data) if size is None or size < 0 else self.pos + size
        out = bytes(self.data[self.pos : end])
        self.pos += len(out)
        return out

    def seekable(self) -> bool:
        return True

    def take(self, final: bool = False) -> bytes:
        if not (self.stream or final):
            return b""
        out = bytes(self.data[self.taken :])
        self.taken = len(self.data)
        return out


_MP3_KBPS = {  # layer III bitrate tables: MPEG-1, MPEG-2 and 2.5
    1: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    2: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def mp3_frame_size(header: bytes) -> int:
    """The length in bytes of the MPEG layer III frame that starts with ``header`` (4 bytes),
    or 0 when it is not the start of one."""
    if len(header) < 4 or header[0] != 0xFF or (header[1] & 0xE6) != 0xE2:  # sync bits, layer III
        return 0
    version, kbps_index, rate_index = (header[1] >> 3) & 3, header[2] >> 4, (header[2] >> 2) & 3
    if version == 1 or kbps_index in (0, 15) or rate_index == 3:
        return 0
    mpeg1 = version == 3
    kbps = _MP3_KBPS[1 if mpeg1 else 2][kbps_index]
    padding = (header[2] >> 1) & 1
    return (144 if mpeg1 else 72) * kbps * 1000 // _MP3_RATES[version][rate_index] + padding


# --- encoders --------------------------------------------------------------------------------


class _Pcm:
    """pcm: s16le as it comes; wav: the same after a 44-byte header."""

    def __init__(self, header: bool, stream: bool):
        self.header, self.stream = header, stream
        self.held: list[bytes] = []
        self.started = False

    def write(self, audio: np.ndarray) -> bytes:
        data = pcm16(audio)
        if not self.stream:
            self.held.append(data)
            return b""
        if self.header and not self.started:
            self.started = True
            return wav_header(OUTPUT_RATE, None) + data
        return data

    def close(self) -> bytes:
        if self.stream:
            return self.write(np.zeros(0, dtype=np.float32))
        data = b"".join(self.held)
        return (wav_header(OUTPUT_RATE, len(data)) if self.header else b"") + data


class _Libsndfile:
    def __init__(self, fmt: str, stream: bool):
        major, subtype = _LIBSNDFILE[fmt]
        self.fmt = fmt
        self.sink = _Sink(stream and fmt != "flac")  # flac: see the module's docstring
        self.placeholder_checked = fmt != "mp3" or not self.sink.stream
        self.file = self._open(major, subtype)

    def _open(self, major: str, subtype: str) -> Any:
        args: dict[str, Any] = dict(mode="w", samplerate=OUTPUT_RATE, channels=1, format=major, subtype=subtype)
        # MPEG-2 layer III (24 kHz) bitrate = 160 - 152 * level kbit/s, cut to an integer.
        level = (160 - MP3_KBPS) / 152 - 0.001
        if self.fmt == "mp3":
            # CBR: a streamed mp3 has no info frame, and without one a VBR file's length is
            # guessed from its first frame (libsndfile then reads a fraction of it).
            try:
                return soundfile.SoundFile(self.sink, bitrate_mode="CONSTANT", compression_level=level, **args)
            except TypeError:  # soundfile < 0.13
                pass
        handle = soundfile.SoundFile(self.sink, **args)
        if self.fmt == "mp3":
            _sf_command(handle, _SFC_SET_BITRATE_MODE, "int*", 0)  # SF_BITRATE_MODE_CONSTANT
            _sf_command(handle, _SFC_SET_COMPRESSION_LEVEL, "double*", level)
        if self.fmt == "opus":
            _sf_command(handle, _SFC_SET_OGG_PAGE_LATENCY_MS, "double*", OGG_PAGE_MS)
        return handle

    def write(self, audio: np.ndarray) -> bytes:
        self.file.write(audio)
        return self._take()

    def close(self) -> bytes:
        self.file.close()
        return self._take(final=True)

    def _take(self, final: bool = False) -> bytes:
        if not self.placeholder_checked:
            # LAME's placeholder is the first frame: a header over zeros. Skip it once it is whole.
            data = self.sink.data
            size = mp3_frame_size(bytes(data[:4]))
            if len(data) < max(size, 4) and not final:
                return b""
            if size and len(data) >= size and not any(data[4:size]):
                self.sink.taken = size
            self.placeholder_checked = True
        return self.sink.take(final)


# libsndfile commands (sndfile.h) that older soundfile versions, or all of them, have no call for
_SFC_SET_COMPRESSION_LEVEL = 0x1301
_SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302
_SFC_SET_BITRATE_MODE = 0x1305


def _sf_command(handle: Any, command: int, ctype: str, value: float) -> None:
    """sf_command() on an open SoundFile through soundfile's own cffi handle. Best effort:
    what it sets improves a stream, and a soundfile or libsndfile without it still works."""
    try:
        from soundfile import _ffi, _snd

        _snd.sf_command(handle._file, command, _ffi.new(ctype, value), _ffi.sizeof(ctype.rstrip("*")))
    except Exception:
        pass


class _Aac:
    """AAC-LC in ADTS (self-delimiting frames, so any prefix of the stream plays) via PyAV."""

    def __init__(self, stream: bool):
        import av

        self.av = av
        self.sink = _Sink(stream)
        # flush_packets: every packet reaches the sink at once instead of after 32 KB.
        self.container = av.open(self.sink, "w", format="adts", container_options={"flush_packets": "1"})
        self.audio = self.container.add_stream("aac", rate=OUTPUT_RATE, layout="mono")
        self.audio.bit_rate = AAC_BITRATE
        self.pts = 0

    def write(self, audio: np.ndarray) -> bytes:
        frame = self.av.AudioFrame.from_ndarray(audio.reshape(1, -1), format="fltp", layout="mono")
        frame.sample_rate = OUTPUT_RATE
        frame.pts = self.pts
        self.pts += audio.size
        self.container.mux(self.audio.encode(frame))  # PyAV cuts it into 1024-sample frames
        return self.sink.take()

    def close(self) -> bytes:
        self.container.mux(self.audio.encode(None))
        self.container.close()
        return self.sink.take(final=True)


class Encoder:
    """Chunks of mono float audio at ``source_rate`` in, the bytes of ``fmt`` out.

    Every ``feed()`` returns what can be sent now (b"" while the codec buffers); ``finish()``
    returns the rest, after which the concatenation of all returns is a complete file.
    ``stream=False`` (what ``encode()`` uses) holds everything back for ``finish()``, which can
    then write what only the end knows: true wav sizes, mp3's info frame.
    """

    def __init__(self, fmt: str, source_rate: int, *, stream: bool = True):
        _check(fmt)
        self.format = fmt
        self.content_type = CONTENT_TYPES[fmt]
        self.resampler = Resampler(source_rate, OUTPUT_RATE)
        self.samples = 0  # at OUTPUT_RATE, handed to the codec
        self.done = False
        self.codec: _Pcm | _Libsndfile | _Aac
        if fmt in ("pcm", "wav"):
            self.codec = _Pcm(header=fmt == "wav", stream=stream)
        elif fmt == "aac":
            self.codec = _Aac(stream)
        else:
            self.codec = _Libsndfile(fmt, stream)

    def feed(self, chunk: np.ndarray) -> bytes:
        if self.done:
            raise RuntimeError("this Encoder has finished")
        return self._encode(self.resampler.feed(_clean(chunk)))

    def finish(self) -> bytes:
        if self.done:
            raise RuntimeError("this Encoder has finished")
        out = self._encode(self.resampler.finish())
        if self.samples == 0 and self.format not in ("pcm", "wav"):
            out += self._encode(np.zeros(EMPTY_SAMPLES, dtype=np.float32))
        self.done = True
        return out + self.codec.close()

    def _encode(self, audio: np.ndarray) -> bytes:
        if audio.size == 0:
            return b""
        self.samples += audio.size
        return self.codec.write(audio)


def _clean(chunk: np.ndarray) -> np.ndarray:
    """Mono float32 in [-1, 1]; NaN and infinities become silence or full scale."""
    audio = np.asarray(chunk, dtype=np.float32)
    if audio.ndim == 2 and 1 in audio.shape:
        audio = audio.reshape(-1)
    if audio.ndim != 1:
        raise ValueError(f"mono audio expected (one dimension), got an array of shape {audio.shape}")
    return np.clip(np.nan_to_num(audio, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0)


def encode(audio: np.ndarray, source_rate: int, fmt: str) -> bytes:
    """The whole of ``audio`` as one ``fmt`` file at ``OUTPUT_RATE``."""
    encoder = Encoder(fmt, source_rate, stream=False)
    return encoder.feed(audio) + encoder.finish()
