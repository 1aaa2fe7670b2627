"""The documentation holds together: every relative link resolves, the README stays short,
and every document under docs/ is in the README's index.

Quick and offline: links to other sites are not fetched, only links inside the checkout are
checked (the file, and for ``file.md#anchor`` a heading of that file with that anchor)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 250
INDEX_HEADING = "Documentation"  # the README's section that lists docs/


def documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md", ROOT / "tests" / "README.md"]


FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+).*?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:|^//")


def prose_lines(markdown: str) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(markdown.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: the text as rendered (a link's text, no code
    marks), lowercase, punctuation removed (letters, digits, '_' and '-' stay), each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(markdown):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(markdown: str) -> list[tuple[int, str]]:
    """(line number, target) of every link and image outside code."""
    return [
        (number, match.group(1))
        for number, line in prose_lines(markdown)
        for match in LINK.finditer(CODE_SPAN.sub("", line))
    ]


def broken_links(path: Path, markdown: str, root: Path = ROOT) -> list[str]:
    """What is wrong with the relative links of ``markdown`` (the text of ``path``), in words."""
    problems = []
    name = path.relative_to(root) if path.is_relative_to(root) else path
    for number, target in links(markdown):
        if SCHEME.match(target):
            continue  # another site, mailto: ...: not checked offline
        file_part, _, anchor = target.partition("#")
        where = f"{name}:{number}: link to {target!r}"
        if not file_part:  # a heading of this same text
            if anchor not in anchors(markdown):
                problems.append(f"{where}: {name} has no heading with the anchor #{anchor}")
            continue
        linked = (path.parent / file_part).resolve()
        if not linked.is_relative_to(root.resolve()):
            problems.append(f"{where} leaves the checkout")
            continue
        shown = linked.relative_to(root.resolve())
        if not linked.exists():
            problems.append(f"{where}: {shown} does not exist")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text(encoding="utf-8")):
            problems.append(f"{where}: {shown} has no heading with the anchor #{anchor}")
    return problems


def section(markdown: str, title: str) -> str:
    """The text under the level-2 heading ``title``, up to the next level-2 heading."""
    lines = markdown.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == f"## {title}"), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start + 1 : end])


# --- the documentation ------------------------------------------------------------------


def test_every_document_exists():
    missing = [str(p.relative_to(ROOT)) for p in documents() if not p.exists()]
    assert not missing, f"missing documents: {missing}"


def test_every_relative_link_resolves():
    problems = [
        problem
        for path in documents()
        if path.exists()
        for problem in broken_links(path, path.read_text(encoding="utf-8"))
    ]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move the details into docs/"
    )


def test_every_doc_is_in_the_readme_index():
    index = section(README.read_text(encoding="utf-8"), INDEX_HEADING)
    assert index, f"README.md has no '## {INDEX_HEADING}' section (the index of docs/)"
    listed = {(README.parent / target.partition("#")[0]).resolve() for _, target in links(index)}
    unlisted = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in listed]
    assert not unlisted, f"not in README.md's '## {INDEX_HEADING}' index: {unlisted}"


# --- the checker itself: it must find what is broken -------------------------------------


def test_the_checker_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Routing by work\n\n## Routing by work\n")
    (tmp_path / "docs" / "picture.png").write_bytes(b"")
    page = tmp_path / "README.md"
    text = "\n".join(
        [
            "# Title",
            "[fine](docs/guide.md) and [fine](docs/guide.md#routing-by-work) and [also](docs/guide.md#routing-by-work-1)",
            "![fine](docs/picture.png) [same page](#title) [site](https://example.org/missing.md)",
            "[gone](docs/missing.md)",
            "[no such heading](docs/guide.md#no-such-heading)",
            "[no such heading here](#nowhere)",
            "[outside](../elsewhere.md)",
            "`[in code](docs/missing-in-code.md)`",
            "```",
            "[in a fence](docs/missing-in-fence.md)",
            "```",
        ]
    )
    problems = broken_links(page, text, root=tmp_path)
    assert len(problems) == 4, problems
    assert "README.md:4: link to 'docs/missing.md': docs/missing.md does not exist" in problems
    assert any(p.startswith("README.md:5:") and "#no-such-heading" in p for p in problems)
    assert any(p.startswith("README.md:6:") and "#nowhere" in p for p in problems)
    assert any(p.startswith("README.md:7:") and "leaves the checkout" in p for p in problems)


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Security: who can reach what", "security-who-can-reach-what"),
        (
            "Capacity that never dips: surges, warm spares, elastic instances, CUDA MPS",
            "capacity-that-never-dips-surges-warm-spares-elastic-instances-cuda-mps",
        ),
        ("c. routing: 4 instances, 80 % short / 20 % long", "c-routing-4-instances-80--short--20--long"),
        ("What it buys: `bench/rollout.py`", "what-it-buys-benchrolloutpy"),
        ("The [API](api.md) in two examples", "the-api-in-two-examples"),
        ("`max_fails` and friends", "max_fails-and-friends"),
    ],
)
def test_anchors_are_githubs(heading, anchor):
    assert slug(heading) == anchor


def test_headings_in_code_are_not_anchors():
    assert anchors("# Real\n```sh\n# a shell comment\n```\n") == {"real"}
