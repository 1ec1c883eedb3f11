"""Server emulators: what a given server returns for a case's raw generation.

Behaviour comes from ``reference/PARSERS.md`` (vLLM / SGLang parsers) and ``reference/OPENROUTER.md``, plus the
stored upstream files cited next to the code that relies on them.
"""

from __future__ import annotations

import hashlib
import json
import re

from tests.conformance.truth_cases import Case
from tests.conformance.truth_formats import _SPECS, _TOOL_END, _TOOL_START, ToolCall, _assemble, _Spec
from tests.conformance.truth_reference import NOLP_UPSTREAM, SERVERS
from tests.conformance.truth_tokenizers import truth_tokenizer

# ---- Server emulators (PARSERS.md / OPENROUTER.md) ---------------------------------------------------------------

# vLLM tool parsers (PARSERS.md; regexes as in the cited parser files). deepseek_v31 is the V3.1 analogue of
# deepseekv3 without type/fence (its file was not re-read: same content/raw-arguments semantics assumed).
_VLLM_CALL = {
    "r1": re.compile(
        r"<｜tool▁call▁begin｜>(?P<type>.*)<｜tool▁sep｜>(?P<name>.*)\n```json\n(?P<args>.*)\n```<｜tool▁call▁end｜>"
    ),
    "v31": re.compile(r"<｜tool▁call▁begin｜>(?P<name>.*?)<｜tool▁sep｜>(?P<args>.*?)<｜tool▁call▁end｜>"),
    "kimi": re.compile(
        r"<\|tool_call_begin\|>\s*(?P<id>[^<]+:\d+)\s*<\|tool_call_argument_begin\|>\s*"
        r"(?P<args>(?:(?!<\|tool_call_begin\|>).)*?)\s*<\|tool_call_end\|>",
        re.DOTALL,
    ),
}
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)  # vLLM hermes
_SGL_HERMES = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)  # SGLang Qwen25Detector


def _utf8_prefix(data: bytes) -> str:
    """Decoded text as an incremental detokenizer shows it: a trailing partial character is withheld."""
    for drop in range(4):
        try:
            return data[: len(data) - drop].decode("utf-8")
        except UnicodeDecodeError:
            continue
    raise ValueError("not UTF-8")


def _vllm_reasoning(spec: _Spec, thinking: bool, text: str) -> tuple[str | None, str]:
    if spec.vllm_reasoning is None or not thinking:
        return None, text  # qwen3 with enable_thinking=False, deepseek_v3 non-thinking: all content
    if spec.vllm_reasoning == "kimi_k2":  # kimi_k2_reasoning_parser.py @ 01a70348
        start = len("<think>") if text.find("<think>") == 0 else 0
        end = text.find("</think>")
        if end != -1:
            return text[start:end], text[end + len("</think>") :]
        section = text.find("<|tool_calls_section_begin|>")
        if section != -1:
            return text[start:section], text[section:]
        return text[start:], ""
    head, sep, tail = text.partition("<think>")  # BaseThinkingReasoningParser.extract_reasoning
    text = tail if sep else head
    if "</think>" not in text:
        return text, ""  # truncated: everything is reasoning
    reasoning, _, content = text.partition("</think>")
    return reasoning, content


def _vllm_tools(spec: _Spec, text: str, notes: list[str]) -> tuple[str, list[ToolCall]]:
    fmt = spec.tools or ""
    start = _TOOL_START[fmt]
    if start not in text:
        return text, []
    calls: list[ToolCall] = []
    if fmt == "hermes":  # hermes_tool_parser.py @ 00854322: arguments re-serialised
        try:
            for m in _HERMES.finditer(text):
                obj = json.loads(m.group(1) if m.group(1) is not None else m.group(2))
                args = json.dumps(obj["arguments"], ensure_ascii=False)
                calls.append(ToolCall(obj["name"], args, ""))
                if args not in (m.group(1) or m.group(2)):
                    notes.append("tool arguments re-serialised")
        except (json.JSONDecodeError, KeyError):
            return text, []  # vLLM returns the whole output as content on a parse error
    else:  # deepseekv3 @ 061b11dd / kimi_k2 @ 03d5dc96: raw arguments
        for m in _VLLM_CALL[fmt].finditer(text):
            cid = m.group("id") if fmt == "kimi" else ""
            name = cid.split(":")[0].split(".")[-1] if fmt == "kimi" else m.group("name")
            calls.append(ToolCall(name, m.group("args"), cid))
    _note_tail(fmt, text, notes)
    return text[: text.find(start)], calls


def _note_tail(fmt: str, text: str, notes: list[str]) -> None:
    end = text.rfind(_TOOL_END[fmt])
    if end != -1 and text[end + len(_TOOL_END[fmt]) :]:
        notes.append("text after the tool block dropped")


def _sglang_reasoning(spec: _Spec, thinking: bool, text: str, notes: list[str]) -> tuple[str | None, str]:
    # Old BaseReasoningFormatDetector.detect_and_parse (PARSERS.md "before PR #24251"): every <think> removed,
    # whole text .strip()ped, content .strip()ped; reasoning keeps whitespace before </think>.
    if spec.vllm_reasoning is None or not thinking or not (spec.sglang_force or "<think>" in text):
        return None, text
    processed = text.replace("<think>", "").strip()
    if processed != text.replace("<think>", ""):
        notes.append("whitespace stripped")
    if "</think>" not in processed:
        tool_start = _TOOL_START.get(spec.tools or "")
        if tool_start and tool_start in processed:
            idx = processed.find(tool_start)
            return processed[:idx].strip(), processed[idx:]
        return processed, ""
    reasoning, content = processed.split("</think>", 1)
    if content.strip() != content:
        notes.append("whitespace stripped")
    return reasoning, content.strip()


def _sglang_tools(spec: _Spec, text: str, notes: list[str]) -> tuple[str, list[ToolCall]]:
    fmt = spec.tools or ""
    idx = text.find(_TOOL_START[fmt])
    if idx == -1:
        return text, []
    calls: list[ToolCall] = []
    if fmt == "kimi":  # KimiK2Detector @ 0351c1fa: content not stripped, raw arguments
        for m in _VLLM_CALL["kimi"].finditer(text):
            calls.append(ToolCall(m.group("id").split(":")[0].split(".")[-1], m.group("args"), m.group("id")))
        _note_tail(fmt, text, notes)
        return text[:idx], calls
    # Qwen25Detector @ 0813438c, DeepSeekV3Detector @ 01967342 (V3.1 detector assumed alike): content before
    # the block .strip()ped, arguments json.loads + json.dumps(ensure_ascii=False).
    for m in (_SGL_HERMES if fmt == "hermes" else _VLLM_CALL[fmt]).finditer(text):
        body = m.group(1) if fmt == "hermes" else m.group("args")
        obj = json.loads(body)
        name, value = (obj["name"], obj["arguments"]) if fmt == "hermes" else (m.group("name"), obj)
        args = json.dumps(value, ensure_ascii=False)
        if args not in body:
            notes.append("tool arguments re-serialised")
        calls.append(ToolCall(name, args, ""))
    if text[:idx].strip() != text[:idx]:
        notes.append("whitespace stripped")
    _note_tail(fmt, text, notes)
    return text[:idx].strip(), calls


def emulate(case: Case, server: str) -> dict:
    """What ``server`` returns for ``case``, as plain data (see module doc and PARSERS.md / OPENROUTER.md)."""
    if server not in SERVERS:
        raise ValueError(f"unknown server {server!r}; one of {SERVERS}")
    spec, conv, tok = _SPECS[case.model], case.conversation, truth_tokenizer(case.model)
    # skip_special_tokens=True drops the end-of-turn (special=true everywhere here); every other added token is
    # kept (<think>, </think>, tool tokens: special=false in Qwen/DeepSeek; the Kimi fixture flags them true,
    # and we keep them as the brief prescribes, since kimi_k2 parsers need them to exist in the text).
    ids = case.output_ids[:-1] if case.finished else case.output_ids
    true_bytes = b"".join(tok.token_bytes(t) for t in ids)
    text = _utf8_prefix(true_bytes)
    notes: list[str] = []
    if len(text.encode()) != len(true_bytes):
        notes.append("trailing partial character withheld")
    thinking = conv.thinking
    upstream = NOLP_UPSTREAM.get(server, server)
    if upstream == "sglang-strip":
        reasoning, content = _sglang_reasoning(spec, thinking, text, notes)
        content, calls = _sglang_tools(spec, content, notes) if conv.tools_sent else (content, [])
        ids_prefix = "call_"
    else:
        reasoning, content = _vllm_reasoning(spec, thinking, text)
        content, calls = _vllm_tools(spec, content, notes) if conv.tools_sent else (content, [])
        ids_prefix = "chatcmpl-tool-"
    finish = "length" if not case.finished else ("tool_calls" if calls else "stop")
    tool_calls = [
        {"id": c.id or ids_prefix + hashlib.sha256(f"{conv.name}:{k}".encode()).hexdigest()[:24], "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}}
        for k, c in enumerate(calls)
    ]  # fmt: skip
    logprobs = None
    if server == "openrouter":  # OpenAI-style logprobs: token text + exact bytes, end-of-turn omitted
        logprobs = [
            {"token": tok.token_bytes(t).decode("utf-8", errors="replace"), "bytes": list(tok.token_bytes(t))}
            for t in ids
        ]
    response = {
        "reasoning": reasoning or "",
        "content": content or "",
        "tool_calls": tool_calls,
        "finish_reason": finish,
        # completion_tokens counts every generated id, the end-of-turn included when the answer finished
        "usage": {"prompt_tokens": len(case.prompt_ids), "completion_tokens": len(case.output_ids)},
        "logprobs": logprobs,
        "prompt_token_ids": list(case.prompt_ids) if server == "vllm" else None,
        "tools_sent": conv.tools_sent,
    }
    # Lossy = the raw text cannot be reassembled from the text fields (logprobs are not consulted).
    lossy = reassemble(case, response).encode() != true_bytes
    response["lossy"] = lossy
    response["lossy_why"] = (
        "; ".join(dict.fromkeys(notes or ["fields do not reassemble the raw text"])) if lossy else ""
    )
    return response


def reassemble(case: Case, response: dict) -> str:
    """The raw output text (end-of-turn excluded) rebuilt from a response's fields and the model's format."""
    spec = _SPECS[case.model]
    calls = [ToolCall(c["function"]["name"], c["function"]["arguments"], c["id"]) for c in response["tool_calls"]]
    parsed_reasoning = spec.vllm_reasoning is not None and case.conversation.thinking
    closed = bool(response["content"]) or bool(calls) or response["finish_reason"] != "length"
    reasoning = response["reasoning"] if parsed_reasoning else None
    return _assemble(spec, reasoning, closed, response["content"], calls)
