"""Rich consoles for printing data: what a file, a record or a model said comes out as it is.

Rich reads ``[bold]`` as markup and ``:100:`` as an emoji code in every string it prints, so
a dead letter for line 100 of ``responses.jsonl`` came out as ``responses.jsonl💯``. Every
console that prints keys, file:line, model text or reasons is one of these (markup, emoji
codes and highlighting off); a word the command itself colours is a :class:`rich.text.Text`.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text


def data_console(*, stderr: bool = False, **options: Any) -> Console:
    """A console that prints every string verbatim: no markup, no emoji codes, no highlighting."""
    return Console(stderr=stderr, markup=False, emoji=False, highlight=False, **options)


def styled(label: str, style: str, rest: str = "") -> Text:
    """``label`` in ``style``, then ``rest`` verbatim (never read as markup or emoji codes)."""
    return Text.assemble((label, style), rest)


__all__ = ["data_console", "styled"]
