"""The README and docs/ link to what exists: every relative link in README.md and docs/*.md resolves to a file or
folder of the repository and, where it names an #anchor, to a heading of that page (GitHub's anchors)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def pages(root: Path = ROOT) -> list[Path]:
    """The README and every page of docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """The text without fenced code blocks: a link there is code, not a link."""
    return FENCE.sub("", text)


def anchors(text: str) -> set[str]:
    """GitHub's anchor of every heading: lower case, punctuation dropped, spaces as hyphens, -1, -2 on repeats."""
    seen: Counter[str] = Counter()
    found = set()
    for heading in HEADING.findall(_prose(text)):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """'page: target (why)' for each relative link of `page` that names no file, or no heading of its page."""
    broken = []
    for target in LINK.findall(CODE_SPAN.sub("", _prose(page.read_text()))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not a file of the repository
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(root)}: {target}"
        if not linked.exists():
            broken.append(f"{where} (no such file)")
        elif root not in linked.parents and linked != root:
            broken.append(f"{where} (outside the repository)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            broken.append(f"{where} (no heading with that anchor)")
    return broken


def test_the_check_finds_a_missing_file_a_missing_heading_and_a_link_outside(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## The `x` part, 2\n\n```\n[code](nowhere.md)\n```\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok](docs/a.md#the-x-part-2) [ok](#top) [web](https://example.org/x)\n"
        "[gone](docs/b.md) [no heading](docs/a.md#missing) [outside](../x.md) `[in code](nowhere.md)`\n\n# Top\n")
    (tmp_path.parent / "x.md").write_text("outside\n")
    found = [line for page in pages(tmp_path) for line in broken_links(page, tmp_path)]
    assert found == ["README.md: docs/b.md (no such file)", "README.md: docs/a.md#missing (no heading with that anchor)",
                     "README.md: ../x.md (outside the repository)"]


def test_every_relative_link_in_the_readme_and_docs_resolves():
    found = [line for page in pages() for line in broken_links(page)]
    assert not found, "\n".join(found)


def test_the_readme_links_every_page_of_docs():
    readme = (ROOT / "README.md").read_text()
    unlinked = [page.name for page in pages()[1:] if f"(docs/{page.name}" not in readme]
    assert not unlinked, f"README.md does not link {unlinked}"
