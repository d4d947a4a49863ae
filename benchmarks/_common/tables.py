"""The one table printer of the benchmarks: a markdown table, as docs/benchmarks.md quotes it.

Every benchmark prints its results through :func:`print_table` (or pastes :func:`table`'s lines into a longer
report), so every table reads the same way and goes into the docs as it is. Cells are formatted by the caller
(the units and digits are the benchmark's); ``None`` prints ``-``. Columns are aligned by kind: the first (what
the row is) to the left, the figures to the right, unless ``align`` says otherwise (one letter a column, ``l`` or
``r``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def table(header: Sequence[str], rows: Iterable[Sequence[object]], *, align: str | None = None) -> list[str]:
    """The lines of a markdown table: the header, the alignment row, one line a row.

    Raises:
        ValueError: a row or ``align`` with another number of columns than ``header``.
    """
    align = align or "l" + "r" * (len(header) - 1)
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align={align!r}: give one letter, l or r, for each of the {len(header)} columns")
    lines = [_line(header), "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells under {len(header)} columns: {row!r}")
        lines.append(_line(row))
    return lines


def print_table(header: Sequence[str], rows: Iterable[Sequence[object]], *, align: str | None = None,
                title: str | None = None) -> None:
    """Print :func:`table` (after a blank line and ``title``, when given)."""
    lines = table(header, rows, align=align)
    print("\n".join(([""] + [title] if title else [""]) + lines), flush=True)


def _line(cells: Sequence[object]) -> str:
    return "|" + "|".join(f" {_cell(c)} " if _cell(c) else " " for c in cells) + "|"


def _cell(value: object) -> str:
    return "-" if value is None else str(value)
