"""The staged instance code is whole: every package module an instance imports is staged.

Instances run the copy staged into run/lib (in the user's CosyVoice environment, where this
package is not installed), so a module missing from ``resources.INSTANCE_MODULES`` is an
ImportError at the first start of every instance, which no test that imports from the
checkout sees."""

from __future__ import annotations

import ast
from pathlib import Path, PurePosixPath

import cosyvoice_lb
from cosyvoice_lb.launcher.render.staging import instance_files

CHECKOUT = Path(cosyvoice_lb.__file__).resolve().parent.parent


def is_module(path: PurePosixPath) -> bool:
    """A module of the package at ``path`` (relative to the tree, without suffix)."""
    return (CHECKOUT / f"{path}.py").is_file() or (CHECKOUT / path / "__init__.py").is_file()


def at_import(tree: ast.AST) -> list[ast.AST]:
    """The nodes run when the module is imported: not function bodies (an import there may
    be the launcher's own, e.g. the board's writer)."""
    nodes: list[ast.AST] = []
    for child in ast.iter_child_nodes(tree):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            nodes.append(child)
            nodes.extend(at_import(child))
    return nodes


def imported_modules(path: str, source: str) -> set[PurePosixPath]:
    """The package's modules ``source`` (at ``path`` in the staged tree) imports when it is
    imported."""
    here = PurePosixPath(path).parent
    found: set[PurePosixPath] = set()
    for node in at_import(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = here
            for _ in range(node.level - 1):
                base = base.parent
        elif (node.module or "").split(".")[0] == "cosyvoice_lb":
            base = PurePosixPath()
        else:
            continue
        module = base.joinpath(*node.module.split(".")) if node.module else base
        found.add(module)
        found.update(module / alias.name for alias in node.names if is_module(module / alias.name))
    return found


def test_every_package_module_an_instance_imports_is_staged():
    files = instance_files()
    staged = {PurePosixPath(name.removesuffix(".py")) for name in files}
    staged |= {name.parent for name in staged if name.name == "__init__"}
    missing = sorted(
        f"{path} imports {module}"
        for path, source in files.items()
        for module in imported_modules(path, source)
        if module not in staged
    )
    assert missing == [], "add them to resources.INSTANCE_MODULES: " + "; ".join(missing)


def test_the_check_sees_a_missing_module():
    files = {
        "cosyvoice_lb/server.py": "from .memory import release\nfrom . import engines\ndef f():\n    from .files import x\n"
    }
    assert imported_modules("cosyvoice_lb/server.py", files["cosyvoice_lb/server.py"]) == {
        PurePosixPath("cosyvoice_lb/memory"),
        PurePosixPath("cosyvoice_lb"),
        PurePosixPath("cosyvoice_lb/engines"),
    }
