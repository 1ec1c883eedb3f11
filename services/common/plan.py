"""What a run will do with each dataset, one line each: said before the first paid request.

The inference worker logs these lines at start and ``draftstream estimate`` prints them, so a
profile or a ``max_tokens`` the user did not mean (a dataset section that did not inherit
what they expected) is visible before money moves. Each value names its origin
(services/common/layering.py).
"""

from __future__ import annotations

from typing import Any

from services.common.config import Settings


def _value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _items(settings: Settings, dataset: str) -> str:
    shown = settings.dataset_origins(dataset)

    def item(key: str) -> str:
        value, origin = shown[key]
        return f"{key} {_value(value)} [{origin}]"

    return (
        f"{item('profile')}, {item('mode')}, {item('max_tokens')}, {item('cap_completion_tokens')}, "
        f"{item('cap_usd')}, min_yield {settings.budget.min_yield:g} [budget]"
    )


def plan_line(settings: Settings, dataset: str) -> str:
    """``dataset D: profile P [origin], mode M [origin], max_tokens N [origin], caps ..., min_yield Y``."""
    return f"dataset {dataset}: {_items(settings, dataset)}"


OTHERS = "every dataset not in [datasets]"


def plan_lines(settings: Settings) -> list[str]:
    """One :func:`plan_line` per configured dataset (sorted), then the line of any other dataset ([defaults])."""
    lines = [plan_line(settings, name) for name in sorted(settings.datasets)]
    # A worker follows every prompts topic: a dataset without a section runs on [defaults].
    return [*lines, f"{OTHERS}: {_items(settings, '')}"]


__all__ = ["OTHERS", "plan_line", "plan_lines"]
