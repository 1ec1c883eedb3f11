"""Random answer text of a given token length, and tool calls whose arguments fill the offered schemas.

Everything is drawn from the RNG the caller hands in, so a seeded generation repeats exactly.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from services.profiles import ProfileLike
from services.simulator.request import ChatRequest
from services.simulator.tables import CODE, OPENERS, PUNCT, UNICODE, WORDS


def _number(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.4:
        return str(rng.randint(1000, 99_999))  # 4-5 digits: "123"+"45" re-splits as "12"+"345"
    if kind < 0.7:
        return str(rng.randint(0, 99))
    return f"{rng.uniform(0, 1000):.2f}"


def _pieces(rng: random.Random, n_tokens: int, *, reasoning: bool) -> list[str]:
    """Word-sized pieces (each with its leading separator) of plausible prose, about ``n_tokens``."""
    out: list[str] = []
    budget = max(1, n_tokens)
    sentence_start = True
    while budget > 0:
        roll = rng.random()
        if sentence_start:
            word = rng.choice(OPENERS) if reasoning and rng.random() < 0.3 else rng.choice(WORDS).capitalize()
            cost = 2
        elif roll < 0.70:
            word, cost = rng.choice(WORDS), 1
        elif roll < 0.82:
            word, cost = _number(rng), 2
        elif roll < 0.91:
            word, cost = rng.choice(UNICODE), 2
        elif roll < 0.95:
            word = rng.choice(CODE)
            cost = max(3, len(word) // 4)
        else:
            word, cost = rng.choice(WORDS) + rng.choice(PUNCT), 2
        if out and not out[-1].endswith("\n"):
            word = " " + word
        out.append(word)
        budget -= cost
        sentence_start = False
        if rng.random() < 0.08 and budget > 1:
            out[-1] += rng.choice((".", ".", "?", "!")) + ("\n\n" if rng.random() < 0.25 else "")
            sentence_start = True
    return out


def _join(pieces: Sequence[str]) -> str:
    """Pieces as one text with no outer whitespace, ending like a sentence."""
    text = "".join(pieces).strip()
    if not text.endswith((".", "?", "!", "`")):
        text += "."
    return text


def sized_text(profile: ProfileLike, rng: random.Random, bounds: tuple[int, int], reasoning: bool) -> str:
    """Text of a token count drawn from ``bounds``: a binary search over a prefix of pieces."""
    low, high = min(bounds), max(bounds)
    target = rng.randint(low, high)
    pieces = _pieces(random.Random(rng.getrandbits(64)), 2 * target + 8, reasoning=reasoning)  # noqa: S311

    def count(k: int) -> int:
        return len(profile.encode(_join(pieces[:k])))

    lo, hi = 1, len(pieces)  # find the longest prefix not above the target
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(mid) <= target:
            lo = mid
        else:
            hi = mid - 1
    if count(lo) < low and lo < len(pieces) and count(lo + 1) <= high:
        lo += 1
    return _join(pieces[:lo])


# ---------------------------------------------------------------- tools

_SYSTEM_TOOLS = re.compile(r'"parameters"\s*:|<tools>|"type"\s*:\s*"function"|functions\.\w+')
_SYSTEM_TOOL_NAME = re.compile(r'"name"\s*:\s*"([A-Za-z_][\w.-]{0,63})"')


def offered_tools(request: ChatRequest) -> list[tuple[str, dict[str, Any]]]:
    """(name, JSON-Schema parameters) of each tool the prompt offers, from ``tools`` or the system prompt."""
    if request.tool_choice == "none":
        return []
    found: list[tuple[str, dict[str, Any]]] = []
    for tool in request.tools or []:
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
            params = fn.get("parameters")
            found.append((fn["name"], params if isinstance(params, dict) else {}))
    if found or request.tools:
        return found
    for message in request.messages:
        if message.get("role") == "system" and _SYSTEM_TOOLS.search(message["content"]):
            names = _SYSTEM_TOOL_NAME.findall(message["content"]) or ["lookup"]
            found.extend((name, {}) for name in dict.fromkeys(names))
    return found


def _argument_value(rng: random.Random, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list) and schema["enum"]:
        return rng.choice(schema["enum"])
    if kind == "integer":
        return rng.randint(0, 5000)
    if kind == "number":
        return round(rng.uniform(0, 100), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [_argument_value(rng, schema.get("items", {})) for _ in range(rng.randint(1, 3))]
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.2:
        words.append(rng.choice(UNICODE))
    return " ".join(words)


def tool_call_args(rng: random.Random, tools: list[tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    """(name, arguments object) of one call to an offered tool, arguments filling its schema."""
    name, params = tools[rng.randrange(len(tools))]
    props = params.get("properties") if isinstance(params.get("properties"), dict) else None
    if props:
        args = {key: _argument_value(rng, schema) for key, schema in props.items()}
    else:
        args = {"query": _argument_value(rng, {"type": "string"})}
    return name, args
