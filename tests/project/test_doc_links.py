"""Links between the documents resolve: every relative markdown link (and image) in README.md,
CHANGELOG.md, benchmarks/RESULTS.md and docs/*.md names a file that exists, and every ``#anchor``
names a heading of its target as GitHub renders it (its slug rules: lower case, punctuation other
than ``-`` and ``_`` dropped, spaces to ``-``, a repeated heading gets ``-1``, ``-2``, ...)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedgalore_testing import REPO


DOCS = ["README.md", "CHANGELOG.md", "benchmarks/RESULTS.md", *sorted(str(p.relative_to(REPO)) for p in REPO.glob("docs/*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (links there are not links)."""
    text = _FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    out = []
    for ch in text:
        if ch == " ":
            out.append("-")
        elif ch in "-_" or ch.isalnum():
            out.append(ch)
    return "".join(out)


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file's headings define, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out |= set(re.findall(r'<a\s+(?:name|id)="([^"]+)"', path.read_text()))
    return out


def links(doc: str) -> list[str]:
    return [m.group(1) for m in _LINK.finditer(_prose((REPO / doc).read_text()))]


def test_slug_follows_githubs_rules() -> None:
    assert slug("5.5 At 50 rounds: the verdict") == "55-at-50-rounds-the-verdict"
    assert slug("Per-site metrics (`evaluate --by COLUMN`)") == "per-site-metrics-evaluate---by-column"
    assert slug("The optimizer's cost") == "the-optimizers-cost"
    assert slug("FedGaLore⁻ at α 0.1 × 2") == "fedgalore-at-α-01--2"


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_and_anchors_resolve(doc: str) -> None:
    base = (REPO / doc).parent
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http(s):, mailto: — not ours to check here
            continue
        path_part, _, anchor = target.partition("#")
        path = (base / path_part).resolve() if path_part else REPO / doc
        if not path.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with that anchor in {path.relative_to(REPO)}")
    assert not broken, f"{doc}: " + "; ".join(broken)


def test_readme_answers_which_method_in_one_table() -> None:
    """README stays short, and "which method?" is one table whose every row names the RESULTS
    section behind it (a new method gets a row with its evidence)."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    section = text[text.index("## Which method?"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| Method")]
    assert len(rows) >= 4
    for row in rows:
        assert "benchmarks/RESULTS.md#" in row, row


def test_no_tracker_numbers_in_documents_code_comments_or_configs() -> None:
    """README, CHANGELOG, RESULTS, docs/, src/ and conf/ name the section, the paper line or the idea,
    not an issue number nobody outside the project can resolve."""
    pattern = re.compile(r"issues?[- ]?#?[0-9]+|(^|[^A-Za-z0-9_/(&])#[0-9]+\b", re.I | re.M)
    paths = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "benchmarks" / "RESULTS.md", *REPO.glob("docs/*.md")]
    paths += [p for p in (REPO / "src").rglob("*") if p.suffix in {".py", ".c", ".md"} and "egg-info" not in str(p)]
    paths += [*REPO.glob("conf/**/*.yaml")]
    found = [f"{p.relative_to(REPO)}: {m.group(0).strip()}" for p in paths for m in pattern.finditer(p.read_text())]
    assert not found, found
