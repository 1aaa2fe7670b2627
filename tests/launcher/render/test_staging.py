"""Staging the instance code: a whole new tree, then a symlink swap; old trees stay until pruned."""

from __future__ import annotations

import os

from cosyvoice_lb.launcher.render.staging import CODE_FILE, code_digest, instance_files, prune, stage, staged_digest

V1 = {"app.py": "print('one')\n", "cosyvoice_lb/server.py": "X = 1\n"}
V2 = {"app.py": "print('one')\n", "cosyvoice_lb/server.py": "X = 2\n"}


def test_the_digest_follows_the_content_only():
    assert code_digest(V1) == code_digest(dict(reversed(list(V1.items()))))
    assert code_digest(V1) != code_digest(V2)
    assert code_digest({"a": "bc"}) != code_digest({"ab": "c"})


def test_a_stage_is_a_complete_tree_behind_a_symlink(tmp_path):
    lib = tmp_path / "lib"
    digest, moved = stage(lib, V1)
    assert moved and os.readlink(lib) == f"lib-{digest}" and staged_digest(lib) == digest
    assert (lib / "cosyvoice_lb" / "server.py").read_text() == "X = 1\n"
    assert (lib / CODE_FILE).read_text() == digest + "\n"
    assert stage(lib, V1) == (digest, False)  # the same code: nothing moves


def test_new_code_swaps_the_link_and_keeps_the_old_tree_for_who_runs_it(tmp_path):
    lib = tmp_path / "lib"
    first, _ = stage(lib, V1)
    old_tree = (lib / "cosyvoice_lb").resolve()  # what a running instance imported from
    second, moved = stage(lib, V2)
    assert moved and second != first and (lib / "cosyvoice_lb" / "server.py").read_text() == "X = 2\n"
    assert (old_tree / "server.py").read_text() == "X = 1\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch left behind
    assert prune(lib, {first}) == []
    assert prune(lib, set()) == [first] and not old_tree.exists()
    assert staged_digest(lib) == second  # the staged tree is never pruned


def test_a_plain_dir_staged_by_an_older_version_is_replaced(tmp_path):
    lib = tmp_path / "lib"
    (lib / "cosyvoice_lb").mkdir(parents=True)
    (lib / "app.py").write_text("old\n")
    digest, moved = stage(lib, V1)
    assert moved and lib.is_symlink() and staged_digest(lib) == digest
    assert (tmp_path / "lib-unversioned" / "app.py").read_text() == "old\n"


def test_the_real_instance_code_stages(tmp_path):
    digest, _ = stage(tmp_path / "lib")
    assert digest == code_digest(instance_files())
    assert (tmp_path / "lib" / "cosyvoice_lb" / "instance" / "server.py").exists() and (
        tmp_path / "lib" / "app.py"
    ).exists()
