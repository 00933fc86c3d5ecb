"""The README and docs/ hold together: links resolve, the config reference matches the schema,
the README's results table is the benchmark's, and the README stays a page."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from benchmarks.plot_fits import METHODS, readme_table
from memopt_plugins.config import MemOptConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_every_relative_link_points_at_a_file_and_heading_that_exist(page: Path):
    broken = []
    for target in _links(page):
        file, _, anchor = target.partition("#")
        resolved = (page.parent / file).resolve() if file else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(target)
    assert broken == []


def test_the_docs_pages_are_all_reachable_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in _links(README)}
    assert [p.name for p in PAGES if p.resolve() not in linked] == []


def test_the_readme_is_a_page_that_starts_with_the_setup_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250
    first_block = lines[lines.index("```bash") + 1 : lines.index("```")]
    assert [line.split()[:2] for line in first_block] == [["make", "demo"], ["make", "test"]]


def _schema_keys(model: type[BaseModel], prefix: str = "") -> dict[str, object]:
    """``{"section.key": default}`` for every key of the schema, nested sections included."""
    keys: dict[str, object] = {}
    defaults = model().model_dump(mode="json")
    for name, field in model.model_fields.items():
        nested = [
            t
            for t in (field.annotation, *typing.get_args(field.annotation))
            if isinstance(t, type) and issubclass(t, BaseModel)
        ]
        if nested and prefix:  # an optional sub-section (recompute.auto): its keys too
            keys[prefix + name] = defaults[name]
            keys.update(_schema_keys(nested[0], f"{prefix}{name}."))
        elif nested:
            keys.update(_schema_keys(nested[0], f"{name}."))
        else:
            keys[prefix + name] = defaults[name]
    return keys


def _documented_keys() -> dict[str, str]:
    """``{"section.key": default as written}`` from the tables of docs/configuration.md."""
    documented: dict[str, str] = {}
    section = None
    for line in (ROOT / "docs" / "configuration.md").read_text().splitlines():
        heading = re.match(r"^## `(\w+)`", line)
        if heading:
            section = heading.group(1)
        row = re.match(r"^\| `([\w.]+)` \| `([^`]*)` \|", line)
        if row and section:
            documented[f"{section}.{row.group(1)}"] = row.group(2)
    return documented


def _as_written(default: object) -> str:
    return default if isinstance(default, str) else json.dumps(default)


def test_the_configuration_reference_documents_every_key_with_its_default():
    schema = {k: _as_written(v) for k, v in _schema_keys(MemOptConfig).items()}
    assert _documented_keys() == schema


def test_schema_walk_sees_nested_and_optional_sections():
    keys = _schema_keys(MemOptConfig)
    assert keys["quantize.bits"] == 32 and keys["recompute.auto.budget"] == 0.5
    assert keys["recompute.auto"] is None and isinstance(keys["drift.ladder"], list)


def test_the_readme_results_table_is_the_benchmarks():
    """What `python -m benchmarks.plot_fits --readme-table` prints from fits.json, line by line."""
    rows = json.loads((ROOT / "benchmarks" / "fits.json").read_text())
    text = README.read_text().split("## Results", 1)[1].split("\n## ", 1)[0]
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert table == readme_table(rows).splitlines()
    assert len(table) >= 2 + len(METHODS)  # header, rule, a row per method at least
