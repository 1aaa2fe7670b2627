"""`up --foreground`'s log relay: every program's lines on stdout, once, whole, named."""

from __future__ import annotations

from cosyvoice_lb.launcher.cluster.log_relay import MAX_LINE, LogRelay, RelayThread


def relay_into(logs, pod=""):
    out: list[bytes] = []
    return LogRelay(logs, out.append, pod), out


def lines(out):
    return b"".join(out).decode().splitlines()


def test_old_lines_stay_behind_and_new_ones_go_out_named(tmp_path):
    (tmp_path / "instance-0.log").write_text("from the last run\n")
    relay, out = relay_into(tmp_path, pod="cvlb-7d9-x2")
    assert relay.step() == 0  # what was there before the start is a previous run's
    with open(tmp_path / "instance-0.log", "a") as log:
        log.write("request api /v1/tts 200 ok in 0.1s rid=abc\n")
    (tmp_path / "nginx-access.log").write_text('127.0.0.1 "POST /v1/tts" 200 rid=abc\n')  # a log made later: whole
    assert relay.step() == 2
    assert lines(out) == [
        "[cvlb-7d9-x2] instance-0 | request api /v1/tts 200 ok in 0.1s rid=abc",
        '[cvlb-7d9-x2] nginx-access | 127.0.0.1 "POST /v1/tts" 200 rid=abc',
    ]
    assert relay.step() == 0  # each line once


def test_a_line_goes_out_once_it_is_ended(tmp_path):
    relay, out = relay_into(tmp_path)
    relay.step()
    log = tmp_path / "health.log"
    with open(log, "a") as handle:
        handle.write("instance-1: out of rot")
        handle.flush()
        assert relay.step() == 0
        handle.write("ation\n")
    assert relay.step() == 1 and lines(out) == ["health | instance-1: out of rotation"]


def test_a_rotated_log_is_read_to_its_end_then_the_new_one_from_its_start(tmp_path):
    log = tmp_path / "instance-0.log"
    log.write_text("")
    relay, out = relay_into(tmp_path)
    relay.step()
    with open(log, "a") as handle:
        handle.write("before\nlast of the old file\n")
    log.rename(tmp_path / "instance-0.log.1")  # what supervisord does at logfile_maxbytes
    log.write_text("first of the new file\n")
    relay.step()
    assert lines(out) == [
        "instance-0 | before",
        "instance-0 | last of the old file",
        "instance-0 | first of the new file",
    ]
    assert not any("instance-0.log.1" in line for line in lines(out))  # backups are not followed


def test_an_endless_line_goes_out_in_bounded_pieces(tmp_path):
    relay, out = relay_into(tmp_path)
    relay.step()
    (tmp_path / "nginx-error.log").write_bytes(b"x" * (2 * MAX_LINE + 10))
    assert relay.step() == 2 and all(len(line) == len("nginx-error | ") + MAX_LINE for line in lines(out))


def test_the_thread_relays_the_last_lines_when_it_stops(tmp_path):
    out: list[bytes] = []
    thread = RelayThread(tmp_path, pod="", write=out.append, poll=3600.0).start()
    (tmp_path / "supervisord.log").write_text("exited: instance-0 (exit status 0; expected)\n")
    thread.stop()  # the drain's last lines, written after the thread's last look
    assert lines(out) == ["supervisord | exited: instance-0 (exit status 0; expected)"]
    assert not thread.thread.is_alive()
