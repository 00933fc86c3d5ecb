"""Prose that stays true: docs/architecture.md names every module, module docstrings stay short,
and nothing cites the design notes that are no longer in the repository.

A module is named by its path from the repository root in backticks (`memopt_plugins/engine.py`),
the form the architecture page's tables use.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("memopt_plugins", "callbacks")
MAX_DOCSTRING_LINES = 15
# Spelled in two parts so that this file does not cite it itself.
RETIRED_DOCUMENT = "DESIGN" + ".md"


def _modules() -> list[Path]:
    return sorted(p.relative_to(ROOT) for root in SOURCES for p in (ROOT / root).rglob("*.py"))


def _tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no tracked files to read")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    return [ROOT / name for name in listed.decode().split("\0") if name]


def test_the_sources_have_modules():
    assert len(_modules()) > 50  # the globs found the package, not an empty folder


def test_the_architecture_page_names_every_module_by_its_path():
    page = (ROOT / "docs" / "architecture.md").read_text()
    unnamed = [str(p) for p in _modules() if f"`{p.as_posix()}`" not in page]
    assert unnamed == [], f"docs/architecture.md does not name: {unnamed}"


def _docstring_lines(source: str) -> int:
    """Lines of a module's docstring as written (``clean=False``: blank lines and indent kept)."""
    docstring = ast.get_docstring(ast.parse(source), clean=False)
    return len(docstring.splitlines()) if docstring else 0


def test_module_docstrings_are_at_most_15_lines():
    lines = {str(p): _docstring_lines((ROOT / p).read_text()) for p in _modules()}
    long = {path: n for path, n in lines.items() if n > MAX_DOCSTRING_LINES}
    assert long == {}, f"module docstrings over {MAX_DOCSTRING_LINES} lines: {long}"


def test_the_count_takes_every_line_of_the_docstring_and_nothing_after_it():
    body = "\n".join(f"line {i}" for i in range(MAX_DOCSTRING_LINES))
    source = f'"""{body}\n\n"""\n\nx = 1\n# a comment\n'
    assert _docstring_lines(source) == MAX_DOCSTRING_LINES + 1
    assert _docstring_lines("x = 1\n") == 0


def test_no_tracked_file_cites_the_retired_design_document():
    citing = [
        str(path.relative_to(ROOT))
        for path in _tracked_files()
        if path.is_file() and RETIRED_DOCUMENT.encode() in path.read_bytes()
    ]
    assert citing == []
