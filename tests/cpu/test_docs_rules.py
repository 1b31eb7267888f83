"""The docs are a product: no session, issue or run numbers in the docs, the README or the code (history goes to
CHANGELOG.md, figures to docs/benchmarks.md), no dated figures in code comments, and every relative link of the
README and the docs leads to a file (and heading) that exists."""

import ast
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
CODE = sorted((ROOT / "torpor").rglob("*.py"))
ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
REFERENCES = re.compile(
    rf"\bissues? #?\d+"  # issue 13, issue #7, issues 11
    rf"|\brun \d+\b|\bruns \d+(?:\s*[–-]\s*\d+|(?:,\s*\d+)*,?\s+and\s+\d+)"  # run 9, runs 24-28, runs 22 and 24
    rf"|\b(?:{ORDINALS}|this|last|next) session\b|\bsessions? \d+",  # the ninth session, this session
    re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def references(text: str) -> list[str]:
    return [match.group(0) for match in REFERENCES.finditer(text)]


def test_the_rules_see_what_they_forbid():
    assert references("as run 9 showed; runs 24-28; runs 22 and 24; issue 13; Issue #7; the ninth session") == [
        "run 9", "runs 24-28", "runs 22 and 24", "issue 13", "Issue #7", "the ninth session"[4:]]
    assert not references("the harness runs 6 scenarios; a dry run 0f; rerun 3 times; issues with the driver")
    assert comment_dates("x = 1  # 0.3 s on an H200 (2026-12-02)\n'''Doc.'''\n") == ["2026-12-02"]
    assert comment_dates('"""Measured 2026-11-30."""\nURL = "2026-12-01"\n') == ["2026-11-30"]  # not a string value


@pytest.mark.parametrize("path", DOCS, ids=relative)
def test_docs_name_no_session_issue_or_run(path):
    assert references(path.read_text()) == []


@pytest.mark.parametrize("path", CODE, ids=relative)
def test_code_names_no_session_issue_or_run_and_dates_no_figure(path):
    text = path.read_text()
    assert references(text) == []
    assert comment_dates(text) == [], "a dated figure in a comment: point to docs/benchmarks.md instead"


def comment_dates(source: str) -> list[str]:
    """The dates in the `#` comments and the docstrings of `source`."""
    texts = [token.string for token in tokenize.generate_tokens(iter(source.splitlines(True)).__next__)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            texts += [docstring] if docstring else []
    return [date for text in texts for date in DATE.findall(text)]


@pytest.mark.parametrize("path", DOCS, ids=relative)
def test_every_relative_link_leads_to_a_file_and_heading(path):
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in headings(linked):
            broken.append(f"{target}: no such heading in {relative(linked)}")
    assert broken == []


def headings(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation but '-' and '_' dropped, spaces
    to '-'."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)  # no headings inside code blocks
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in text.splitlines() if re.match(r"#{1,6} ", line)}
