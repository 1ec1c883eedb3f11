"""Tool-call blocks in output ids: each tool token's role, and the state machine that checks them.

Roles are recognised from the token strings, so any profile's naming works; DeepSeek-V4's
DSML blocks, whose tags are text around one token, are checked from the decoded text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

# Tool-token roles, recognised from the token string so any profile's naming works.
_SECTION_OPEN, _SECTION_CLOSE, _CALL_OPEN, _CALL_CLOSE, _SEP = "S(", "S)", "C(", "C)", "|"


def tool_token_roles(tool_tokens: dict[str, int]) -> dict[int, str]:
    """Map each tool-token id to its role: section open/close, call open/close, separator."""
    roles: dict[int, str] = {}
    for name, token_id in tool_tokens.items():
        n = name.lower().replace("▁", "_").replace("｜", "|")
        if "argument_begin" in n or n.endswith("sep|>") or n.endswith("sep") or "_sep" in n:
            roles[token_id] = _SEP
        elif "calls_begin" in n or "section_begin" in n:
            roles[token_id] = _SECTION_OPEN
        elif "calls_end" in n or "section_end" in n:
            roles[token_id] = _SECTION_CLOSE
        elif "call_begin" in n or n == "<tool_call>":
            roles[token_id] = _CALL_OPEN
        elif "call_end" in n or n == "</tool_call>":
            roles[token_id] = _CALL_CLOSE
    return roles


def parse_tool_tokens(ids: Sequence[int], roles: dict[int, str]) -> tuple[int, str]:
    """Count the tool calls in ``ids``; returns (calls, error) with error '' when well formed."""
    has_section = _SECTION_OPEN in roles.values()
    has_sep = _SEP in roles.values()
    in_section = not has_section
    in_call = False
    seps = 0
    calls = 0
    for pos, token_id in enumerate(ids):
        role = roles.get(token_id)
        if role is None:
            continue
        if role == _SECTION_OPEN:
            if in_section or in_call:
                return calls, f"nested tool-call section at {pos}"
            in_section = True
        elif role == _SECTION_CLOSE:
            if not in_section or in_call:
                return calls, f"tool-call section closed at {pos} while not open or a call is open"
            in_section = False
        elif role == _CALL_OPEN:
            if not in_section or in_call:
                return calls, f"tool call opened at {pos} outside a section or inside a call"
            in_call, seps = True, 0
        elif role == _SEP:
            if not in_call:
                return calls, f"tool-call separator at {pos} outside a call"
            seps += 1
        elif role == _CALL_CLOSE:
            if not in_call:
                return calls, f"tool call closed at {pos} while none is open"
            if has_sep and seps != 1:
                return calls, f"tool call ending at {pos} has {seps} separators, expected 1"
            in_call = False
            calls += 1
    if in_call or (has_section and in_section):
        return calls, "tool-call tokens not closed"
    return calls, ""


@lru_cache(maxsize=32)
def tool_roles(tool_tokens: tuple[tuple[str, int], ...]) -> dict[int, str]:
    """:func:`tool_token_roles` of a profile's tool tokens, cached per profile."""
    return tool_token_roles(dict(tool_tokens))


# DeepSeek-V4's DSML marks its blocks with text around one token (``<｜DSML｜tool_calls>``,
# ``<｜DSML｜invoke name=…>``): the roles are read off the decoded text, in order, then checked by the
# same state machine as token roles (the tag's index in this tuple stands for its id).
_DSML_TAGS = re.compile(r"<(/?)｜DSML｜(tool_calls|invoke)\b")
_DSML_ROLES = {0: _SECTION_OPEN, 1: _SECTION_CLOSE, 2: _CALL_OPEN, 3: _CALL_CLOSE}


def parse_dsml(text: str) -> tuple[int, str]:
    """Count the DSML invokes in ``text``; returns (calls, error) with error '' when well formed."""
    order = [(2 if m.group(2) == "invoke" else 0) + (1 if m.group(1) else 0) for m in _DSML_TAGS.finditer(text)]
    return parse_tool_tokens(order, _DSML_ROLES)
