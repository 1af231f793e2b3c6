"""The README and docs/: short README, CI's test command in place, every relative link resolves,
and every measurement row says where and when it was taken."""

from __future__ import annotations

import csv
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
README_MAX_LINES = 150
CSV_COLUMNS = ["topic", "measurement", "jaxserve", "compared_with", "commit", "commit_date",
               "machine", "date", "runs", "note"]

def machines() -> set[str]:
    """The machines performance.md's table names (a row each: | `name` | what it is |)."""
    text = (ROOT / "docs" / "performance.md").read_text()
    table = text[text.index("| machine | |"):]
    return set(re.findall(r"^\| `([^`]+)` \|", table, re.M))


FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INDENTED = re.compile(r"^(?: {4}|\t).*$", re.M)
CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The text without code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("", INDENTED.sub("", FENCE.sub("", text)))


def anchors(path: Path) -> set[str]:
    """GitHub's anchor for each heading: lowercased, punctuation but - and _ dropped, spaces to
    hyphens; a repeated one gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
        slug = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I)]  # http:, mailto:, ...


def test_docs_exist():
    names = {p.name for p in DOCS}
    assert {"architecture.md", "performance.md", "serving.md", "gpu.md"} <= names


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_readme_keeps_the_test_command_for_ci():
    text = (ROOT / "README.md").read_text()
    after = text.split("<!-- test-command -->", 1)
    assert len(after) == 2, "README.md lost its <!-- test-command --> marker (.ci/run reads it)"
    block = re.match(r"\s*```sh\n(.+?)\n```", after[1], re.S)
    assert block and "pytest" in block.group(1)


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in relative_links(page):
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve()
              for t in relative_links(ROOT / "README.md") if t.partition("#")[0]}
    assert not [p.name for p in DOCS if p.resolve() not in linked]


def test_measurements_say_where_and_when():
    with open(ROOT / "docs" / "performance.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == CSV_COLUMNS
    known = machines()
    assert {"epyc-avx2", "h200", "not recorded"} <= known
    for i, row in enumerate(rows[1:], start=2):
        assert len(row) == len(CSV_COLUMNS), f"performance.csv line {i}: {len(row)} fields"
        r = dict(zip(CSV_COLUMNS, row, strict=True))
        assert r["measurement"] and r["jaxserve"], f"performance.csv line {i}: no figure"
        assert r["commit"] and r["date"], f"performance.csv line {i}: say 'not recorded'"
        assert r["machine"] in known, f"performance.csv line {i}: machine {r['machine']!r}"


def test_the_checks_notice_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A `code` title\n\n[ok](#a-code-title) [bad](#nope) [gone](missing.md)\n"
                    "`[not a link](nowhere.md)`\n\n```\n[nor](this.md)\n```\n")
    assert anchors(page) == {"a-code-title"}
    assert relative_links(page) == ["#a-code-title", "#nope", "missing.md"]
