"""The saved-voice registry: whole or nothing on disk, one view for every reader."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import soundfile

from cosyvoice_lb.instance.speech.validation import BadRequest
from cosyvoice_lb.instance.speech.voices import MAX_VOICES, Registry, VoiceNotFound, check_consent

TONE = (0.3 * np.sin(np.linspace(0, 2000, 48000))).astype(np.float32)


def leftovers(root) -> list[str]:
    """Files under root but the (empty) dir of name claims."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != ".names")


def test_a_voice_round_trips_and_every_reader_sees_it(tmp_path):
    one, other = Registry(tmp_path / "voices", clock=lambda: 1700000000.5), Registry(tmp_path / "voices")
    voice = one.create("narrator", TONE, 16000, "the transcript", consent="yes")
    assert voice.id.startswith("voice_") and len(voice.id) == 30 and voice.created_at == 1700000000
    assert other.require(voice.id) == voice and other.require("narrator") == voice
    assert voice.public() == {
        "object": "audio.voice",
        "id": voice.id,
        "name": "narrator",
        "created_at": 1700000000,
        "prompt_text": "the transcript",
    }
    audio, rate = soundfile.read(other.audio_path(voice), dtype="float32")
    assert rate == 16000 and np.allclose(audio, TONE, atol=1e-4)
    # someone's voice: readable by the service's user only
    assert stat.S_IMODE(os.stat(tmp_path / "voices").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(other.audio_path(voice)).st_mode) == 0o600
    assert [v.id for v in other.all()] == [voice.id]


@pytest.mark.parametrize(
    "consent, words",
    [
        (None, '"consent" is missing'),
        ("", '"consent" is missing'),
        ("no", "\"consent\" is 'no', not yes"),
        ("maybe", "'maybe', not yes"),
        ("1", "'1', not yes"),
        (True, "'True', not yes"),  # a JSON true, not a form's text
    ],
)
def test_a_voice_is_saved_only_with_an_explicit_yes(tmp_path, consent, words):
    registry = Registry(tmp_path)
    with pytest.raises(BadRequest, match=words) as refused:
        registry.create("narrator", TONE, 16000, "text", consent=consent)
    assert refused.value.status == 400 and "send consent=yes" in str(refused.value)
    assert registry.all() == [] and leftovers(tmp_path) == []


@pytest.mark.parametrize("consent", ["yes", "YES", " Yes ", "true", "True"])
def test_yes_and_true_are_consent_stored_as_yes(tmp_path, consent):
    assert check_consent(consent) == "yes"
    voice = Registry(tmp_path).create("narrator", TONE, 16000, "text", consent=consent)
    assert Registry(tmp_path).require("narrator").consent == "yes" == voice.consent


def test_delete_makes_it_unknown_everywhere(tmp_path):
    one, other = Registry(tmp_path), Registry(tmp_path)
    voice = one.create("narrator", TONE, 16000, "text", consent="yes")
    assert other.delete("narrator") == voice
    with pytest.raises(VoiceNotFound, match="none saved yet"):
        one.require(voice.id)
    assert leftovers(tmp_path) == []  # nothing left behind, the name free again


def test_names_are_unique_checked_and_ids_are_not_names(tmp_path):
    registry = Registry(tmp_path)
    registry.create("narrator", TONE, 16000, "text", consent="yes")
    with pytest.raises(BadRequest, match="exists") as taken:
        registry.create(" narrator ", TONE, 16000, "text", consent="yes")
    assert taken.value.status == 409
    for bad in ("", "   ", "x" * 65, "tab\there", "voice_0123456789abcdef01234567", None):
        with pytest.raises(BadRequest):
            registry.create(bad, TONE, 16000, "text", consent="yes")  # type: ignore[arg-type]
    with pytest.raises(VoiceNotFound, match="narrator"):  # the message lists what is saved
        registry.require("nobody")


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    registry = Registry(tmp_path)

    def disk_full(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("cosyvoice_lb.instance.speech.voices.write_wav", disk_full)
    with pytest.raises(OSError, match="No space"):
        registry.create("narrator", TONE, 16000, "text", consent="yes")
    assert registry.all() == [] and leftovers(tmp_path) == []
    monkeypatch.undo()
    assert registry.create("narrator", TONE, 16000, "text", consent="yes").name == "narrator"  # the name was released


def test_the_registry_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr("cosyvoice_lb.instance.speech.voices.MAX_VOICES", 2)
    registry = Registry(tmp_path)
    registry.create("a", TONE, 16000, "text", consent="yes")
    registry.create("b", TONE, 16000, "text", consent="yes")
    with pytest.raises(BadRequest, match="holds 2 voices") as full:
        registry.create("c", TONE, 16000, "text", consent="yes")
    assert full.value.status == 409 and MAX_VOICES == 1000


def test_one_name_saved_at_once_from_many_instances_gives_one_voice(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    def save(_):
        try:
            return Registry(tmp_path).create("narrator", TONE, 16000, "text", consent="yes").id  # each its own reader
        except BadRequest as exc:
            return exc.status

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(save, range(8)))
    assert sorted(map(str, results))[:7] == ["409"] * 7 and len(Registry(tmp_path).all()) == 1


def test_an_abandoned_claim_is_taken_over(tmp_path):
    now = [1000.0]
    registry = Registry(tmp_path, clock=lambda: now[0])
    claim = registry.claim("narrator")  # an instance died while saving
    os.utime(claim, (1000.0, 1000.0))
    with pytest.raises(BadRequest, match="being saved right now"):
        registry.create("narrator", TONE, 16000, "text", consent="yes")
    now[0] += 61
    assert registry.create("narrator", TONE, 16000, "text", consent="yes").name == "narrator"


def test_a_borrowed_prompt_outlives_the_voice(tmp_path):
    registry = Registry(tmp_path / "voices")
    voice = registry.create("narrator", TONE, 16000, "text", consent="yes")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    path = registry.borrow(voice, str(scratch))
    registry.delete(voice.id)
    assert soundfile.read(path)[0].size == TONE.size  # a request using it still has its audio
    with pytest.raises(VoiceNotFound):
        registry.borrow(voice, str(scratch))
