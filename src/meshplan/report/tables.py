"""Tables that stay readable in an 80-column terminal: short headers broken over two lines on
purpose, no outer edge, one space between columns, numbers right-aligned; cells that are still
too long wrap (never an ellipsis)."""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.table import Table

WIDTH = 80


def table(title: str, columns: Sequence[str], numeric: Sequence[str] = ()) -> Table:
    """A table with `columns` (write a header as "two\\nlines" to keep the column narrow);
    headers listed in `numeric` are right-aligned."""
    t = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
              title_justify="left", title_style="bold")
    for column in columns:
        t.add_column(column, justify="right" if column in numeric else "left", overflow="fold")
    return t


def gb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.1f}"


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def seconds_text(seconds: float | None) -> str:
    """Seconds with a unit that keeps three significant digits readable."""
    if seconds is None:
        return "-"
    value = abs(seconds)
    if value >= 1 or value == 0:
        return f"{seconds:.3g} s" if value < 100 else f"{seconds:,.0f} s"
    if value >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def bytes_text(nbytes: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"


def shape_text(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape)) if shape else "-"
