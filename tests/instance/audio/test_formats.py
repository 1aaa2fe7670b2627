"""Response formats (cosyvoice_lb/instance/audio/formats.py): every format decodes back to the audio that went
in, at 24 kHz, whether encoded whole or streamed in chunks; streams give bytes before the end;
the linear resampler does not depend on how its input is cut."""

from __future__ import annotations

import io
import struct
import sys

import av
import numpy as np
import pytest
import soundfile

from cosyvoice_lb.instance.audio import formats
from cosyvoice_lb.instance.audio.formats import (
    CONTENT_TYPES,
    FORMATS,
    OUTPUT_RATE,
    Encoder,
    FormatUnavailable,
    Resampler,
    available,
    encode,
)

SECONDS = 1.5
TONE = 220.0
AMPLITUDE = 0.5
# Decoded length may exceed the input by the codec's delay and last-frame padding: without a
# container field to trim it, mp3 adds ~1100 samples of encoder delay and aac 1024 of priming.
SLACK = {"mp3": 2400, "aac": 2400, "opus": 960, "flac": 0, "wav": 0, "pcm": 0}


def sine(rate: int, seconds: float = SECONDS, freq: float = TONE) -> np.ndarray:
    return (AMPLITUDE * np.sin(2 * np.pi * freq * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def stream(fmt: str, audio: np.ndarray, rate: int, chunk_seconds: float = 0.1) -> list[bytes]:
    """What an Encoder returns for ``audio`` fed in chunks: one item per feed, finish() last."""
    encoder = Encoder(fmt, rate)
    step = int(chunk_seconds * rate)
    pieces = [encoder.feed(audio[i : i + step]) for i in range(0, audio.size, step)]
    return pieces + [encoder.finish()]


def decode(fmt: str, data: bytes) -> tuple[np.ndarray, int, int]:
    """(first channel as float, sample rate, channels)."""
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767, OUTPUT_RATE, 1
    if fmt == "aac":
        with av.open(io.BytesIO(data), format="aac") as container:
            audio = container.streams.audio[0]
            samples = np.concatenate([frame.to_ndarray() for frame in container.decode(audio)], axis=1)
            return samples[0], audio.rate, samples.shape[0]
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return samples[:, 0], rate, samples.shape[1]


def assert_is_the_tone(fmt: str, decoded: np.ndarray, expected_samples: int) -> None:
    slack = SLACK[fmt]
    assert expected_samples <= decoded.size <= expected_samples + slack, f"{fmt}: {decoded.size} samples"
    spectrum = np.abs(np.fft.rfft(decoded)) ** 2
    freqs = np.fft.rfftfreq(decoded.size, 1 / OUTPUT_RATE)
    assert abs(freqs[np.argmax(spectrum)] - TONE) < 2
    near_tone = spectrum[np.abs(freqs - TONE) < 10].sum() / spectrum.sum()
    assert near_tone > 0.95, f"{fmt}: only {near_tone:.0%} of the energy is the tone"
    rms = float(np.sqrt(np.mean(decoded[:expected_samples] ** 2)))
    assert rms == pytest.approx(AMPLITUDE / np.sqrt(2), rel=0.1)


# --- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [22050, 24000])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("how", ["whole", "streamed"])
def test_each_format_decodes_to_the_tone_at_24k(fmt, rate, how):
    audio = sine(rate)
    data = encode(audio, rate, fmt) if how == "whole" else b"".join(stream(fmt, audio, rate))
    decoded, decoded_rate, channels = decode(fmt, data)
    assert (decoded_rate, channels) == (OUTPUT_RATE, 1)
    assert_is_the_tone(fmt, decoded, int(SECONDS * OUTPUT_RATE))


@pytest.mark.parametrize("fmt", ["flac", "wav", "pcm"])
def test_lossless_formats_hold_the_resampled_samples(fmt):
    audio = sine(22050)
    resampler = Resampler(22050)
    expected = np.concatenate([resampler.feed(audio), resampler.finish()])
    decoded, _, _ = decode(fmt, b"".join(stream(fmt, audio, 22050)))
    np.testing.assert_allclose(decoded, expected, atol=1.01 / 32767)


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "pcm", "wav"])
def test_a_stream_gives_bytes_before_it_finishes(fmt):
    pieces = stream(fmt, sine(22050, seconds=2.0), 22050)
    early = sum(len(piece) for piece in pieces[:-1])
    assert early > 0.5 * len(b"".join(pieces)), f"{fmt}: {early} of {len(b''.join(pieces))} bytes before finish()"
    # the first second alone is enough for the client to have been sent audio
    assert sum(len(piece) for piece in pieces[:10]) > 1000


@pytest.mark.parametrize("fmt", FORMATS)
def test_nothing_fed_still_makes_a_file(fmt):
    data = Encoder(fmt, 22050).finish()
    if fmt == "pcm":
        assert data == b""
        return
    decoded, rate, channels = decode(fmt, data)
    assert (rate, channels) == (OUTPUT_RATE, 1)
    assert decoded.size <= 2048 and not np.abs(decoded).max(initial=0) > 0.01


# --- what the bytes are ----------------------------------------------------------------------


def test_a_streamed_wav_says_its_sizes_are_unknown_and_a_whole_one_gives_them():
    streamed = b"".join(stream("wav", sine(24000), 24000))
    riff, riff_size, wave, fmt_id, fmt_size = struct.unpack("<4sI4s4sI", streamed[:20])
    codec, channels, rate, byte_rate, align, bits = struct.unpack("<HHIIHH", streamed[20:36])
    data_id, data_size = struct.unpack("<4sI", streamed[36:44])
    assert (riff, wave, fmt_id, fmt_size, data_id) == (b"RIFF", b"WAVE", b"fmt ", 16, b"data")
    assert (codec, channels, rate, byte_rate, align, bits) == (1, 1, 24000, 48000, 2, 16)
    assert riff_size == data_size == 0xFFFFFFFF
    assert len(streamed) == 44 + 2 * int(SECONDS * OUTPUT_RATE)

    whole = encode(sine(24000), 24000, "wav")
    assert whole[:36] == streamed[:4] + struct.pack("<I", len(whole) - 8) + streamed[8:36]
    assert struct.unpack("<4sI", whole[36:44]) == (b"data", len(whole) - 44)
    assert whole[44:] == streamed[44:]


def test_pcm_is_headerless_s16le_clipped_to_full_scale():
    audio = np.array([0.0, 0.25, -1.0, 1.0, 3.0, -3.0, np.nan], dtype=np.float32)
    data = encode(audio, 24000, "pcm")
    assert np.frombuffer(data, dtype="<i2").tolist() == [0, 8192, -32767, 32767, 32767, -32767, 0]


def test_a_streamed_mp3_starts_with_audio_not_lames_placeholder():
    # Whole, libsndfile fills the first frame with LAME's info ("Info" for CBR) at close;
    # streamed, that rewrite cannot reach the client, so the zeroed placeholder is left out.
    whole = encode(sine(24000), 24000, "mp3")
    assert b"Info" in whole[: formats.mp3_frame_size(whole[:4])]
    streamed = b"".join(stream("mp3", sine(24000), 24000))
    first = formats.mp3_frame_size(streamed[:4])
    assert first > 0 and any(streamed[4:first]) and b"Info" not in streamed[:first]
    assert len(whole) - len(streamed) == first  # the same stream but for that one frame


def test_mp3_without_cbr_support_in_soundfile_still_streams(monkeypatch):
    # soundfile < 0.13 has no bitrate_mode: libsndfile's default (VBR) is used instead.
    real = soundfile.SoundFile

    def old_soundfile(*args, **kwargs):
        if "bitrate_mode" in kwargs or "compression_level" in kwargs:
            raise TypeError("__init__() got an unexpected keyword argument 'bitrate_mode'")
        return real(*args, **kwargs)

    monkeypatch.setattr(soundfile, "SoundFile", old_soundfile)
    pieces = stream("mp3", sine(24000), 24000)
    assert sum(map(len, pieces[:-1])) > 0
    decoded, rate, _ = decode("mp3", b"".join(pieces))
    assert rate == OUTPUT_RATE
    assert_is_the_tone("mp3", decoded, int(SECONDS * OUTPUT_RATE))


def test_content_types():
    assert set(CONTENT_TYPES) == set(FORMATS)
    for fmt in FORMATS:
        assert Encoder(fmt, 24000).content_type == CONTENT_TYPES[fmt]
    assert CONTENT_TYPES["mp3"] == "audio/mpeg" and CONTENT_TYPES["pcm"] == "audio/pcm"


# --- refusals --------------------------------------------------------------------------------


def test_every_format_is_available_here():
    assert {fmt: available(fmt) for fmt in FORMATS} == {fmt: "" for fmt in FORMATS}


@pytest.mark.parametrize("fmt", ["ogg", "MP3", "", "m4a"])
def test_an_unknown_format_is_refused_with_the_list(fmt):
    for problem in (
        available(fmt),
        _raised(lambda: Encoder(fmt, 24000)),
        _raised(lambda: encode(sine(24000), 24000, fmt)),
    ):
        assert problem and all(name in problem for name in FORMATS)
    with pytest.raises(ValueError) as raised:
        Encoder(fmt, 24000)
    assert not isinstance(raised.value, FormatUnavailable)


def _raised(call) -> str:
    with pytest.raises(ValueError) as raised:
        call()
    return str(raised.value)


def test_aac_without_pyav_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # import av now raises ImportError
    problem = available("aac")
    assert "pip install av" in problem and "mp3" in problem and "pcm" in problem
    with pytest.raises(FormatUnavailable, match="pip install av"):
        Encoder("aac", 24000)
    with pytest.raises(ValueError, match="pip install av"):
        encode(sine(24000), 24000, "aac")
    assert available("mp3") == "" and encode(sine(24000), 24000, "mp3")


def test_encoder_input_checks():
    encoder = Encoder("pcm", 24000)
    assert encoder.feed(np.full((3, 1), 0.5, dtype=np.float64)) == np.full(3, 16384, dtype="<i2").tobytes()
    with pytest.raises(ValueError, match="mono"):
        encoder.feed(np.zeros((10, 2), dtype=np.float32))
    encoder.finish()
    with pytest.raises(RuntimeError):
        encoder.feed(np.zeros(10, dtype=np.float32))


# --- resampler -------------------------------------------------------------------------------


@pytest.mark.parametrize("source", [16000, 22050, 44100, 48000])
def test_resampling_in_pieces_is_resampling_whole(source):
    audio = np.random.default_rng(source).uniform(-1, 1, source // 2).astype(np.float32)
    whole = Resampler(source)
    expected = np.concatenate([whole.feed(audio), whole.finish()])
    assert expected.size == -(-audio.size * OUTPUT_RATE // source)

    pieces = Resampler(source)
    cuts = np.sort(np.random.default_rng(1).integers(0, audio.size, 40))
    bounds = [0, 0, 1, *cuts.tolist(), audio.size, audio.size]  # empty and one-sample pieces too
    out = [pieces.feed(audio[a:b]) for a, b in zip(bounds, bounds[1:])] + [pieces.finish()]
    assert all(part.dtype == np.float32 for part in out)
    np.testing.assert_allclose(np.concatenate(out), expected, atol=1e-5)


@pytest.mark.parametrize("source", [16000, 22050])
def test_resampling_interpolates_the_signal(source):
    low = sine(source, seconds=0.5, freq=100.0)
    resampler = Resampler(source)
    out = np.concatenate([resampler.feed(low), resampler.finish()])
    exact = sine(OUTPUT_RATE, seconds=0.5, freq=100.0)
    assert out.size == exact.size
    np.testing.assert_allclose(out[:-1], exact[:-1], atol=2e-3)  # (the last has no right neighbour)


def test_resampling_at_the_same_rate_changes_nothing():
    audio = np.random.default_rng(0).uniform(-1, 1, 1000).astype(np.float32)
    resampler = Resampler(24000, 24000)
    out = resampler.feed(audio)
    assert out.dtype == np.float32 and np.array_equal(out, audio)
    assert resampler.finish().size == 0
    assert np.array_equal(Resampler(24000).feed(audio.astype(np.float64)), audio)


def test_resampler_refuses_a_rate_of_zero():
    with pytest.raises(ValueError):
        Resampler(0)


def test_a_streaming_sink_never_changes_bytes_once_written():
    # (how an mp3's info frame, rewritten at close over bytes already sent, is kept out)
    for streaming, expected in ((True, b"abcdefg"), (False, b"XYZdefg")):
        sink = formats._Sink(streaming)
        sink.write(b"abcd")
        sink.seek(0)
        sink.write(b"XYZ")
        assert sink.tell() == 3
        sink.seek(2)
        sink.write(b"Zdef")  # over the end: the new part is kept either way
        sink.seek(0, 2)
        sink.write(b"g")
        assert sink.take(final=True) == expected
