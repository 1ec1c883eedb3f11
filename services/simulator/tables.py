"""The generator's tables: the words, symbols, code spans and openers answers are made of (pure data)."""

from __future__ import annotations

from typing import Final

WORDS: Final = (
    "the of and to in is that for it as with was on be by this are at from or an which but not have "
    "we can if so then there more its one all when also into value result step number model token "
    "function data answer check first second next case since because therefore however consider "
    "approach compute sum list order simple example equation solve given total assume thus note "
    "string array index loop count error test input output prime factor square root matrix vector"
).split()
UNICODE: Final = (
    "café",
    "naïve",
    "über",
    "señor",
    "Ωμέγα",
    "日本語",
    "東京",
    "数据",
    "привет",
    "→",
    "≤",
    "≥",
    "∑",
    "π",
    "✓",
    "…",
    "€",
    "°C",
    "🙂",
    "🚀",
    "αβγ",
    "Zürich",
)
CODE: Final = (
    "`x = f(3)`",
    "`len(items)`",
    "`a[i] += 1`",
    "`return None`",
    "`{}`",
    "`i < n`",
    "\n```python\ndef area(r):\n    return 3.14159 * r ** 2\n```\n",
    "\n```js\nconst sum = xs.reduce((a, b) => a + b, 0);\n```\n",
)
PUNCT: Final = (",", ",", ";", ":", " -", "!", "?")
OPENERS: Final = ("Let me think.", "Okay, so", "First,", "Hmm,", "Wait,", "Now", "So")
