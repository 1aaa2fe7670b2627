"""Gradio's file routes kept to prompt audio: what counts as audio, multipart parts, and the
temp dir spelled as a marker out and back in."""

from __future__ import annotations

import io

import numpy as np
import soundfile

from cosyvoice_lb.instance.ui.uploads import GradioFiles, file_parts, is_audio, is_text


def encoded(fmt: str) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(1600, dtype=np.float32), 16000, format=fmt)
    return buffer.getvalue()


def test_audio_containers_are_audio_and_scripts_are_not():
    for fmt in ("WAV", "FLAC", "OGG", "AIFF"):
        assert is_audio(encoded(fmt)[:16]), fmt
    assert is_audio(b"ID3\x04" + b"\0" * 12) and is_audio(b"\x1aE\xdf\xa3" + b"\0" * 12)
    assert is_audio(b"\0\0\0\x20ftypM4A ")
    for other in (b"#!/bin/sh\necho hi\n", b"", b"RIFF\0\0\0\0AVI LIST", b"<html>", b"PK\x03\x04"):
        assert not is_audio(other[:16]), other


def test_file_parts_names_each_file_and_its_first_bytes():
    body = (
        b'--zz\r\nContent-Disposition: form-data; name="files"; filename="a.wav"\r\n\r\n'
        b'RIFF1234WAVEfmt more\r\n--zz\r\nContent-Disposition: form-data; name="x"\r\n\r\nv\r\n--zz--\r\n'
    )
    assert file_parts(body, "multipart/form-data; boundary=zz") == [("a.wav", b"RIFF1234WAVEfmt ")]
    assert file_parts(body, "text/plain") is None


def test_the_temp_dir_goes_out_as_a_marker_and_comes_back_in_file_references_only(tmp_path):
    files = GradioFiles(None, str(tmp_path), 2**20, uploads=True)  # type: ignore[arg-type]
    inside = f"{tmp_path}/abc/speech.wav"
    out = files.outward(f'{{"path": "{inside}", "url": "http://h/gradio_api/file={inside}"}}'.encode())
    assert str(tmp_path).encode() not in out and files.marker.encode() in out
    assert files.inward(out) == f'{{"path": "{inside}", "url": "http://h/gradio_api/file={inside}"}}'.encode()
    typed = f'{{"data": ["say {files.marker}abc"]}}'.encode()  # a user's text is left as typed
    assert files.inward(typed) == typed


def test_a_txt_is_text_by_its_name_and_first_bytes():
    assert is_text("chapter.TXT", "第一章".encode()[:7])  # a character cut at the end is fine
    assert not is_text("chapter.txt", b"\xff\xfe\x00t\x00e")  # UTF-16: not UTF-8, has NULs
    assert not is_text("chapter.txt", b"\x00\x01\x02")
    assert not is_text("chapter.md", b"plain words")


def test_which_files_a_ui_takes_follows_its_inputs(tmp_path):
    both = GradioFiles(None, str(tmp_path), 2**20, uploads=True, texts=1024)  # type: ignore[arg-type]
    assert both.refusal_of("a.wav", encoded("WAV")[:16], 2000) is None
    assert both.refusal_of("a.txt", b"words", 2000) is None
    status, message = both.refusal_of("a.txt", b"words", 1024 + 2**17)  # type: ignore[misc]
    assert status == 413 and "split it into several jobs" in message
    status, message = both.refusal_of("a.sh", b"#!/bin/sh", 10)  # type: ignore[misc]
    assert status == 415 and "WAV" in message and "UTF-8 .txt" in message
    audio_only = GradioFiles(None, str(tmp_path), 2**20, uploads=True)  # type: ignore[arg-type]
    status, message = audio_only.refusal_of("a.txt", b"words", 10)  # type: ignore[misc]
    assert status == 415 and "UTF-8" not in message
    texts_only = GradioFiles(None, str(tmp_path), 2**20, uploads=False, texts=1024)  # type: ignore[arg-type]
    assert texts_only.refusal_of("a.wav", encoded("WAV")[:16], 2000)[0] == 415  # type: ignore[index]
