"""The simulator's pure core: request parsing, deterministic generation, faults, response bodies.

Nothing here touches the network, the clock or the environment. Generation is a function
of the prompt (a hash of ``messages`` and ``tools``) and the seed, so a retry of the same
prompt sees the same answer and the same content faults, while transient faults are drawn
from an RNG the caller owns.

The ground truth follows the way reconstruction rebuilds a sample: the model's ids are
``encode(reasoning + THINK_END + content + render_tool_calls(calls) + END_OF_TURN)`` in one
call. We build that full text, encode it once, and split the *text* into the response
fields, so the joint encoding is the truth by construction.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import msgspec

from schemas import Message, ToolCall, ToolFunction

__all__ = [
    "CONTENT_FAULTS",
    "TRANSIENT_FAULTS",
    "ChatRequest",
    "Generation",
    "GenerationParams",
    "ProfileLike",
    "RequestError",
    "build_response_body",
    "choose_content_faults",
    "choose_transient_fault",
    "error_body",
    "generate",
    "noncanonical_same_length",
    "noncanonical_split",
    "parse_fault_header",
    "parse_request",
    "prompt_digest",
    "usage_counts",
]

TRANSIENT_FAULTS: Final = ("429", "5xx", "timeout", "drop", "malformed", "error_in_200")
CONTENT_FAULTS: Final = ("truncate", "empty_reasoning", "bad_usage", "noncanonical_len", "noncanonical_same")
# How far off a bad_usage response's completion_tokens is (at least).
BAD_USAGE_OFFSET: Final = 1000


class ProfileLike(Protocol):
    """The part of ``services.profiles.Profile`` the simulator uses."""

    @property
    def name(self) -> str:
        """Profile name."""

    @property
    def end_of_turn(self) -> str:
        """End-of-turn token string."""

    @property
    def end_of_turn_id(self) -> int:
        """End-of-turn token id."""

    @property
    def think_end(self) -> str | None:
        """Think-end token string."""

    @property
    def think_end_id(self) -> int | None:
        """Think-end token id."""

    @property
    def tool_tokens(self) -> dict[str, int]:
        """Tool-call special tokens by string."""

    def encode(self, text: str) -> list[int]:
        """Encode with special tokens parsed, no BOS."""

    def decode(self, ids: list[int]) -> str:
        """Decode ids, specials kept as text."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for."""

    def id_of_bytes(self, data: bytes) -> int | None:
        """The id of the vocab entry with exactly these bytes."""

    def render_tool_calls(self, calls: Sequence[ToolCall]) -> str:
        """Native text of structured tool calls."""

    def render_output(
        self,
        *,
        reasoning: str,
        content: str,
        tool_calls: Sequence[ToolCall] = (),
        finished: bool = True,
        reasoning_closed: bool = True,
    ) -> str:
        """``reasoning + THINK_END + content + native tool calls + END_OF_TURN``."""


class RequestError(ValueError):
    """A request the simulator refuses (HTTP 400), like a real provider would."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ChatRequest:
    """The parts of an OpenAI chat-completions body the simulator looks at."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    tool_choice: Any = None


@dataclass(frozen=True)
class GenerationParams:
    """Generation knobs (a subset of the simulator options)."""

    seed: int = 0
    reasoning_tokens: tuple[int, int] = (40, 200)
    content_tokens: tuple[int, int] = (20, 120)
    count_end_of_turn: bool = True
    count_think_end: bool = True
    price_per_token: float = 2e-6
    prompt_price_per_token: float = 0.0


@dataclass
class Generation:
    """One generated answer: the response fields and the model's true ids."""

    reasoning: str
    content: str
    tool_calls: list[ToolCall]
    true_ids: list[int]
    canonical_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    faults: list[str] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- request parsing


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    raise RequestError(f"message content must be a string or a list of parts, not {type(content).__name__}")


def parse_request(body: bytes) -> ChatRequest:
    """Parse and validate a chat-completions request body; raises :class:`RequestError`."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    clean: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'")
        clean.append({**message, "content": _message_text(message.get("content"))})
    tools = data.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RequestError("'tools' must be a list of objects")
    max_tokens = data.get("max_tokens", data.get("max_completion_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise RequestError("'max_tokens' must be a positive integer")
    top = data.get("top_logprobs") or 0
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20:
        raise RequestError("'top_logprobs' must be an integer in 0..20")
    model = data.get("model") or "simulator/model"
    if not isinstance(model, str):
        raise RequestError("'model' must be a string")
    return ChatRequest(
        model=model,
        messages=clean,
        tools=tools or None,
        max_tokens=max_tokens,
        logprobs=bool(data.get("logprobs")),
        top_logprobs=top,
        tool_choice=data.get("tool_choice"),
    )


def parse_fault_header(value: str | None) -> list[str]:
    """Names in an ``X-Simulator-Fault`` header; raises :class:`RequestError` on unknown ones."""
    if not value:
        return []
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in TRANSIENT_FAULTS and n not in CONTENT_FAULTS]
    if unknown:
        raise RequestError(f"unknown simulator fault(s) {unknown}; known: {list(TRANSIENT_FAULTS + CONTENT_FAULTS)}")
    return names


# ---------------------------------------------------------------- determinism


def prompt_digest(request: ChatRequest) -> bytes:
    """A stable hash of what the model sees: messages, tools and whether tools were sent."""
    canon = json.dumps(
        {"messages": request.messages, "tools": request.tools},
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.blake2b(canon.encode("utf-8"), digest_size=16).digest()


def _unit(digest: bytes, seed: int, label: str) -> float:
    """A deterministic number in [0, 1) for (prompt, seed, label)."""
    h = hashlib.blake2b(digest + seed.to_bytes(8, "little", signed=True) + label.encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") / 2**64


def choose_content_faults(digest: bytes, seed: int, rates: Mapping[str, float]) -> list[str]:
    """Content faults that hit this prompt: decided by its hash, so a retry reproduces them."""
    return [name for name in CONTENT_FAULTS if rates.get(name, 0.0) > 0 and _unit(digest, seed, name) < rates[name]]


def choose_transient_fault(rng: random.Random, rates: Mapping[str, float]) -> str | None:
    """At most one transient fault for this request, drawn from the caller's seeded RNG."""
    hit = None
    for name in TRANSIENT_FAULTS:
        # One draw per fault, always, so the sequence does not depend on earlier outcomes.
        if rng.random() < rates.get(name, 0.0) and hit is None:
            hit = name
    return hit


# ---------------------------------------------------------------- text generation

_WORDS: Final = (
    "the of and to in is that for it as with was on be by this are at from or an which but not have "
    "we can if so then there more its one all when also into value result step number model token "
    "function data answer check first second next case since because therefore however consider "
    "approach compute sum list order simple example equation solve given total assume thus note "
    "string array index loop count error test input output prime factor square root matrix vector"
).split()
_UNICODE: Final = (
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
_CODE: Final = (
    "`x = f(3)`",
    "`len(items)`",
    "`a[i] += 1`",
    "`return None`",
    "`{}`",
    "`i < n`",
    "\n```python\ndef area(r):\n    return 3.14159 * r ** 2\n```\n",
    "\n```js\nconst sum = xs.reduce((a, b) => a + b, 0);\n```\n",
)
_PUNCT: Final = (",", ",", ";", ":", " -", "!", "?")
_OPENERS: Final = ("Let me think.", "Okay, so", "First,", "Hmm,", "Wait,", "Now", "So")


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
            word = rng.choice(_OPENERS) if reasoning and rng.random() < 0.3 else rng.choice(_WORDS).capitalize()
            cost = 2
        elif roll < 0.70:
            word, cost = rng.choice(_WORDS), 1
        elif roll < 0.82:
            word, cost = _number(rng), 2
        elif roll < 0.91:
            word, cost = rng.choice(_UNICODE), 2
        elif roll < 0.95:
            word = rng.choice(_CODE)
            cost = max(3, len(word) // 4)
        else:
            word, cost = rng.choice(_WORDS) + rng.choice(_PUNCT), 2
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


def _sized_text(profile: ProfileLike, rng: random.Random, bounds: tuple[int, int], reasoning: bool) -> str:
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


def _offered_tools(request: ChatRequest) -> list[tuple[str, dict[str, Any]]]:
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
    words = [rng.choice(_WORDS) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.2:
        words.append(rng.choice(_UNICODE))
    return " ".join(words)


def _tool_call(rng: random.Random, digest: bytes, tools: list[tuple[str, dict[str, Any]]]) -> ToolCall:
    name, params = tools[rng.randrange(len(tools))]
    props = params.get("properties") if isinstance(params.get("properties"), dict) else None
    if props:
        args = {key: _argument_value(rng, schema) for key, schema in props.items()}
    else:
        args = {"query": _argument_value(rng, {"type": "string"})}
    return ToolCall(
        id=f"call_{digest.hex()[:24]}",
        function=ToolFunction(name=name, arguments=json.dumps(args, ensure_ascii=False)),
    )


# ---------------------------------------------------------------- non-canonical ids


def _special_ids(profile: ProfileLike) -> set[int]:
    ids = set(profile.tool_tokens.values()) | {profile.end_of_turn_id}
    if profile.think_end_id is not None:
        ids.add(profile.think_end_id)
    return ids


def _plain_id(profile: ProfileLike, data: bytes, specials: set[int]) -> int | None:
    token_id = profile.id_of_bytes(data)
    if token_id is None or token_id in specials or profile.token_bytes(token_id) != data:
        return None
    return token_id


def noncanonical_split(profile: ProfileLike, ids: list[int], rng: random.Random) -> list[int] | None:
    """``ids`` with one token replaced by two smaller ones of the same bytes (one id longer)."""
    specials = _special_ids(profile)
    start = rng.randrange(len(ids)) if ids else 0
    for step in range(len(ids)):
        pos = (start + step) % len(ids)
        if ids[pos] in specials:
            continue
        data = profile.token_bytes(ids[pos])
        for cut in range(1, len(data)):
            left = _plain_id(profile, data[:cut], specials)
            right = _plain_id(profile, data[cut:], specials) if left is not None else None
            if left is not None and right is not None:
                return [*ids[:pos], left, right, *ids[pos + 1 :]]
    return None


def _resplit(profile: ProfileLike, ids: list[int], pos: int, width: int, specials: set[int]) -> list[int] | None:
    """Another split of ``ids[pos:pos+width]`` into ``width`` plain tokens with the same bytes."""
    window = ids[pos : pos + width]
    if any(i in specials for i in window):
        return None
    joined = b"".join(profile.token_bytes(i) for i in window)

    def splits(start: int, left: int) -> Iterator[list[int]]:
        if left == 1:
            last = _plain_id(profile, joined[start:], specials)
            if last is not None:
                yield [last]
            return
        for cut in range(start + 1, len(joined) - left + 2):
            head = _plain_id(profile, joined[start:cut], specials)
            if head is not None:
                for rest in splits(cut, left - 1):
                    yield [head, *rest]

    return next((split for split in splits(0, width) if split != window), None)


def noncanonical_same_length(profile: ProfileLike, ids: list[int], rng: random.Random) -> list[int] | None:
    """``ids`` with adjacent tokens re-split at other byte boundaries (same length, same text).

    Tries pairs first (one adjacent pair re-split), then triples.
    """
    specials = _special_ids(profile)
    for width in (2, 3):
        if len(ids) < width:
            return None
        start = rng.randrange(len(ids) - width + 1)
        for step in range(len(ids) - width + 1):
            pos = (start + step) % (len(ids) - width + 1)
            changed = _resplit(profile, ids, pos, width, specials)
            if changed is not None:
                return [*ids[:pos], *changed, *ids[pos + width :]]
    return None


# ---------------------------------------------------------------- generation


def usage_counts(profile: ProfileLike, true_ids: Sequence[int], params: GenerationParams) -> tuple[int, int]:
    """(completion_tokens, reasoning_tokens) of true ids under the counting convention."""
    completion = len(true_ids)
    if not params.count_end_of_turn and true_ids and true_ids[-1] == profile.end_of_turn_id:
        completion -= 1
    think_end_id = profile.think_end_id
    if think_end_id is not None and think_end_id in true_ids:
        reasoning = list(true_ids).index(think_end_id)
        if not params.count_think_end:
            completion -= list(true_ids).count(think_end_id)
    else:
        reasoning = len(true_ids)
    return completion, reasoning


def _split_decoded(profile: ProfileLike, ids: list[int]) -> tuple[str, str]:
    """(reasoning, content) text of a cut id sequence, split at the think-end token."""
    think_end_id = profile.think_end_id
    if think_end_id is not None and think_end_id in ids:
        i = ids.index(think_end_id)
        return profile.decode(ids[:i]), profile.decode(ids[i + 1 :])
    return profile.decode(ids), ""


def generate(
    profile: ProfileLike,
    request: ChatRequest,
    params: GenerationParams,
    *,
    content_faults: Sequence[str] = (),
    prompt_tokens: int = 0,
) -> Generation:
    """The deterministic answer to ``request``, with its true ids and the given content faults."""
    if profile.think_end is None or profile.think_end_id is None:
        raise RequestError(f"profile {profile.name} has no think-end token: cannot simulate reasoning", 500)
    digest = prompt_digest(request)
    rng = random.Random(int.from_bytes(digest, "little") ^ params.seed)  # noqa: S311 - not crypto
    faults = [f for f in CONTENT_FAULTS if f in content_faults]

    reasoning = "" if "empty_reasoning" in faults else _sized_text(profile, rng, params.reasoning_tokens, True)
    tools = _offered_tools(request)
    calls = [_tool_call(rng, digest, tools)] if tools else []
    content_range = (3, 15) if calls else params.content_tokens
    content_text = _sized_text(profile, rng, content_range, False)
    rendered = profile.render_tool_calls(calls) if calls else ""
    # Exactly the text reconstruction encodes: the joint encoding is the truth by construction.
    full = profile.render_output(reasoning=reasoning, content=content_text, tool_calls=calls)
    canonical = profile.encode(full)
    true_ids = list(canonical)
    finish = "tool_calls" if calls else "stop"
    fallbacks: list[str] = []

    # The response text fields, exactly as a provider strips THINK_END and END_OF_TURN.
    out_reasoning, out_content = reasoning, content_text
    out_calls = calls
    if not request.tools and calls:
        out_content, out_calls = content_text + rendered, []

    cut: int | None = None
    if "truncate" in faults:
        n_reasoning = true_ids.index(profile.think_end_id)
        if n_reasoning >= 2:
            cut = rng.randint(1, n_reasoning - 1)  # strictly inside the reasoning: no think-end
        else:  # nothing to cut inside: stop right before the think-end
            cut = max(1, n_reasoning)
    if request.max_tokens is not None and len(true_ids) > request.max_tokens:
        cut = request.max_tokens if cut is None else min(cut, request.max_tokens)
    if cut is not None:
        true_ids = true_ids[:cut]
        canonical = true_ids[:]
        out_reasoning, out_content = _split_decoded(profile, true_ids)
        out_calls = []
        finish = "length"

    if "noncanonical_len" in faults:
        changed = noncanonical_split(profile, true_ids, rng)
        if changed is None:
            fallbacks.append("noncanonical_len")
        else:
            true_ids = changed
    if "noncanonical_same" in faults:
        changed = noncanonical_same_length(profile, true_ids, rng)
        if changed is None:
            fallbacks.append("noncanonical_same")
        else:
            true_ids = changed

    completion, reasoning_tokens = usage_counts(profile, true_ids, params)
    if "bad_usage" in faults:
        completion += max(BAD_USAGE_OFFSET, len(true_ids))
    return Generation(
        reasoning=out_reasoning,
        content=out_content,
        tool_calls=out_calls,
        true_ids=true_ids,
        canonical_ids=canonical,
        finish_reason=finish,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        reasoning_tokens=reasoning_tokens,
        faults=faults,
        fallbacks=fallbacks,
    )


def prompt_text_fallback(request: ChatRequest) -> str:
    """A plain rendering of the prompt, for token counting when a profile has no chat template."""
    return "".join(f"{m.get('role', '')}: {m.get('content', '')}\n" for m in request.messages)


def request_messages(request: ChatRequest) -> list[Message]:
    """The request's messages as schema Messages (what reconstruction renders the prompt from)."""
    out = []
    for m in request.messages:
        try:
            out.append(msgspec.convert(m, Message))
        except msgspec.ValidationError:  # an odd role or field: keep what a template needs
            role = m.get("role")
            if role in ("system", "user", "assistant", "tool"):
                out.append(Message(role=role, content=m.get("content") or ""))
    return out


# ---------------------------------------------------------------- response bodies


def _logprobs(profile: ProfileLike, ids: list[int], digest: bytes, seed: int, top: int) -> dict[str, Any]:
    rng = random.Random(int.from_bytes(digest, "big") ^ (seed + 7919))  # noqa: S311 - not crypto
    content = []
    for token_id in ids:
        data = profile.token_bytes(token_id)
        logprob = -round(rng.expovariate(4.0), 5)
        entry: dict[str, Any] = {
            "token": data.decode("utf-8", errors="replace"),
            "bytes": list(data),
            "logprob": logprob,
        }
        entry["top_logprobs"] = [{"token": entry["token"], "bytes": entry["bytes"], "logprob": logprob}][:top]
        content.append(entry)
    return {"content": content, "refusal": None}


def build_response_body(
    profile: ProfileLike,
    generation: Generation,
    request: ChatRequest,
    params: GenerationParams,
    *,
    provider: str,
    response_id: str,
    created: int,
    logprobs: bool,
    debug_true_ids: bool,
) -> dict[str, Any]:
    """The OpenRouter-shaped JSON body for one generation."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": generation.content,
        "refusal": None,
        "reasoning": generation.reasoning or None,
    }
    if generation.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "index": i,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for i, call in enumerate(generation.tool_calls)
        ]
    choice: dict[str, Any] = {
        "index": 0,
        "logprobs": None,
        "finish_reason": generation.finish_reason,
        "native_finish_reason": generation.finish_reason,
        "message": message,
    }
    if logprobs:
        choice["logprobs"] = _logprobs(
            profile, generation.true_ids, prompt_digest(request), params.seed, request.top_logprobs
        )
    cost = (
        generation.completion_tokens * params.price_per_token + generation.prompt_tokens * params.prompt_price_per_token
    )
    body: dict[str, Any] = {
        "id": response_id,
        "provider": provider,
        "model": request.model,
        "object": "chat.completion",
        "created": created,
        "choices": [choice],
        "usage": {
            "prompt_tokens": generation.prompt_tokens,
            "completion_tokens": generation.completion_tokens,
            "total_tokens": generation.prompt_tokens + generation.completion_tokens,
            "cost": round(cost, 12),
            "completion_tokens_details": {"reasoning_tokens": generation.reasoning_tokens},
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    if debug_true_ids:
        body["debug_true_ids"] = generation.true_ids
    return body


def error_body(code: int, message: str) -> dict[str, Any]:
    """An OpenRouter-style error object."""
    return {"error": {"code": code, "message": message}}
