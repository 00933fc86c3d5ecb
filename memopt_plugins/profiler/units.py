"""Bytes for people: binary units, shared by the report's text and its charts."""

from __future__ import annotations

#: Binary units of :func:`human_bytes`, smallest first.
UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``: binary units with one decimal, whole bytes below 1 KiB."""
    value = float(n)
    if abs(value) < 1024:
        return f"{value:.0f} B"
    for unit in UNITS[1:]:
        value /= 1024
        if abs(round(value, 1)) < 1024 or unit == UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def axis_unit(largest: float) -> tuple[str, float]:
    """The unit of a chart's axis whose largest value is ``largest`` bytes, and its size."""
    scale = 1.0
    for unit in UNITS:
        if largest < 1024 * scale or unit == UNITS[-1]:
            return unit, scale
        scale *= 1024
    raise AssertionError("unreachable")
