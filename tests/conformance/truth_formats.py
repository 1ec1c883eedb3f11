"""Model output formats: how each model writes reasoning and tool calls, taken from its official chat template."""

from __future__ import annotations

from dataclasses import dataclass

from tests.conformance.truth_reference import template_source
from tests.conformance.truth_tokenizers import _USER_TEMPLATE

# ---- Model formats -----------------------------------------------------------------------------------------------

DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


@dataclass(frozen=True)
class _Spec:
    template: str | None  # reference/chat-templates file; None = the user-addedtok template
    bos: str
    eos: str
    thinking_kwarg: str | None  # chat_template kwarg that switches thinking (None: fixed)
    thinks: bool  # the model reasons (in thinking mode)
    start: str  # what the model emits before its reasoning ("<think>" when the prompt does not open the block)
    r_wrap: tuple[str, str]  # around the reasoning words inside the block
    c_pre: str  # between </think> and the content words
    tools: str | None  # tool-call format
    # True: the template concatenates `arguments` as a string, so we pass messages as sent (HF semantics).
    # vLLM parses arguments to a dict first (vllm/entrypoints/chat_utils.py `_postprocess_messages`,
    # vllm-project/vllm @ 001eadcf295d90aa0664963cd6a9d93f38a2f3da) which makes the R1/V3.1 templates raise
    # "can only concatenate str (not dict)" (vllm-project/vllm#14745 era, deepseek-ai/DeepSeek-V3#952,
    # sgl-project/sglang#9446, verl-project/verl#7664); the only rendering of these templates that works is
    # with the string as sent, which is what transformers and verl's fallback (verl PR #7768) do.
    args_as_sent: bool
    vllm_reasoning: str | None  # "base" (BaseThinkingReasoningParser semantics) | "kimi_k2" | None
    sglang_force: bool  # SGLang detector forces reasoning (no <think> in the output)
    tools_need_thinking_off: bool = False
    after_tool_ok: bool = True  # the template opens an assistant turn after a tool result


_SPECS: dict[str, _Spec] = {
    # Qwen3 hybrid: the model emits `<think>\n…\n</think>\n\n` (SOURCES.md: generation prompt has no <think>).
    "qwen3": _Spec("Qwen-Qwen3-0.6B.jinja", "", "<|im_end|>", "enable_thinking", True, "<think>", ("\n", "\n"),
                   "\n\n", "hermes", False, "base", False),
    # Thinking-2507: prompt ends `<think>\n`; vLLM's qwen3 parser (2026) partitions like the base class.
    "qwen3-thinking-2507": _Spec("Qwen3-4B-Thinking-2507.from-third-party-dump.jinja", "", "<|im_end|>", None,
                                 True, "", ("", "\n"), "\n\n", "hermes", False, "base", True),
    # R1: prompt ends `<｜Assistant｜><think>\n`; after a tool result the template opens no assistant turn.
    "deepseek-r1": _Spec("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", DS_BOS, DS_EOS, None, True, "",
                         ("", "\n"), "\n\n", "r1", True, "base", True, after_tool_ok=False),
    # V3.1: `thinking` kwarg; vLLM deepseek_v3 reasoning = R1 parser when thinking, identity otherwise (vLLM
    # docs; not in PARSERS.md). Tool calls only in non-thinking mode (V3.1 model card: not re-read here).
    "deepseek-v3.1": _Spec("deepseek-ai-DeepSeek-V3.1.jinja", DS_BOS, DS_EOS, "thinking", True, "", ("", ""), "",
                           "v31", True, "base", True, tools_need_thinking_off=True),
    "kimi-k2-thinking": _Spec("moonshotai-Kimi-K2-Thinking.jinja", "[BOS]", "[EOS]", None, True, "<think>",
                              ("", ""), "", "kimi", False, "kimi_k2", False),
    "user-addedtok": _Spec(None, "<bos>", "<end_of_turn>", None, False, "", ("", ""), "", None, False, None, False,
                           after_tool_ok=False),
}  # fmt: skip


def _template_text(model: str) -> str:
    spec = _SPECS[model]
    return template_source(spec.template) if spec.template else _USER_TEMPLATE


@dataclass(frozen=True)
class ToolCall:
    """A tool call as the model writes it: ``arguments`` is the exact JSON text it emits."""

    name: str
    arguments: str
    id: str


_TOOL_START = {"hermes": "<tool_call>", "r1": "<｜tool▁calls▁begin｜>", "v31": "<｜tool▁calls▁begin｜>",
               "kimi": "<|tool_calls_section_begin|>"}  # fmt: skip
_TOOL_END = {"hermes": "</tool_call>", "r1": "<｜tool▁calls▁end｜>", "v31": "<｜tool▁calls▁end｜>",
             "kimi": "<|tool_calls_section_end|>"}  # fmt: skip


def _tool_block(fmt: str, calls: list[ToolCall] | tuple[ToolCall, ...]) -> str:
    """The tool-call text as each template renders an assistant turn with tool calls."""
    if fmt == "hermes":  # Qwen3 templates: `<tool_call>\n{"name": "N", "arguments": A}\n</tool_call>`, "\n"-joined
        return "\n".join(
            f'<tool_call>\n{{"name": "{c.name}", "arguments": {c.arguments}}}\n</tool_call>' for c in calls
        )
    if fmt == "r1":  # R1 template: `function` type + fenced json, calls joined by "\n"
        body = "\n".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{c.name}\n```json\n{c.arguments}\n```<｜tool▁call▁end｜>"
            for c in calls
        )
        return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"
    if fmt == "v31":  # V3.1 template: no type, no fence, no separator
        body = "".join(f"<｜tool▁call▁begin｜>{c.name}<｜tool▁sep｜>{c.arguments}<｜tool▁call▁end｜>" for c in calls)
        return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"
    if fmt == "kimi":  # K2-Thinking template render_toolcalls (checked by rendering: no whitespace)
        body = "".join(
            f"<|tool_call_begin|>{c.id}<|tool_call_argument_begin|>{c.arguments}<|tool_call_end|>" for c in calls
        )
        return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"
    raise ValueError(fmt)


def _assemble(spec: _Spec, reasoning: str | None, closed: bool, content: str, calls: list[ToolCall] | tuple) -> str:
    """Output text from its parts; the separator before a Qwen tool block belongs to ``content``."""
    text = ""
    if reasoning is not None:
        text += spec.start + reasoning + ("</think>" if closed else "")
    text += content
    if calls:
        text += _tool_block(spec.tools or "", calls)
    return text
