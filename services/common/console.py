"""Rich consoles for printing data: what a file, a record or a model said comes out as it is.

Rich reads ``[bold]`` as markup and ``:100:`` as an emoji code in every string it prints, so
a dead letter for line 100 of ``responses.jsonl`` came out as ``responses.jsonl💯``. Every
console that prints keys, file:line, model text or reasons is one of these (markup, emoji
codes and highlighting off); a word the command itself colours is a :class:`rich.text.Text`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rich import box
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.segment import Segment
from rich.table import Table
from rich.text import Text


def data_console(*, stderr: bool = False, **options: Any) -> Console:
    """A console that prints every string verbatim: no markup, no emoji codes, no highlighting."""
    return Console(stderr=stderr, markup=False, emoji=False, highlight=False, **options)


def styled(label: str, style: str, rest: str = "") -> Text:
    """``label`` in ``style``, then ``rest`` verbatim (never read as markup or emoji codes)."""
    return Text.assemble((label, style), rest)


@dataclass(frozen=True)
class Column:
    """One column of a :class:`FittedTable`: its header, alignment, and in which view it shows.

    ``view``: ``"compact"`` (the default view only), ``"wide"`` (``--wide`` only) or ``"both"``.
    """

    name: str
    justify: Literal["left", "right", "center"] = "left"
    view: Literal["compact", "wide", "both"] = "both"
    whole: bool = False
    """Figures: the column is as wide as its longest line, so a number never breaks across lines
    (the other columns wrap to make room, as far as the terminal allows)."""


class FittedTable:
    """A table that fits the console it is printed on: the compact columns, or every one with ``wide``.

    No width is fixed anywhere: rich measures the terminal (``COLUMNS`` when not a terminal) and
    wraps cells to fit it. A row is given as a mapping of column name to cell, so a caller that
    adds rows (a provider's, a scope's) fills the names it knows and inherits both views; a
    cell missing from the mapping prints as ``-``.
    """

    def __init__(self, title: str, columns: Iterable[Column], *, wide: bool = False, **options: Any) -> None:
        shown = "wide" if wide else "compact"
        self.columns = [c for c in columns if c.view in ("both", shown)]
        self.table = Table(title=title, box=box.SIMPLE_HEAD, **options)
        self._whole: dict[int, int] = {}
        for column in self.columns:
            self.table.add_column(column.name, justify=column.justify, overflow="fold")

    def add_row(self, cells: Mapping[str, RenderableType]) -> None:
        """Add one row: each shown column's cell by name."""
        row = [cells.get(c.name, "-") for c in self.columns]
        for index, (spec, cell) in enumerate(zip(self.columns, row, strict=True)):
            if spec.whole:
                lines = str(cell).splitlines() or [""]
                self._whole[index] = max(self._whole.get(index, len(spec.name)), *(len(line) for line in lines))
        self.table.add_row(*row)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """The table, its figure columns kept whole when the others can still wrap beside them."""
        for index, width in self._whole.items():
            self.table.columns[index].min_width = width
        if self._whole and _widest(Segment.split_lines(console.render(self.table, options))) > options.max_width:
            for index in self._whole:  # no room: every column wraps, so the table still fits
                self.table.columns[index].min_width = None
        yield self.table


def _widest(lines: Iterable[list[Segment]]) -> int:
    """The widest of rendered lines, in cells (uncropped: render_lines would crop them to the width)."""
    return max((Segment.get_line_length(line) for line in lines), default=0)


__all__ = ["Column", "FittedTable", "data_console", "styled"]
