"""Conversations: seeded plans of what we send and what the model generates now."""

from __future__ import annotations

import copy
import hashlib
import json
import random
import unicodedata
from dataclasses import dataclass, field

from tests.conformance.truth_formats import _SPECS, _TOOL_START, ToolCall, _assemble, _Spec
from tests.conformance.truth_tokenizers import TruthTokenizer, truth_tokenizer

# ---- Conversations -----------------------------------------------------------------------------------------------

_WORDS = (
    "draft", "token", "verify", "accept", "stream", "batch", "cache", "prefix", "speculate", "model", "answer",
    "because", "then", "so", "the", "a", "of", "and", "to", "in", "we", "check", "count", "split", "reason",
    "Kafka", "it's", "don't", "x=3", "2+2=4", "v0.9.1", "(see", "below)", "—", "50%", "#tag", "naïve", "q&a",
)  # fmt: skip
_UNICODE = {
    "cjk": ("你好世界", "推理模型", "東京タワー", "한국어"),
    "emoji": ("🙂", "🚀", "👍🏽", "🇯🇵", "❤️"),
    "combining": ("e\u0301", "n\u0303", "a\u0308\u0301"),  # decomposed: not NFC
    "ohm": ("\u2126",),  # OHM SIGN, NFC -> U+03A9
    "nfc_variant": ("\u212b", "Cafe\u0301", "\u1e9b\u0323"),  # ANGSTROM SIGN, decomposed é, long s with dots
}
_UNI = tuple(_UNICODE)
_WS = ("leading_space", "leading_newline", "trailing_newlines", "triple_newline", "tab", "dot_newline_end",
       "trailing_space")  # fmt: skip

_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city (°C).",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. 東京"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the project docs.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["query"]}}},
]  # fmt: skip
# Key order = vLLM's pydantic `model_dump()` order (type, function{name, description, parameters}) with every
# field present, so the tools a server hands the template serialise identically to the ones we send.


@dataclass
class Generation:
    """What the model generates now: ``raw`` is the exact text, end-of-turn included."""

    raw: str
    reasoning: str | None
    content: str
    calls: tuple[ToolCall, ...] = ()
    tail: str = ""  # text the model wrote after its tool block


@dataclass
class Conversation:
    """One request: exactly the messages we send (never any reasoning_content) plus the model's generation."""

    name: str
    messages: list[dict]
    tools: list[dict] | None
    tools_sent: bool
    kwargs: dict
    max_tokens: int
    features: set[str]
    thinking: bool
    generation: Generation
    history_reasoning: dict[int, str] = field(default_factory=dict)  # reasoning earlier turns had; not sent


class _Writer:
    """Random prose with tricky whitespace and Unicode; records the features it used."""

    def __init__(self, rng: random.Random, feats: set[str]) -> None:
        self.rng, self.feats = rng, feats

    def prose(self, where: str, uni: tuple[str, ...] = (), ws: str | None = None, words: tuple[int, int] = (5, 14)):
        rng = self.rng
        parts = [rng.choice(_WORDS) for _ in range(rng.randint(*words))]
        for k in range(2, len(parts) - 1, rng.randint(4, 7)):
            parts[k] += rng.choice((".", ",", "?", ":"))
        for kind in uni:
            parts.insert(rng.randint(0, len(parts)), rng.choice(_UNICODE[kind]))
            self.feats.add(f"uni:{kind}")
        text = " ".join(parts)
        text = text[0].upper() + text[1:] + "."
        if ws:
            text = self.whitespace(text, ws)
        if unicodedata.normalize("NFC", text) != text:
            self.feats.add(f"non_nfc_{where}")
        return text

    def whitespace(self, text: str, kind: str) -> str:
        self.feats.add(f"ws:{kind}")
        cut = text.find(" ", len(text) // 2)
        cut = cut if cut > 0 else len(text) // 2
        return {
            "leading_space": " " + text,
            "leading_newline": "\n" + text,
            "trailing_newlines": text + "\n\n",
            "triple_newline": text[:cut] + "\n\n\n" + text[cut:].lstrip(" "),
            "tab": text[:cut] + "\t" + text[cut:],
            "dot_newline_end": text.rstrip(".") + ".\n",
            "trailing_space": text + " ",
        }[kind]


def _args(rng: random.Random, name: str, writer: _Writer) -> dict:
    if name == "get_weather":
        return {"city": rng.choice(("Paris", "東京", "Zürich", "São Paulo", "Ohm \u2126 town")), "unit": "celsius"}
    return {"query": writer.prose("output", (rng.choice(_UNI),), words=(2, 4)), "limit": rng.randint(1, 5)}


def _args_text(args: dict, style: str) -> str:
    if style == "compact":
        return json.dumps(args, ensure_ascii=False, separators=(",", ":"))
    if style == "ascii":
        return json.dumps(args)  # \uXXXX escapes
    return json.dumps(args, ensure_ascii=False)  # == what re-serialising parsers produce


@dataclass(frozen=True)
class _Scenario:
    system: bool = True
    history: int = 0  # earlier user/assistant exchanges
    hist_tools: bool = False  # the first earlier exchange has a tool round (assistant tool calls + results)
    tools_sent: bool = False
    calls: int = 0  # tool calls in the answer (only when tools are sent)
    args: str = "canonical"  # how the model writes the answer's arguments
    content_empty: bool = False
    tail: bool = False  # text after the tool block (hermes only)
    after_tool: bool = False  # the request ends with tool results
    thinking_off: bool = False  # only where the template has a thinking switch
    truncate: str | None = None  # "reasoning" | "content" | "content-mid-char"


# Sixteen request shapes, cycled by the conversation index; model capabilities then drop what does not apply.
_SCENARIOS = (
    _Scenario(),
    _Scenario(system=False, history=1, tools_sent=True, calls=1),
    _Scenario(history=2, hist_tools=True),
    _Scenario(truncate="reasoning"),
    _Scenario(history=1, thinking_off=True),
    _Scenario(system=False, tools_sent=True, calls=2, args="compact", content_empty=True),
    _Scenario(history=1, tools_sent=True, after_tool=True),
    _Scenario(history=2, truncate="content-mid-char"),
    _Scenario(system=False, history=1, hist_tools=True, thinking_off=True, truncate="content"),
    _Scenario(tools_sent=True, calls=1, args="ascii", tail=True),
    _Scenario(history=2, thinking_off=True, tools_sent=True, calls=1),
    _Scenario(history=1, tools_sent=True, truncate="reasoning"),
    _Scenario(system=False, history=2, hist_tools=True, tools_sent=True, after_tool=True, thinking_off=True),
    _Scenario(thinking_off=True, tools_sent=True, calls=2, content_empty=True),
    _Scenario(history=1, truncate="content"),
    _Scenario(history=2, hist_tools=True, tools_sent=True, calls=1, args="compact", thinking_off=True),
)


def conversations(model: str, n: int = 32, seed: int = 0) -> list[Conversation]:
    """``n`` deterministic conversations for ``model`` (request shapes cycle through ``_SCENARIOS``)."""
    return [_conversation(model, i, random.Random(f"{model}:{seed}:{i}"), seed) for i in range(n)]


def _conversation(model: str, i: int, rng: random.Random, seed: int) -> Conversation:
    spec, tok, sc = _SPECS[model], truth_tokenizer(model), _SCENARIOS[i % len(_SCENARIOS)]
    feats: set[str] = set()
    w = _Writer(rng, feats)
    kimi = spec.tools == "kimi"
    counter = 0  # Kimi tool-call ids are `functions.{name}:{global index}`

    has_tools = spec.tools is not None and (sc.hist_tools or sc.tools_sent or sc.after_tool)
    thinking, kwargs = spec.thinks, {}
    if spec.thinking_kwarg:
        # V3.1 has no tool calling in thinking mode: its tool shapes run non-thinking.
        thinking = not (sc.thinking_off or (spec.tools_need_thinking_off and has_tools))
        if spec.thinking_kwarg == "thinking" or not thinking:  # V3.1's template defaults to non-thinking
            kwargs[spec.thinking_kwarg] = thinking
        if not thinking:
            feats.add("thinking_off")
    tools_ok = spec.tools is not None
    tools_sent = tools_ok and sc.tools_sent
    after_tool = tools_ok and sc.after_tool and spec.after_tool_ok
    hist_tools = tools_ok and sc.hist_tools and sc.history > 0
    n_calls = sc.calls if tools_sent and not after_tool else 0

    def new_calls(count: int, style: str) -> tuple[ToolCall, ...]:
        nonlocal counter
        calls = []
        for k in range(count):
            name = _TOOLS[(i + k) % 2]["function"]["name"]
            digest = hashlib.sha256(f"{model}:{seed}:{i}:{counter}".encode()).hexdigest()[:12]
            cid = f"functions.{name}:{counter}" if kimi else f"call_{digest}"
            counter += 1
            calls.append(ToolCall(name, _args_text(_args(rng, name, w), style), cid))
        return tuple(calls)

    def sent_calls(calls: tuple[ToolCall, ...]) -> list[dict]:
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]

    def tool_results(calls: tuple[ToolCall, ...]) -> list[dict]:
        out = []
        for c in calls:
            note = w.prose("prompt", (rng.choice(_UNI),), words=(2, 5))
            msg = {
                "role": "tool",
                "tool_call_id": c.id,
                "content": json.dumps({"ok": True, "note": note}, ensure_ascii=False),
            }
            if rng.random() < 0.3:
                msg["name"] = c.name
                feats.add("tool_msg_name")
            out.append(msg)
        return out

    def user_text(k: int) -> str:
        text = w.prose("prompt", (_UNI[(i + k + 1) % 5],), _WS[(i + k + 5) % 7] if rng.random() < 0.5 else None)
        if model == "user-addedtok" and rng.random() < 0.6:
            text += "\n\n" + w.prose("prompt", words=(3, 6)) + " <br> ok"
        return text

    messages: list[dict] = []
    hist_reasoning: dict[int, str] = {}
    if sc.system:
        messages.append(
            {"role": "system", "content": w.prose("prompt", words=(4, 9), ws=_WS[i % 7] if i % 3 == 0 else None)}
        )
        feats.add("system")
    else:
        feats.add("no_system")
    for turn in range(sc.history):
        feats.add("multi_turn")
        messages.append({"role": "user", "content": user_text(turn)})
        if hist_tools and turn == 0:
            feats.add("history_tool_calls")
            style = "compact" if i % 2 else "canonical"
            if style == "compact":
                feats.add("history_args_noncanonical")
            calls = new_calls(1 + i % 2, style)
            # draftstream's requests always carry content as a string: "" for a tool-call turn
            # without text (schemas.wire_messages), so that is what the server renders.
            content = "" if rng.random() < 0.5 else w.prose("prompt", words=(3, 6))
            messages.append({"role": "assistant", "content": content, "tool_calls": sent_calls(calls)})
            messages += tool_results(calls)
        content = w.prose("prompt", (rng.choice(_UNI),))
        if spec.thinks and rng.random() < 0.4:
            content = "\n\n" + content  # a vLLM content field keeps the "\n\n" after </think>
            feats.add("history_content_leading_newlines")
        if spec.thinks:
            hist_reasoning[len(messages)] = w.prose("prompt")
            feats.add("history_reasoning_dropped")
        messages.append({"role": "assistant", "content": content})
    messages.append({"role": "user", "content": user_text(sc.history)})
    if after_tool:
        feats.add("after_tool_result")
        calls = new_calls(1, "canonical")
        messages.append({"role": "assistant", "content": "", "tool_calls": sent_calls(calls)})
        messages += tool_results(calls)
        if model == "deepseek-v3.1":
            thinking = False  # the V3.1 template opens no assistant turn after a tool result: output is content
    if tools_sent:
        feats.add("tools_sent")
    elif hist_tools or after_tool:
        feats.add("history_tools_without_tools_sent")

    # ---- the generation
    reasoning_words = None
    if spec.thinks and thinking:
        reasoning_words = w.prose("output", (_UNI[(i + 2) % 5],), _WS[(i + 3) % 7], words=(8, 20))
    calls = ()
    if n_calls:
        feats.add("tool_call_answer")
        if sc.args != "canonical":
            feats.add("args_noncanonical")
        calls = new_calls(n_calls, sc.args)
        if n_calls > 1:
            feats.add("multi_tool_calls")
    if calls and sc.content_empty:
        content_words = ""
        feats.add("content_empty")
    else:
        content_words = w.prose("output", (_UNI[i % 5],), _WS[i % 7])
        if model == "user-addedtok":
            content_words += "\n\n" + w.prose("output", (_UNI[(i + 3) % 5],)) + ("<br>" if i % 2 == 0 else "")
        if content_words.startswith(" "):
            feats.add("content_leading_space")
    tail = ""
    if spec.tools == "hermes" and calls and sc.tail:
        tail = "\n" + w.prose("output", words=(2, 4))
        feats.add("text_after_tools")
    reasoning = None if reasoning_words is None else spec.r_wrap[0] + reasoning_words + spec.r_wrap[1]
    content = (spec.c_pre if reasoning is not None else "") + content_words
    if calls and spec.tools == "hermes" and content_words:
        content += "\n"  # the template writes "\n" before the first <tool_call> only after non-empty content
    raw = _assemble(spec, reasoning, True, content, calls) + tail + tok.eot
    if model == "user-addedtok":
        for text, tag in (("\n\n", "added_tok_nn"), ("<br>", "added_tok_br")):
            if text in raw:
                feats.add(tag)
    gen = Generation(raw, reasoning, content, calls, tail)

    full = tok.encode_output(raw)
    max_tokens = len(full) + 64
    if sc.truncate:
        max_tokens = _choose_cut(tok, spec, gen, full, sc.truncate, i, feats)
    tools = copy.deepcopy(_TOOLS) if tools_ok else None
    name = f"{model}/{seed}/{i}"
    return Conversation(name, messages, tools, tools_sent, kwargs, max_tokens, feats, thinking, gen, hist_reasoning)


def _choose_cut(
    tok: TruthTokenizer, spec: _Spec, gen: Generation, ids: list[int], where: str, i: int, feats: set[str]
) -> int:
    """A max_tokens that stops inside the reasoning or the content (never inside a tool block)."""
    end = ids.index(tok.token_id("</think>")) if gen.reasoning is not None else -1
    limit = ids.index(tok.token_id(_TOOL_START[spec.tools or ""])) if gen.calls else len(ids) - 1
    first = len(tok.encode_output(spec.start)) + 1  # keep at least one id after an emitted <think>
    in_reasoning = where == "reasoning" and end > 0
    lo, hi = (first, end) if in_reasoning else (end + 2, limit)
    if lo > hi and end > 0:  # content too short to cut inside: cut the reasoning instead
        in_reasoning, lo, hi = True, first, end

    def clean(cut: int) -> bool:
        try:
            b"".join(tok.token_bytes(t) for t in ids[:cut]).decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    candidates = range(lo, hi + 1)
    want_mid = where == "content-mid-char"
    chosen = [c for c in candidates if clean(c) != want_mid] or [c for c in candidates if clean(c)]
    cut = chosen[(i * 7919) % len(chosen)]
    feats |= {"truncated", "truncated_in_reasoning" if in_reasoning else "truncated_in_content"}
    if not clean(cut):
        feats.add("truncated_mid_char")
    return cut
