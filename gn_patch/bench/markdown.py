"""Markdown cells and tables of summary.md."""

from __future__ import annotations

from typing import Any


def fmt(value: Any, digits: int = 1) -> str:
    """A table cell: '–' for a missing value, floats to ``digits`` decimals."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table; non-string cells go through fmt (1 decimal, '–' for None)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) if not isinstance(v, str) else v for v in row) + " |" for row in rows]
    return "\n".join(lines)


def shape_label(shape: list[int]) -> str:
    """[2, 320, 64, 64] -> '2x320x64x64'."""
    return "x".join(map(str, shape))


def speedup(value: float | None) -> str:
    """A ratio as '1.25x', '–' for None."""
    return "–" if value is None else f"{value:.2f}x"
