"""The layout's rules, read from the source: which side may import what, and no circles.

- ``cosyvoice_lb.instance`` runs in the user's CosyVoice environment from a staged copy of
  itself and ``common``: it never imports the launcher, nor a library only the launcher has.
- ``cosyvoice_lb.common`` is imported by both sides: the standard library only.
- The launcher's folders stand on floors (:data:`FLOORS`, lowest first): a module imports
  its own folder and the floors below, never a floor above nor a folder beside it on its own
  floor. ``cosyvoice_lb.jobs`` runs in the launcher's environment (its own supervisord
  program) and stands on the launcher's floors too.
- No module imports itself back through others.

Every import counts, those inside functions too: an instance that reaches the launcher only
on a rare path fails there, in the user's environment, long after every test passed."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import cosyvoice_lb
from cosyvoice_lb.launcher.render.staging import stage

PACKAGE = Path(cosyvoice_lb.__file__).resolve().parent
LAUNCHER_ONLY = ("click", "jinja2", "supervisor", "rich", "yaml", "pynvml", "kubernetes", "redis")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, source: str, modules: set[str]) -> tuple[set[str], set[str]]:
    """(the package's modules, the other top-level names) that ``source`` imports anywhere."""
    is_package = name not in modules or any(m.startswith(name + ".") for m in modules)
    ours: set[str] = set()
    others: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "cosyvoice_lb":
                while target not in modules:  # (a name imported from a module: the module)
                    target = target.rpartition(".")[0]
                if target != name:
                    ours.add(target)
            elif target:
                others.add(target.split(".")[0])
    return ours - {"cosyvoice_lb"} if name != "cosyvoice_lb" else ours, others


def graph(sources: dict[str, str]) -> dict[str, tuple[set[str], set[str]]]:
    return {name: imports_of(name, source, set(sources)) for name, source in sources.items()}


GRAPH = graph({name: path.read_text(encoding="utf-8") for name, path in MODULES.items()})


def side(name: str) -> str:
    return name.split(".")[1] if name.count(".") else ""


def crossings(g: dict[str, tuple[set[str], set[str]]]) -> list[str]:
    """Every import that breaks the rules above, in words."""
    found = []
    for name, (ours, others) in sorted(g.items()):
        if side(name) not in ("instance", "common"):
            continue
        allowed = {"common"} if side(name) == "common" else {"common", "instance"}
        found += [f"{name} imports {m}" for m in sorted(ours) if side(m) not in allowed | {""}]
        found += [f"{name} imports {lib} (the launcher's)" for lib in sorted(others & set(LAUNCHER_ONLY))]
        if side(name) == "common":
            stdlib = sys.stdlib_module_names | {"__future__"}
            found += [f"{name} imports {lib} (not the standard library)" for lib in sorted(others - stdlib)]
    return found


# The launcher's floors, lowest first (docs/architecture.md#the-launchers-floors says why each
# stands where it does). Each name is a folder or a module at the launcher's top.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("launcher.errors", "launcher.compat"),
    ("launcher.state",),
    ("launcher.plan",),
    ("launcher.render",),
    ("launcher.health", "jobs", "launcher.k8s", "launcher.model", "launcher.service"),
    ("launcher.cluster",),
    ("launcher.canary",),
    ("launcher.panel",),
    ("launcher.commands", "launcher.options", "launcher.views", "launcher.cli", "launcher"),
)


def room(name: str) -> str | None:
    """The folder (or top module) of the launcher's floors ``name`` is in, or None (instance,
    common, the package's top)."""
    parts = name.split(".")[1:]
    if parts[:1] == ["jobs"]:
        return "jobs"
    if parts[:1] != ["launcher"]:
        return None
    return ".".join(parts[:2])


def floor_of(room_name: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if room_name in rooms)


def upward(g: dict[str, tuple[set[str], set[str]]]) -> list[str]:
    """Every import of the launcher (or jobs) that reaches a floor above or a folder beside
    (the top floor, the CLI's, is one room)."""
    found = []
    for name, (ours, _) in sorted(g.items()):
        here = room(name)
        if here is None:
            continue
        for target in sorted(ours):
            there = room(target)
            if there is None or there == here or there == "launcher":
                continue
            if floor_of(there) > floor_of(here) or (floor_of(there) == floor_of(here) < len(FLOORS) - 1):
                found.append(f"{name} (floor {floor_of(here)}) imports {target} (floor {floor_of(there)})")
    return found


def circles(g: dict[str, tuple[set[str], set[str]]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g[v][0] & g.keys()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_the_instance_and_common_never_import_the_launcher():
    assert crossings(GRAPH) == []


def test_every_launcher_folder_stands_on_one_floor():
    rooms = {room(name) for name in MODULES} - {None}
    placed = [r for floor in FLOORS for r in floor]
    assert sorted(rooms) == sorted(placed)
    assert len(placed) == len(set(placed))


def test_no_launcher_folder_imports_one_above_or_beside_it():
    assert upward(GRAPH) == []


def test_the_floors_check_sees_an_import_upward_and_sideways():
    g = graph(
        {
            "cosyvoice_lb": "",
            "cosyvoice_lb.jobs": "",
            "cosyvoice_lb.launcher": "",
            "cosyvoice_lb.launcher.state": "",
            "cosyvoice_lb.launcher.plan": "",
            "cosyvoice_lb.launcher.health": "",
            "cosyvoice_lb.launcher.state.layout": "from cosyvoice_lb.launcher.plan.planner import plan\n",
            "cosyvoice_lb.launcher.plan.planner": "from cosyvoice_lb.launcher.state.layout import Layout\n",
            "cosyvoice_lb.launcher.health.loop": "def f():\n    from cosyvoice_lb.jobs import runner\n",
            "cosyvoice_lb.jobs.runner": "from cosyvoice_lb.launcher import errors\n",
            "cosyvoice_lb.launcher.errors": "",
            "cosyvoice_lb.launcher.cli": "from cosyvoice_lb.launcher.health import loop\n",
        }
    )
    assert upward(g) == [
        "cosyvoice_lb.launcher.health.loop (floor 4) imports cosyvoice_lb.jobs (floor 4)",
        "cosyvoice_lb.launcher.health.loop (floor 4) imports cosyvoice_lb.jobs.runner (floor 4)",
        "cosyvoice_lb.launcher.state.layout (floor 1) imports cosyvoice_lb.launcher.plan.planner (floor 2)",
    ]


def test_no_module_imports_itself_back():
    assert circles(GRAPH) == []


def test_the_checks_see_what_they_look_for():
    g = graph(
        {
            "cosyvoice_lb": "",
            "cosyvoice_lb.common": "",
            "cosyvoice_lb.common.sizes": "import numpy\n",
            "cosyvoice_lb.instance": "",
            "cosyvoice_lb.instance.server": "def f():\n    from cosyvoice_lb.launcher.plan import planner\n    import rich\n",
            "cosyvoice_lb.instance.ui": "from .server import f\n",
            "cosyvoice_lb.launcher": "",
            "cosyvoice_lb.launcher.plan": "",
            "cosyvoice_lb.launcher.plan.planner": "from cosyvoice_lb.launcher.plan.gpu import x\n",
            "cosyvoice_lb.launcher.plan.gpu": "def g():\n    from . import planner\n",
        }
    )
    assert crossings(g) == [
        "cosyvoice_lb.common.sizes imports numpy (not the standard library)",
        "cosyvoice_lb.instance.server imports cosyvoice_lb.launcher.plan",
        "cosyvoice_lb.instance.server imports cosyvoice_lb.launcher.plan.planner",
        "cosyvoice_lb.instance.server imports rich (the launcher's)",
    ]
    assert g["cosyvoice_lb.instance.ui"][0] == {"cosyvoice_lb.instance.server"}
    assert circles(g) == [["cosyvoice_lb.launcher.plan.gpu", "cosyvoice_lb.launcher.plan.planner"]]


@pytest.mark.integration
def test_the_staged_tree_runs_without_the_launcher(tmp_path):
    """What staging copies is all an instance needs: its server imports from the staged tree
    alone (not this checkout), with the launcher's libraries made unimportable."""
    lib = tmp_path / "lib"
    digest, _ = stage(lib)
    probe = textwrap.dedent(
        f"""
        import importlib.abc, sys
        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {LAUNCHER_ONLY!r} or name.startswith("cosyvoice_lb.launcher"):
                    raise ImportError("the instance imported " + name)
        sys.meta_path.insert(0, Refuse())
        sys.path.insert(0, {str(lib)!r})
        import cosyvoice_lb.instance.server, cosyvoice_lb.instance.engines.espeak
        print(cosyvoice_lb.instance.server.__file__)
        print(cosyvoice_lb.instance.server.CODE)
        """
    )
    run = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    where, code = run.stdout.split()
    assert Path(where).resolve().is_relative_to(lib.resolve())
    assert code == digest  # what its /ping reports: the digest of the tree it runs
