"""memopt's presets: the YAML configs of this folder, installed as ``memopt_plugins.presets``.

A preset is loaded by its name wherever a config is accepted (``MemOptCallback("int4_drift")``,
``MemoryOptimizer("int4_drift")``, ``memopt profile --config int4_drift``); ``memopt presets``
lists them. Each file opens with a comment whose first line says what it is for.
"""

from __future__ import annotations

import os
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

__all__ = ["FIRST", "describe", "name_of", "names", "path"]

#: The preset to start with: 4-bit storage, watched by the drift check.
FIRST = "int4_drift"
SUFFIX = ".yaml"


def _folder() -> Traversable:
    return resources.files(__name__)


def names() -> list[str]:
    """The presets' names, sorted (``int4_drift`` for ``int4_drift.yaml``)."""
    return sorted(
        entry.name.removesuffix(SUFFIX)
        for entry in _folder().iterdir()
        if entry.name.endswith(SUFFIX) and entry.is_file()
    )


def path(name: str) -> Traversable | None:
    """The file of preset ``name``, or ``None`` when there is no such preset."""
    entry = _folder() / f"{name}{SUFFIX}"
    return entry if name in names() else None


def describe(name: str) -> str:
    """The first line of the preset's opening comment: what it is for."""
    found = path(name)
    if found is None:
        raise KeyError(name)
    for line in found.read_text(encoding="utf-8").splitlines():
        text = line.lstrip("#").strip()
        if line.startswith("#") and text:
            return text
    return ""


def name_of(file: str | os.PathLike[str]) -> str | None:
    """The preset whose file ``file`` is (by its resolved path), else ``None``."""
    found = Path(file).resolve()
    name = found.name.removesuffix(SUFFIX)
    entry = path(name) if found.name.endswith(SUFFIX) else None
    return name if isinstance(entry, os.PathLike) and Path(entry).resolve() == found else None
