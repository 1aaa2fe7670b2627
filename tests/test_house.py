"""The house rules a newcomer can rely on, over the whole package: no module past 500 lines,
no function past cyclomatic complexity 30 (radon's measure). A module that grows past them
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
