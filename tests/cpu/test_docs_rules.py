"""The docs are a product: no session, issue or run numbers in the docs, the README or the code (history goes to
CHANGELOG.md, figures to docs/benchmarks.md), no dated figures in code comments, every relative link of the
README and the docs leads to a file (and heading) that exists, and docs/code-map.md has an entry for every module
and names no file that is gone."""

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
CODE_MAP = ROOT / "docs" / "code-map.md"
MAP_ENTRY = re.compile(r"^- `([^`\s]+)` — ", re.MULTILINE)  # "- `engine/worker.py` — what it owns"
BACKQUOTED = re.compile(r"`([^`\s]+)`")
FROM_ROOT = ("scripts/", "examples/", "tests/")  # the map writes these from the repository root, the rest from torpor/


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


def only_reexports(source: str) -> bool:
    """Whether a package's `__init__.py` only re-exports (imports, `__all__`, a lazy `__getattr__` / `__dir__`):
    such a file needs no entry of its own in the code map; one that defines anything else does."""
    defined = [node.name for node in ast.parse(source).body
               if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)]
    return set(defined) <= {"__getattr__", "__dir__"}


def map_name(path: Path) -> str:
    """A file as the code map names it: a module of torpor from torpor/, anything else from the repository root."""
    torpor = ROOT / "torpor"
    return path.relative_to(torpor).as_posix() if path.is_relative_to(torpor) else relative(path)


def map_file(name: str) -> Path:
    return ROOT / name if name.startswith(FROM_ROOT) else ROOT / "torpor" / name


def needs_entry() -> list[str]:
    """Every file the code map must have an entry for: each module of torpor but `__main__.py` and the `__init__.py`
    files that only re-export, every file of scripts/ and examples/, and the tests' helper modules."""
    modules = [path for path in CODE if path.name != "__main__.py"
               and not (path.name == "__init__.py" and only_reexports(path.read_text()))]
    others = [path for folder in ("scripts", "examples") for path in (ROOT / folder).rglob("*")
              if path.is_file() and "__pycache__" not in path.parts]
    return sorted(map_name(path) for path in [*modules, *others, *(ROOT / "tests").glob("*.py")])


def named_paths(text: str) -> list[str]:
    """The files a text names in backquotes: every `*.py`, and every name under scripts/ or examples/."""
    return [name for name in BACKQUOTED.findall(text)
            if name.endswith(".py") or name.startswith(("scripts/", "examples/"))]


def test_the_code_map_rules_see_what_they_forbid():
    text = "- `engine/worker.py` — a `Worker`, see `scripts/gpu-check`; `LLM.generate`\n  - `x.py` — no entry\n"
    assert MAP_ENTRY.findall(text) == ["engine/worker.py"]
    assert named_paths(text) == ["engine/worker.py", "scripts/gpu-check", "x.py"]
    assert map_file("engine/worker.py") == ROOT / "torpor" / "engine" / "worker.py"
    assert map_file("tests/references.py") == ROOT / "tests" / "references.py"
    assert only_reexports('"""Doc."""\nfrom a import b\n__all__ = ["b"]\ndef __getattr__(name): ...\n')
    assert not only_reexports('"""Doc."""\nfrom a import b\ndef make_executor(): ...\n')


def test_code_map_has_an_entry_for_every_module():
    entries = MAP_ENTRY.findall(CODE_MAP.read_text())
    missing = sorted(set(needs_entry()) - set(entries))
    twice = sorted({name for name in entries if entries.count(name) > 1})
    assert not missing, f"docs/code-map.md has no entry (- `path` — what it does) for: {', '.join(missing)}"
    assert not twice, f"docs/code-map.md has more than one entry for: {', '.join(twice)}"


def test_code_map_names_no_file_that_is_gone():
    gone = sorted({name for name in named_paths(CODE_MAP.read_text()) if not map_file(name).is_file()})
    assert not gone, f"docs/code-map.md names files that do not exist: {', '.join(gone)}"
