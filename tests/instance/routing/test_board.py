"""The routing board (cosyvoice_lb/instance/routing/board.py): a real shared file, written and read by
separate processes as the instances and the health loop do."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

from cosyvoice_lb.instance.routing.board import RING, ROWS, SIZE, Board, Opener
from cosyvoice_lb.instance.routing.rule import Backlog, request_key


def test_the_loop_makes_an_owner_only_board_and_keeps_a_live_one(tmp_path):
    path = tmp_path / "routing.board"
    board = Board.create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_size == SIZE
    assert board.work() == (False, 0.0)  # nothing routes by work until the loop says so
    board.configure(True, 0.25)
    board.publish(3, 4242, True, Backlog(10.0, True), 0.004)
    again = Board.create(path)  # a restarted loop: the instances' rows stay
    assert again.row(3)[:2] == (4242, Backlog(10.0, True)) and again.work() == (True, 0.25)
    inode = path.stat().st_ino
    path.write_bytes(b"not a board")
    assert Board.open(path) is None
    Board.create(path)  # replaced whole: a file that is no board
    assert Board.open(path) is not None and path.stat().st_ino != inode


def test_another_process_sees_the_rows_and_a_dead_one_is_no_peer(tmp_path):
    path = tmp_path / "routing.board"
    board = Board.create(path)
    board.configure(True, 0.05)
    board.set_rotation([0, 1, 2])
    # slot 1: this test's process; slot 2: a process that has exited
    board.publish(1, os.getpid(), True, Backlog(5.0, False), 0.004)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    board.publish(2, int(gone.stdout), True, Backlog(1.0, False), 0.004)
    board.mark_declined(1, request_key("seen"))
    script = textwrap.dedent(
        f"""
        from cosyvoice_lb.instance.routing.board import Board
        from cosyvoice_lb.instance.routing.rule import request_key
        board = Board.open({str(path)!r})
        print([(p.slot, p.load.until, p.declined) for p in board.peers(0, request_key("seen"))])
        print([(p.slot, p.declined) for p in board.peers(0, request_key("other"))])
        """
    )
    seen = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert seen == ["[(1, 5.0, True)]", "[(1, False)]"]


def test_only_ready_rows_in_rotation_are_peers_and_a_slot_never_sees_itself(tmp_path):
    board = Board.create(tmp_path / "routing.board")
    me = os.getpid()
    for slot in range(4):
        board.publish(slot, me, slot != 2, Backlog(float(slot), False), 0.001 * slot)  # slot 2: loading
    board.set_rotation([0, 1, 2])  # slot 3: a spare, ready but out of rotation
    assert board.rotation() == {0, 1, 2}
    assert [p.slot for p in board.peers(0, 1)] == [1]
    assert [p.slot for p in board.peers(1, 1)] == [0]
    assert board.rates(0) == [0.001, 0.002]  # (the rates of the others in rotation)
    board.set_rotation([1, 3])  # the health loop's next rotation replaces the last one
    assert [p.slot for p in board.peers(0, 1)] == [1, 3]


def test_the_ring_remembers_the_last_declines_only(tmp_path):
    board = Board.create(tmp_path / "routing.board")
    for i in range(RING + 1):
        board.mark_declined(0, request_key(f"r{i}"))
    assert not board.declined(0, request_key("r0"))  # overwritten by the newest
    assert all(board.declined(0, request_key(f"r{i}")) for i in range(1, RING + 1))


def test_slots_past_the_board_are_left_out_quietly(tmp_path):
    board = Board.create(tmp_path / "routing.board")
    board.publish(ROWS, os.getpid(), True, Backlog(1.0, False), 0.0)
    board.mark_declined(ROWS, 7)
    board.set_rotation([ROWS, 0])
    assert board.peers(5, 7) == []


def test_the_opener_finds_a_board_made_later_and_a_replaced_one(tmp_path):
    path = tmp_path / "routing.board"
    now = [0.0]
    opener = Opener(str(path), retry=1.0, clock=lambda: now[0])
    assert opener() is None  # not there yet
    Board.create(path).configure(True, 0.1)
    assert opener() is None  # looked again only after the retry interval
    now[0] = 1.0
    found = opener()
    assert found is not None and found.work() == (True, 0.1)
    path.unlink()
    Board.create(path).configure(False, 0.2)  # the loop made a new one
    now[0] = 2.0
    assert opener().work() == (False, 0.2)  # type: ignore[union-attr]
    assert found.work() == (True, 0.1)  # (the old map stays usable for whoever still holds it)
    assert Opener("")() is None  # an instance without a board (Kubernetes)


@pytest.mark.parametrize("garbage", [b"", b"CVLBRT01" + b"\0" * 10])
def test_a_short_or_foreign_file_is_no_board(tmp_path, garbage):
    path = tmp_path / "routing.board"
    path.write_bytes(garbage)
    assert Board.open(path) is None
