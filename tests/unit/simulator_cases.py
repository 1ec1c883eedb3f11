"""What the simulator's unit tests share: Qwen3's profile and ids, a tool, one-turn requests."""

from __future__ import annotations

import re
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

from services.common.config import load_settings
from services.profiles import Profile, load_profile
from services.simulator.core import GenerationParams
from services.simulator.request import ChatRequest

PROFILE = load_profile("qwen3")  # cached by services.profiles: loaded once per session
# Qwen3's ids (tokenizer_config.json, TOKENS.md).
THINK_START, THINK_END, EOT, TOOL_CALL = 151667, 151668, 151645, 151657
PARAMS = GenerationParams()
LEGACY = replace(PARAMS, parser="sglang-legacy")
REPO = Path(__file__).resolve().parents[2]
KIMI_TINY = REPO / "tests" / "fixtures" / "profiles" / "kimi-tiny"

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
# Qwen3's raw answer, from its official template's assistant turn.
QWEN3_RAW = re.compile(
    r"<think>\n(?P<r>.*)\n</think>\n\n(?P<c>.*?)(?P<tool>\n<tool_call>\n.*\n</tool_call>)?<\|im_end\|>", re.S
)


@cache
def kimi() -> Profile:
    """Kimi-K2-Thinking over the tiny byte-level tiktoken fixture (real special ids)."""
    settings = load_settings(None, profiles={"kimi-k2-thinking": {"tokenizer": str(KIMI_TINY), "kind": "tiktoken"}})
    return load_profile("kimi-k2-thinking", settings)


def chat(text: str = "What is 17 * 23?", **kw: Any) -> ChatRequest:
    """A one-turn request."""
    return ChatRequest(model="qwen/qwen3", messages=[{"role": "user", "content": text}], **kw)


def qwen_call_text(name: str, arguments: str) -> str:
    """Qwen3's native text of one call (Qwen-Qwen3-0.6B.jinja), written here by hand."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
