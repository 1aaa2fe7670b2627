"""The house rules a newcomer can rely on, over the whole package: no module past 500 lines,
no function past cyclomatic complexity 30 (radon's measure), and unit tests in folders that
mirror the package's, with unique names. A module that grows past them
has grown a second job: split it, as docs/architecture.md's layout does."""

from __future__ import annotations

from pathlib import Path

from radon.complexity import cc_visit

import cosyvoice_lb

PACKAGE = Path(cosyvoice_lb.__file__).resolve().parent
MAX_LINES = 500
MAX_COMPLEXITY = 30
SOURCES = {
    path.relative_to(PACKAGE.parent).as_posix(): path.read_text(encoding="utf-8")
    for path in sorted(PACKAGE.rglob("*.py"))
}


def too_long(sources: dict[str, str]) -> list[str]:
    return [
        f"{name}: {len(text.splitlines())} lines"
        for name, text in sources.items()
        if len(text.splitlines()) > MAX_LINES
    ]


def too_complex(sources: dict[str, str]) -> list[str]:
    return [
        f"{name}:{block.lineno} {block.fullname}: complexity {block.complexity}"
        for name, text in sources.items()
        for block in cc_visit(text)
        if block.complexity > MAX_COMPLEXITY
    ]


def test_no_module_is_past_500_lines():
    assert too_long(SOURCES) == []


def test_no_function_is_past_complexity_30():
    assert too_complex(SOURCES) == []


def test_the_rules_see_what_they_look_for():
    branches = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(MAX_COMPLEXITY))
    crowded = {"long.py": "x = 1\n" * (MAX_LINES + 1), "branchy.py": f"def f(x):\n{branches}    return -1\n"}
    assert too_long(crowded) == ["long.py: 501 lines"]
    assert too_complex(crowded) == ["branchy.py:1 f: complexity 31"]


TESTS = Path(__file__).resolve().parent
APART = {"integration", "bench", "upstream", "fake_cosyvoice", "fake_models", "monitoring", "__pycache__"}


def misplaced(test_files: list[str], package_dirs: set[str]) -> list[str]:
    """Test files (paths relative to tests/) outside a folder that mirrors the package's, and
    basenames used twice (pytest's default import mode needs them unique)."""
    found = []
    seen: dict[str, str] = {}
    for path in sorted(test_files):
        folder, _, name = path.rpartition("/")
        if name in seen:
            found.append(f"{path}: the same name as {seen[name]}")
        seen[name] = path
        if folder and folder.split("/")[0] not in APART and folder not in package_dirs:
            found.append(f"{path}: tests/{folder} mirrors no cosyvoice_lb/{folder}")
    return found


def test_the_tests_mirror_the_package_and_their_names_are_unique():
    files = [p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py")]
    dirs = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    assert misplaced(files, dirs) == []


def test_the_mirror_check_sees_a_stray_folder_and_a_name_twice():
    files = ["launcher/plan/test_planner.py", "launcher/plans/test_x.py", "jobs/test_x.py", "integration/test_y.py"]
    assert misplaced(files, {"launcher", "launcher/plan", "jobs"}) == [
        "launcher/plans/test_x.py: the same name as jobs/test_x.py",
        "launcher/plans/test_x.py: tests/launcher/plans mirrors no cosyvoice_lb/launcher/plans",
    ]
