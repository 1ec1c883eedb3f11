"""Reconstruction of a completions-mode response: the model's raw text, nothing parsed away.

In completions mode the inference stage rendered the prompt with the profile's own
template (tools in the model's native format) and sent that text to the provider's
text-completions endpoint; the reply is the model's raw output with its special tokens
(think and tool tokens kept: ``skip_special_tokens: false``), minus the stop token, which
a server's detokenizer drops. So:

- prompt ids are the profile's encode of the exact prompt text that was sent (ours by
  construction; the audit still checks them against ``usage.prompt_tokens``);
- output ids are the encode of the raw text (specials parsed) plus the end-of-turn when
  the answer stopped by itself (``finish_reason`` ``stop``); nothing else is put back, and
  there is no place where the text may have lost something (no gaps to prove).

Reasoning, content and tool calls are derived from the raw text with the profile's own
markers (think-start/-end, the native tool-call syntax: Qwen3's Hermes, DeepSeek-R1's and
V3.1's, Kimi's; a block that does not parse stays in the content) so that the audit's checks and the
training rows read them as they read a chat response's fields. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import msgspec

from schemas import ResponseReceived, ToolCall, ToolFunction
from services.common.records import DeadLetter
from services.profiles import ProfileLike
from services.reconstruct.plan import (
    EMPTY_RESPONSE,
    TEMPLATE_ERROR,
    Plan,
    check_ids,
    output_layout,
)

__all__ = ["RawParts", "plan_raw", "split_raw"]

# Where each native tool-call format's block starts, and one call inside it (the formats the
# profiles write; the patterns of vLLM's hermes, deepseekv3, deepseekv31 and kimi_k2 parsers,
# PARSERS.md, without their whitespace trimming: the arguments are the model's own text).
# The simulator holds its own copy on purpose: it stands for the server, and a test's truth
# must not come from the code under test.
_TOOL_BLOCK_START = {
    "qwen": "<tool_call>",
    "deepseek-r1": "<｜tool▁calls▁begin｜>",
    "deepseek-v3.1": "<｜tool▁calls▁begin｜>",
    "kimi": "<|tool_calls_section_begin|>",
}
_TOOL_CALL = {
    "qwen": re.compile(r"<tool_call>\n?(?P<body>.*?)\n?</tool_call>", re.DOTALL),
    "deepseek-r1": re.compile(
        r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<args>.*?)\n```<｜tool▁call▁end｜>",
        re.DOTALL,
    ),
    "deepseek-v3.1": re.compile(
        r"<｜tool▁call▁begin｜>(?P<name>.*?)<｜tool▁sep｜>(?P<args>.*?)<｜tool▁call▁end｜>", re.DOTALL
    ),
    "kimi": re.compile(
        r"<\|tool_call_begin\|>(?P<id>[^<]+?)<\|tool_call_argument_begin\|>(?P<args>.*?)<\|tool_call_end\|>", re.DOTALL
    ),
}


@dataclass(frozen=True)
class RawParts:
    """A raw output split with the profile's markers, as a parser that drops nothing would."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    closed: bool = True  # False: the text ends inside the think block


def _call(tool_format: str, match: re.Match[str], call_id: str) -> ToolCall:
    """One structured call from a native call's match; raises ValueError/KeyError/TypeError when it is not one."""
    if tool_format == "qwen":
        obj = json.loads(match["body"])
        name, arguments = obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)
    elif tool_format == "kimi":
        call_id = match["id"]  # "functions.NAME:INDEX", the id the model itself writes
        name, arguments = call_id.split(":")[0].split(".")[-1], match["args"]
    else:
        name, arguments = match["name"], match["args"]
    json.loads(arguments)
    if not isinstance(name, str) or not name:
        raise TypeError("no function name")
    return ToolCall(function=ToolFunction(name=name, arguments=arguments), id=call_id)


def _tool_calls(tool_format: str, text: str, call_id: str) -> tuple[str, list[ToolCall]]:
    """(content before the tool block, calls); the text unchanged when no call in the block parses."""
    start_token, pattern = _TOOL_BLOCK_START.get(tool_format), _TOOL_CALL.get(tool_format)
    start = text.find(start_token) if start_token else -1
    if start < 0 or pattern is None:
        return text, []
    try:
        calls = [_call(tool_format, m, f"{call_id}_{i}") for i, m in enumerate(pattern.finditer(text, start))]
    except (ValueError, KeyError, TypeError):  # not JSON, or not a call object: kept as text
        return text, []
    return (text[:start], calls) if calls else (text, [])


def split_raw(text: str, profile: ProfileLike, prompt_state: str, *, call_id: str = "call") -> RawParts:
    """Reasoning, content and tool calls of a raw output under a prompt in ``prompt_state``.

    The think block is the prompt's (``open``) or the model's own when the text begins with
    the think-start; it ends at the first think-end (none: the text stopped inside it).
    Nothing is stripped.
    """
    body, reasoning, closed = text, "", True
    think_start, think_end = profile.think_start, profile.think_end
    if think_end is not None and prompt_state != "closed":
        opened = prompt_state == "open"
        if not opened and think_start and body.startswith(think_start):
            body, opened = body[len(think_start) :], True
        if opened:
            if think_end in body:
                reasoning, _, body = body.partition(think_end)
            else:
                reasoning, body, closed = body, "", False
    body, calls = _tool_calls(profile.tool_format, body, call_id)
    return RawParts(reasoning=reasoning, content=body, tool_calls=calls, closed=closed)


def plan_raw(response: ResponseReceived, profile: ProfileLike) -> Plan | DeadLetter:
    """The reconstruction plan of a completions-mode response (see the module docstring)."""
    prompt_text = response.sent_prompt
    if not prompt_text:  # a record from before the prompt travelled along: render it again
        tools = response.prompt.tools if response.tools_sent else None
        try:
            prompt_text = profile.render_prompt(
                response.prompt.messages, tools, reasoning=response.prompt.conversation is not None
            )
        except Exception as exc:  # a template error is this record's fault, not the stage's
            return DeadLetter(TEMPLATE_ERROR, f"chat template of {profile.name} failed: {type(exc).__name__}: {exc}")
    state = profile.prompt_state(prompt_text)
    finished = response.finish_reason == "stop"
    text = response.text
    eot = profile.end_of_turn
    if finished and text.endswith(eot):
        text = text[: -len(eot)]  # a server that kept the stop token's text: the same ids either way
    parts = split_raw(text, profile, state, call_id=f"call_{response.sample_id}")
    derived = msgspec.structs.replace(
        response, reasoning=parts.reasoning, content=parts.content, tool_calls=parts.tool_calls
    )
    if response.native_output_ids:
        bad = check_ids(response.native_output_ids, profile, "native output")
        if bad is not None:
            return bad
        return Plan(derived, prompt_text, None, list(response.native_output_ids), "native")
    if not text:
        return DeadLetter(EMPTY_RESPONSE, "the completions response has no text")
    layout = output_layout(profile, prompt_text, reasoning=parts.reasoning, closed=parts.closed, finished=finished)
    return Plan(derived, prompt_text, text + (eot if finished else ""), None, "reencode", layout)
