"""Who may fetch a file from Gradio's folder: the rule, and its records on disk (a clock
scripted by the test), read back by a second reader as a restarted instance would."""

from __future__ import annotations

import asyncio
import json
import os
import stat

from cosyvoice_lb.instance.ui.owners import ANONYMOUS, PUBLIC, RECORDS, FileOwners, expired, key_of, may_serve
from cosyvoice_lb.instance.ui.uploads import GradioFiles

HOUR = 3600.0


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_an_upload_is_its_senders_for_its_time_a_result_anyones_and_the_rest_nobodys():
    alice, bob = key_of("alice-cookie"), key_of("bob-cookie")
    assert alice != bob and "alice" not in alice and key_of("") == ANONYMOUS
    upload = {alice: 100.0}
    assert may_serve(upload, "alice-cookie", 100.0 + HOUR - 1, HOUR)
    assert not may_serve(upload, "alice-cookie", 100.0 + HOUR, HOUR)  # expired: nobody's
    assert not may_serve(upload, "bob-cookie", 101.0, HOUR)
    assert not may_serve(upload, "", 101.0, HOUR)  # no cookie: no session
    assert not may_serve({ANONYMOUS: 100.0}, "", 101.0, HOUR)  # sent without a cookie: nobody's
    assert may_serve({alice: 100.0, bob: 200.0}, "bob-cookie", 250.0, HOUR)  # the same file, sent by both
    assert not may_serve({alice: 100.0, PUBLIC: 50.0}, "bob-cookie", 101.0, HOUR)  # an upload stays one
    assert may_serve({PUBLIC: 50.0}, "", 50.0 + 10 * HOUR, HOUR)  # a result: no expiry, no cookie needed
    assert not may_serve({}, "alice-cookie", 0.0, HOUR)  # no record: fails closed
    assert not may_serve(upload, "alice-cookie", 99.0, HOUR)  # granted in the future: a clock gone back
    assert expired({alice: 0.0, bob: HOUR}, 2 * HOUR, HOUR) and not expired({alice: 0.0, bob: HOUR}, HOUR + 1, HOUR)
    assert not expired({PUBLIC: 0.0}, 100 * HOUR, HOUR) and not expired({}, 100 * HOUR, HOUR)


def test_records_outlive_the_reader_and_hold_no_cookie(tmp_path):
    clock = Clock()
    upload = tmp_path / "abc123" / "voice.wav"
    result = tmp_path / "def456" / "speech.wav"
    for path in (upload, result):
        path.parent.mkdir()
        path.write_bytes(b"RIFF")
    first = FileOwners(str(tmp_path), kept=HOUR, clock=clock)
    first.grant(str(upload), "alice-cookie")
    first.publish(str(result))
    first.publish(str(upload))  # an answer naming an upload does not make it anyone's
    again = FileOwners(str(tmp_path), kept=HOUR, clock=clock)  # the instance, restarted
    assert again.serves(str(upload), "alice-cookie") and not again.serves(str(upload), "bob-cookie")
    assert again.serves(str(result), "bob-cookie") and again.serves(str(result), "")
    record = tmp_path / RECORDS / "abc123" / "voice.wav" / key_of("alice-cookie")
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / RECORDS).stat().st_mode) == 0o700
    assert not any("alice-cookie" in p.read_text() + p.name for p in (tmp_path / RECORDS).rglob("*") if p.is_file())
    clock.now += HOUR
    assert not again.serves(str(upload), "alice-cookie")  # expired: a 404 for everyone


def test_what_has_no_record_or_is_not_a_file_of_the_folder_is_served_to_nobody(tmp_path):
    owners = FileOwners(str(tmp_path), kept=HOUR, clock=Clock())
    old = tmp_path / "0ld" / "voice.wav"  # an upload from before records were kept
    old.parent.mkdir()
    old.write_bytes(b"RIFF")
    assert not owners.serves(str(old), "alice-cookie") and not owners.serves(str(old), "")
    owners.grant(str(tmp_path / "gone" / "x.wav"), "alice-cookie")
    assert not owners.serves(str(tmp_path / "gone" / "x.wav"), "alice-cookie")  # a record, no file
    owners.grant(str(old), "alice-cookie")
    record = next((tmp_path / RECORDS).rglob(key_of("alice-cookie")))
    assert not owners.serves(str(record), "alice-cookie")  # the records themselves
    assert owners.relative(str(tmp_path / RECORDS / "0ld")) is None and owners.relative("/etc/passwd") is None
    link = tmp_path / "0ld" / "link.wav"
    link.symlink_to("/etc/passwd")
    assert owners.relative(str(link)) is None  # resolved before the check
    owners.publish("/etc/passwd")
    owners.publish(str(tmp_path / "nothing-here.wav"))
    assert not list((tmp_path / RECORDS).glob("nothing-here.wav"))


def test_the_sweep_removes_expired_uploads_and_the_records_of_gone_files(tmp_path):
    clock = Clock()
    owners = FileOwners(str(tmp_path), kept=HOUR, clock=clock)
    files = {}
    for name in ("old", "fresh", "result", "deleted"):
        files[name] = tmp_path / f"dir-{name}" / f"{name}.wav"
        files[name].parent.mkdir()
        files[name].write_bytes(b"RIFF")
    owners.grant(str(files["old"]), "alice-cookie")
    owners.grant(str(files["deleted"]), "alice-cookie")
    owners.publish(str(files["result"]))
    clock.now += HOUR - 10
    owners.grant(str(files["fresh"]), "bob-cookie")
    files["deleted"].unlink()  # (Gradio's own clean-up took it)
    clock.now += 20
    assert owners.sweep() == 1
    assert not files["old"].exists() and not files["old"].parent.exists()
    assert files["fresh"].exists() and files["result"].exists()
    left = sorted(str(p.relative_to(tmp_path / RECORDS)) for p in (tmp_path / RECORDS).rglob("*"))
    assert left == [
        "dir-fresh",
        "dir-fresh/fresh.wav",
        f"dir-fresh/fresh.wav/{key_of('bob-cookie')}",
        "dir-result",
        "dir-result/result.wav",
        "dir-result/result.wav/public",
    ]
    assert owners.serves(str(files["fresh"]), "bob-cookie") and owners.serves(str(files["result"]), "")


def asgi_call(app, path: str, cookie: str = "", method: str = "GET", body: bytes = b"", headers=()):
    """One request through an ASGI app in this process: (status, body)."""
    sent: list[dict] = []
    raw = [(b"cookie", f"cvlb_route={cookie}".encode())] if cookie else []
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b""}
    scope["headers"] = raw + list(headers)

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_the_file_route_follows_the_records_across_a_restart(tmp_path):
    """The middleware in front of a stand-in for Gradio (which writes the upload, answers its
    path and serves any file asked for): the records decide, and a new middleware (a restarted
    instance) reads the same ones."""
    folder = tmp_path / "gradio"
    upload, result = folder / "abc" / "voice.wav", folder / "def" / "speech.wav"

    async def gradio(scope, receive, send):
        kind = b"x/y"
        if scope["path"].endswith("/upload"):
            upload.parent.mkdir(parents=True, exist_ok=True)
            upload.write_bytes(b"RIFF\0\0\0\0WAVEfmt ")
            data = json.dumps([str(upload)]).encode()
        elif scope["path"].endswith("/run/generate"):  # a result, and the prompt it was made from
            result.parent.mkdir(parents=True, exist_ok=True)
            result.write_bytes(b"RIFF result")
            data, kind = (
                json.dumps({"data": [{"path": str(result)}, {"path": str(upload)}]}).encode(),
                b"application/json",
            )
        else:
            data = open(scope["path"].split("/file=", 1)[1], "rb").read()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]})
        await send({"type": "http.response.body", "body": data})

    kept: set[str] = set()
    clock = Clock()
    first = GradioFiles(
        gradio, str(folder), 2**20, uploads=True, keep=kept, owners=FileOwners(str(folder), clock=clock)
    )
    body = b'--zz\r\nContent-Disposition: form-data; name="files"; filename="voice.wav"\r\n\r\nRIFF\0\0\0\0WAVEfmt \r\n--zz--\r\n'
    status, answer = asgi_call(
        first, "/gradio_api/upload", "alice", "POST", body, [(b"content-type", b"multipart/form-data; boundary=zz")]
    )
    assert status == 200 and json.loads(answer) == ["files/abc/voice.wav"] and str(upload) in kept
    restarted = GradioFiles(gradio, str(folder), 2**20, uploads=True, owners=FileOwners(str(folder), clock=clock))
    url = "/gradio_api/file=files/abc/voice.wav"
    assert asgi_call(restarted, url, "alice") == (200, upload.read_bytes())
    for who in ("bob", ""):
        status, refused = asgi_call(restarted, url, who)
        assert status == 404 and "only to the browser that sent it" in json.loads(refused)["error"]["message"]
    assert asgi_call(restarted, "/gradio_api/file=files/abc/other.wav", "alice")[0] == 404  # unknown
    assert asgi_call(restarted, "/gradio_api/file=" + str(upload), "bob")[0] == 404  # its full path: the same
    assert asgi_call(restarted, "/gradio_api/file=files/def/speech.wav", "bob")[0] == 404  # not made yet
    status, made = asgi_call(restarted, "/gradio_api/run/generate", "alice", "POST", b"{}")
    assert status == 200 and str(folder) not in made.decode() and "files/def/speech.wav" in made.decode()
    for who in ("bob", ""):  # a result, once an answer named it: whoever has its link
        assert asgi_call(restarted, "/gradio_api/file=files/def/speech.wav", who) == (200, b"RIFF result")
    assert asgi_call(restarted, url, "bob")[0] == 404  # the answer named the upload too: still alice's
    clock.now += 3600
    assert asgi_call(restarted, url, "alice")[0] == 404  # expired
    GradioFiles(gradio, str(folder), 2**20, uploads=True, owners=FileOwners(str(folder), clock=clock))
    assert not upload.exists() and result.exists()  # swept when the next instance starts; results stay
    assert sorted(os.listdir(folder / RECORDS)) == ["def"]


def test_a_running_instance_sweeps_expired_uploads_as_new_ones_come(tmp_path):
    folder, clock, count = tmp_path / "gradio", Clock(), [0]

    async def gradio(scope, receive, send):  # each upload a new file, as Gradio names them
        count[0] += 1
        path = folder / f"d{count[0]}" / "voice.wav"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"RIFF\0\0\0\0WAVEfmt ")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"x/y")]})
        await send({"type": "http.response.body", "body": json.dumps([str(path)]).encode()})

    kept: set[str] = set()
    files = GradioFiles(
        gradio, str(folder), 2**20, uploads=True, keep=kept, owners=FileOwners(str(folder), clock=clock)
    )
    body = b'--zz\r\nContent-Disposition: form-data; name="files"; filename="v.wav"\r\n\r\nRIFF\0\0\0\0WAVEfmt \r\n--zz--\r\n'
    form = [(b"content-type", b"multipart/form-data; boundary=zz")]
    assert asgi_call(files, "/gradio_api/upload", "alice", "POST", body, form)[0] == 200
    clock.now += 3600
    assert asgi_call(files, "/gradio_api/upload", "alice", "POST", body, form)[0] == 200
    assert not (folder / "d1").exists() and (folder / "d2" / "voice.wav").exists()
    assert str(folder / "d2" / "voice.wav") in kept and not [p for p in kept if "/d1/" in p]  # gone: forgotten


def test_only_a_file_made_since_the_instance_started_becomes_a_result(tmp_path):
    (tmp_path / "old").mkdir()
    old = tmp_path / "old" / "voice.wav"  # an upload from before records were kept
    old.write_bytes(b"RIFF")
    os.utime(old, (1.0, 1.0))
    owners = FileOwners(str(tmp_path), kept=HOUR)
    owners.publish(str(old))  # named in an answer (an error message, say): still nobody's
    owners.publish(str(tmp_path / "old"))  # a directory is no result either
    assert not owners.serves(str(old), "") and not (tmp_path / RECORDS).exists()
    new = tmp_path / "new" / "speech.wav"
    new.parent.mkdir()
    new.write_bytes(b"RIFF")
    owners.publish(str(new))
    assert owners.serves(str(new), "")
