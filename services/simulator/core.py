"""The simulator's pure core: request parsing, deterministic generation, faults, response bodies.

Nothing here touches the network, the clock or the environment. Generation is a function
of the prompt (a hash of ``messages`` and ``tools``) and the seed, so a retry of the same
prompt sees the same answer and the same content faults, while transient faults are drawn
from an RNG the caller owns.

The ground truth is built the way a model produces it, independently of reconstruction:
the simulator writes the RAW text the model would generate, in the model's own format
(think block, native tool-call syntax, end-of-turn; see :func:`write_raw_output`), and the
true ids are the tokenizer's encoding of that text. The response fields are then what an
inference server makes of those ids: it decodes them (the end-of-turn dropped, the think
and tool tokens kept) and runs its reasoning and tool parsers over the text
(:func:`parse_raw_output`, after ``../shared/reference/PARSERS.md``). Nothing here calls a
profile's own rendering of an answer, so a pipeline test comparing rebuilt ids with
the true ids (which the HTTP shell serves on its own endpoint, never in a response body)
compares two independent things.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

import msgspec

from schemas import Message, ToolCall, ToolFunction

__all__ = [
    "CONTENT_FAULTS",
    "PARSERS",
    "TRANSIENT_FAULTS",
    "ChatRequest",
    "Generation",
    "GenerationParams",
    "ProfileLike",
    "RequestError",
    "ThinkBlock",
    "build_response_body",
    "choose_content_faults",
    "choose_transient_fault",
    "compile_chat_template",
    "error_body",
    "generate",
    "noncanonical_same_length",
    "noncanonical_split",
    "parse_fault_header",
    "parse_raw_output",
    "parse_request",
    "profile_prompt_text",
    "prompt_digest",
    "prompt_text_fallback",
    "render_chat_template",
    "request_messages",
    "think_block_of",
    "usage_counts",
    "write_raw_output",
]

TRANSIENT_FAULTS: Final = ("429", "5xx", "timeout", "drop", "malformed", "error_in_200")
CONTENT_FAULTS: Final = ("truncate", "empty_reasoning", "bad_usage", "noncanonical_len", "noncanonical_same")
# Server parsers the simulator emulates: current vLLM (no whitespace stripped), and SGLang
# before PR #24251 (reasoning and content .strip()ped). PARSERS.md has the sources.
PARSERS: Final = ("vllm", "sglang-legacy")
# How far off a bad_usage response's completion_tokens is (at least).
BAD_USAGE_OFFSET: Final = 1000

# Where the think block of an answer opens: the model writes the think-start itself
# ("model"), the prompt already opened it ("prompt"), or the answer has none ("none":
# the model does not think, or the prompt closed the block to switch thinking off).
ThinkBlock = Literal["model", "prompt", "none"]


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
    def think_start(self) -> str | None:
        """Think-start token string (None: the model never thinks)."""

    @property
    def think_start_id(self) -> int | None:
        """Think-start token id."""

    @property
    def think_end(self) -> str | None:
        """Think-end token string."""

    @property
    def think_end_id(self) -> int | None:
        """Think-end token id."""

    @property
    def tool_tokens(self) -> dict[str, int]:
        """Tool-call special tokens by string."""

    @property
    def tool_format(self) -> str:
        """Native tool-call format: qwen, deepseek-r1, deepseek-v3.1, kimi, dsml or none."""

    def thinks(self) -> bool:
        """Whether the model writes a think block under this profile."""

    def encode(self, text: str) -> list[int]:
        """Ids of model-generated text: specials parsed, no BOS, no normalisation."""

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a rendered prompt as a server tokenizes it."""

    def decode(self, ids: list[int]) -> str:
        """Decode ids, specials kept as text."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for."""

    def id_of_bytes(self, data: bytes) -> int | None:
        """The id of the vocab entry with exactly these bytes."""

    def render_prompt(
        self, messages: Sequence[Message], tools: list[dict[str, Any]] | None, *, reasoning: bool = False
    ) -> str:
        """The profile's own rendering of the prompt (its chat template, generation prompt on)."""

    def prompt_state(self, prompt_text: str) -> str:
        """``open``, ``closed`` or ``none``: how the rendered prompt leaves the think block."""


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
    # vLLM's extensions: kwargs for the chat template, and the prompt/output ids in the body.
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_ids: bool = False


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
    parser: str = "vllm"
    # Issue 27 (the seeds' shape): when set, a thinking answer's length is drawn log-uniform in
    # ``answer_tokens`` and a share in ``reasoning_share`` of it is reasoning (overrides the two ranges).
    answer_tokens: tuple[int, int] | None = None
    reasoning_share: tuple[float, float] = (0.80, 0.95)
    # The model calls every offered tool once, in the order offered (a parallel-call answer whose
    # calls a trajectory can predict), instead of one tool drawn at random.
    parallel_tool_calls: bool = False


@dataclass
class Generation:
    """One generated answer: the model's raw text and true ids, and the parsed response fields."""

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
    # What the model wrote, end-of-turn included, before any cut (true ids encode it).
    raw_text: str = ""
    # The prompt the answer follows, and its ids as a server tokenizes it.
    prompt_text: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    think_block: ThinkBlock = "none"


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
    model, max_tokens = _model_and_max_tokens(data)
    top = data.get("top_logprobs") or 0
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20:
        raise RequestError("'top_logprobs' must be an integer in 0..20")
    template_kwargs = data.get("chat_template_kwargs")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object")
    return ChatRequest(
        model=model,
        messages=clean,
        tools=tools or None,
        max_tokens=max_tokens,
        logprobs=bool(data.get("logprobs")),
        top_logprobs=top,
        tool_choice=data.get("tool_choice"),
        chat_template_kwargs=template_kwargs or None,
        return_token_ids=bool(data.get("return_token_ids")),
    )


def _model_and_max_tokens(data: dict[str, Any]) -> tuple[str, int | None]:
    """The ``model`` and ``max_tokens`` of a request body, validated as a provider does."""
    max_tokens = data.get("max_tokens", data.get("max_completion_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise RequestError("'max_tokens' must be a positive integer")
    model = data.get("model") or "simulator/model"
    if not isinstance(model, str):
        raise RequestError("'model' must be a string")
    return model, max_tokens


# The tool definitions a Hermes-style template (Qwen3) renders into the prompt: one JSON per line.
_PROMPT_TOOLS = re.compile(r"<tools>\n(?P<lines>.*?)\n</tools>", re.DOTALL)


def prompt_tools(prompt: str) -> list[dict[str, Any]] | None:
    """The tools a rendered prompt offers in the native ``<tools>`` block (Qwen3's templates), else None."""
    match = _PROMPT_TOOLS.search(prompt)
    if match is None:
        return None
    tools = []
    for line in match["lines"].splitlines():
        try:
            tool = json.loads(line)
        except ValueError:
            continue
        if isinstance(tool, dict):
            tools.append(tool)
    return tools or None


def parse_completion_request(body: bytes) -> tuple[ChatRequest, str]:
    """Parse a text-completions body (``prompt`` already rendered): the request the generator reads, and the prompt.

    The prompt stands as one system message (so tool text in it is seen as a system prompt's
    is), and the tools the prompt offers natively are the request's tools: the model answers
    them with tool calls in its own format. Raises :class:`RequestError`.
    """
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("'prompt' must be a non-empty string")
    model, max_tokens = _model_and_max_tokens(data)
    request = ChatRequest(
        model=model, messages=[{"role": "system", "content": prompt}], tools=prompt_tools(prompt), max_tokens=max_tokens
    )
    return request, prompt


def parse_fault_header(value: str | None) -> list[str]:
    """Names in an ``X-Simulator-Fault`` header; raises :class:`RequestError` on unknown ones."""
    if not value:
        return []
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in TRANSIENT_FAULTS and n not in CONTENT_FAULTS]
    if unknown:
        raise RequestError(f"unknown simulator fault(s) {unknown}; known: {list(TRANSIENT_FAULTS + CONTENT_FAULTS)}")
    return names


# ---------------------------------------------------------------- prompts


def prompt_text_fallback(request: ChatRequest) -> str:
    """A plain rendering of the prompt, for token counting when a profile has no chat template."""
    return "".join(f"{m.get('role', '')}: {m.get('content', '')}\n" for m in request.messages)


def request_messages(request: ChatRequest) -> list[Message]:
    """The request's messages as schema Messages (what the profile's template renders)."""
    out = []
    for m in request.messages:
        try:
            out.append(msgspec.convert(m, Message))
        except msgspec.ValidationError:  # an odd role or field: keep what a template needs
            role = m.get("role")
            if role in ("system", "user", "assistant", "tool"):
                out.append(Message(role=role, content=m.get("content") or ""))
    return out


def profile_prompt_text(profile: ProfileLike, request: ChatRequest) -> str:
    """The prompt rendered by the profile's own template, else as plain text (no template)."""
    try:
        return profile.render_prompt(request_messages(request), request.tools, reasoning=True)
    except Exception:  # no chat template, or an unusual prompt: count plain text instead
        return prompt_text_fallback(request)


def _tojson(
    value: Any, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False
) -> str:
    """``tojson`` as Hugging Face gives it to chat templates: no HTML escaping, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise RequestError(f"chat template error: {message}")


def _no_clock(fmt: str) -> str:
    raise RequestError("chat template error: strftime_now is not available (no clock given)")


def compile_chat_template(source: str, *, strftime_now: Callable[[str], str] | None = None) -> Any:
    """A chat template compiled the way Hugging Face renders one (``apply_chat_template``).

    jinja2's immutable sandbox with ``trim_blocks``/``lstrip_blocks`` and loop controls,
    ``tojson`` without ASCII escaping, ``raise_exception`` and ``strftime_now``: the same
    environment transformers builds, so an official template file renders here as a server
    renders it (CONVENTIONS.md: render templates the way Hugging Face does). The core has no
    clock: the shell passes ``strftime_now`` for templates that print today's date.
    """
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = strftime_now or _no_clock
    return env.from_string(source)


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's messages as vLLM hands them to a chat template.

    Plain dicts as the request carried them, with vLLM's one change (``_postprocess_messages``
    in ``vllm/entrypoints/chat_utils``): an assistant turn's tool-call ``arguments`` become a
    JSON object (not JSON, or not an object: ``{}``), and an empty ``tool_calls`` list is dropped.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not isinstance(calls, list):
            out.append(message)
            continue
        copy = {k: v for k, v in message.items() if k != "tool_calls"}
        if calls:
            copy["tool_calls"] = [_template_tool_call(call) for call in calls]
        out.append(copy)
    return out


def _template_tool_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    parsed: Any = arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError:
            parsed = {}
    if not isinstance(parsed, dict):
        parsed = {}
    return {**call, "function": {**function, "arguments": parsed}}


def render_chat_template(template: Any, request: ChatRequest, *, bos_token: str, eos_token: str) -> str:
    """The prompt text a server renders from ``template`` for this request.

    The messages are the dicts the request carried (tool-call arguments as objects, see
    :func:`_template_messages`), the generation prompt is on and the request's
    ``chat_template_kwargs`` are passed through, as vLLM does. Raises :class:`RequestError`
    (400) when the template refuses the prompt.
    """
    kwargs = {
        k: v
        for k, v in (request.chat_template_kwargs or {}).items()
        if k not in ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
    }
    try:
        rendered: str = template.render(
            messages=_template_messages(request.messages),
            tools=request.tools,
            add_generation_prompt=True,
            bos_token=bos_token,
            eos_token=eos_token,
            **kwargs,
        )
    except RequestError:
        raise
    except Exception as exc:  # jinja2's errors: the request's fault, as a server reports it
        raise RequestError(f"chat template error: {type(exc).__name__}: {exc}") from None
    return rendered


def think_block_of(profile: ProfileLike, prompt_text: str) -> ThinkBlock:
    """Where the answer's think block opens, given the rendered prompt it follows."""
    state = profile.prompt_state(prompt_text)
    if state == "open":
        return "prompt"
    if state == "none" and profile.thinks():
        return "model"
    return "none"


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


def _tool_call_args(rng: random.Random, tools: list[tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    """(name, arguments object) of one call to an offered tool, arguments filling its schema."""
    name, params = tools[rng.randrange(len(tools))]
    props = params.get("properties") if isinstance(params.get("properties"), dict) else None
    if props:
        args = {key: _argument_value(rng, schema) for key, schema in props.items()}
    else:
        args = {"query": _argument_value(rng, {"type": "string"})}
    return name, args


# ---------------------------------------------------------------- non-canonical ids


def _special_ids(profile: ProfileLike) -> set[int]:
    ids = set(profile.tool_tokens.values()) | {profile.end_of_turn_id}
    ids.update(i for i in (profile.think_start_id, profile.think_end_id) if i is not None)
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


# ---------------------------------------------------------------- the model's raw output
#
# Each family's raw answer, written here from its official chat template (the assistant
# turn of the history, which is what the model was trained to produce) and PARSERS.md,
# never from a profile's own rendering:
#
# - Qwen3 / Qwen3-2507 (Qwen-Qwen3-0.6B.jinja): '<think>\n' + reasoning + '\n</think>\n\n' +
#   content, then per call ('\n' first when content is not empty)
#   '<tool_call>\n{"name": "' + name + '", "arguments": ' + arguments + '}\n</tool_call>', then
#   '<|im_end|>'. Qwen3-2507's generation prompt ends '<think>\n': the model goes on from the
#   reasoning.
# - DeepSeek-R1 (R1-Distill template: generation prompt '<｜Assistant｜><think>\n'):
#   reasoning + '\n</think>\n\n' + content, then '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' +
#   type + '<｜tool▁sep｜>' + name + '\n```json\n' + arguments + '\n```<｜tool▁call▁end｜>' +
#   '<｜tool▁calls▁end｜>', then '<｜end▁of▁sentence｜>'. DeepSeek-V3 (no thinking): the same
#   without the think block.
# - DeepSeek-V3.1 (generation prompt '<｜Assistant｜><think>', history '</think>' + content):
#   reasoning + '</think>' + content, calls '<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' +
#   arguments + '<｜tool▁call▁end｜>' inside the calls section.
# - Kimi-K2-Thinking (moonshotai-Kimi-K2-Thinking.jinja): '<think>' + reasoning + '</think>' +
#   content + '<|tool_calls_section_begin|><|tool_call_begin|>functions.' + name + ':0' +
#   '<|tool_call_argument_begin|>' + arguments + '<|tool_call_end|><|tool_calls_section_end|>'
#   + '<|im_end|>'. Kimi-K2 (no thinking): the same without the think block.
# - DeepSeek-V4 (DSML) and profiles without a tool format: no native call is written (the
#   simulator answers in content instead).

# Tool formats whose think block has newlines around the reasoning and after the think-end.
_NEWLINE_THINK: Final = frozenset({"qwen", "deepseek-r1", "none"})


def _native_tool_calls(tool_format: str, calls: Sequence[tuple[str, str]]) -> str | None:
    """The text tool calls (name, arguments text) are in the model's own syntax (None: no native syntax here).

    Several calls are one block, joined as each template joins them: Qwen's ``<tool_call>`` blocks and
    R1's calls by ``"\n"``, V3.1's and Kimi's adjacent (Kimi's ids counting from 0).
    """
    if tool_format == "qwen":
        return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls)
    if tool_format == "deepseek-r1":
        body = "\n".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{a}\n```<｜tool▁call▁end｜>" for n, a in calls
        )
        return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"
    if tool_format == "deepseek-v3.1":
        body = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{a}<｜tool▁call▁end｜>" for n, a in calls)
        return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"
    if tool_format == "kimi":
        body = "".join(
            f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{a}<|tool_call_end|>"
            for i, (n, a) in enumerate(calls)
        )
        return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"
    return None


def write_raw_output(
    profile: ProfileLike,
    *,
    think_block: ThinkBlock,
    reasoning: str,
    content: str,
    tool_calls: Sequence[tuple[str, dict[str, Any]]] = (),
) -> str:
    """The full text the model generates after the prompt, end-of-turn included.

    ``tool_calls`` are (name, arguments object) pairs; the arguments are written as the model
    writes JSON, ``json.dumps(arguments, ensure_ascii=False)``.
    """
    fmt = profile.tool_format
    text = ""
    if think_block != "none" and profile.think_start is not None and profile.think_end is not None:
        if fmt in _NEWLINE_THINK:
            opening = f"{profile.think_start}\n" if think_block == "model" else ""
            text = f"{opening}{reasoning}\n{profile.think_end}\n\n"
        else:
            opening = profile.think_start if think_block == "model" else ""
            text = f"{opening}{reasoning}{profile.think_end}"
    text += content
    if tool_calls:
        native = _native_tool_calls(fmt, [(n, json.dumps(a, ensure_ascii=False)) for n, a in tool_calls])
        if native is not None:
            text += ("\n" if fmt == "qwen" and content else "") + native
    return text + profile.end_of_turn


# ---------------------------------------------------------------- the server's parse

# Where each format's tool block starts, and one complete call inside it (the regexes of
# vLLM's hermes, deepseekv3, deepseekv31 and kimi_k2 tool parsers, PARSERS.md).
_TOOL_BLOCK_START: Final = {
    "qwen": "<tool_call>",
    "deepseek-r1": "<｜tool▁calls▁begin｜>",
    "deepseek-v3.1": "<｜tool▁calls▁begin｜>",
    "kimi": "<|tool_calls_section_begin|>",
}
_TOOL_CALL_PATTERN: Final = {
    "qwen": re.compile(r"<tool_call>(?P<body>.*?)</tool_call>", re.DOTALL),
    "deepseek-r1": re.compile(
        r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<args>.*?)\n```<｜tool▁call▁end｜>",
        re.DOTALL,
    ),
    "deepseek-v3.1": re.compile(
        r"<｜tool▁call▁begin｜>(?P<name>.*?)<｜tool▁sep｜>(?P<args>.*?)<｜tool▁call▁end｜>", re.DOTALL
    ),
    "kimi": re.compile(
        r"<\|tool_call_begin\|>\s*(?P<id>[^<]+:\d+)\s*<\|tool_call_argument_begin\|>\s*(?P<args>.*?)\s*"
        r"<\|tool_call_end\|>",
        re.DOTALL,
    ),
}
# Formats whose tool parser re-serialises the arguments (json.loads then json.dumps with
# ensure_ascii=False): vLLM's hermes; SGLang's Qwen25 and DeepSeek detectors.
_RESERIALIZED: Final = {
    "vllm": frozenset({"qwen"}),
    "sglang-legacy": frozenset({"qwen", "deepseek-r1", "deepseek-v3.1"}),
}


def _parse_tool_calls(tool_format: str, text: str, parser: str, call_id: str) -> tuple[str, list[ToolCall]]:
    """(content before the tool block, structured calls); the text unchanged when no call parses.

    Text after the block is dropped, as every tool parser does. A block with no complete,
    valid call (an answer cut inside it) stays in the content, with no calls.
    """
    start = _TOOL_BLOCK_START.get(tool_format)
    pattern = _TOOL_CALL_PATTERN.get(tool_format)
    if start is None or pattern is None or start not in text:
        return text, []
    block_at = text.index(start)
    reserialize = tool_format in _RESERIALIZED.get(parser, frozenset())
    calls: list[ToolCall] = []
    try:
        for index, match in enumerate(pattern.finditer(text, block_at)):
            id_ = call_id if index == 0 else f"{call_id}_{index}"
            if tool_format == "qwen":
                obj = json.loads(match["body"])
                name, arguments = obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)
            elif tool_format == "kimi":
                id_ = match["id"].strip()  # kimi_k2 returns the model's "functions.name:idx" as the id
                name, arguments = id_.split(":")[0].split(".")[-1], match["args"]
            else:
                name, arguments = match["name"], match["args"]
            if reserialize and tool_format != "qwen":
                arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
            calls.append(ToolCall(id=id_, function=ToolFunction(name=name, arguments=arguments)))
    except (ValueError, KeyError, TypeError):  # not JSON, or not a call object: the parser gives up
        return text, []
    if not calls:
        return text, []
    return text[:block_at], calls


def parse_raw_output(
    profile: ProfileLike,
    text: str,
    *,
    think_block: ThinkBlock,
    tools_sent: bool,
    parser: str = "vllm",
    call_id: str = "call_0",
) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, content, tool calls) a server returns for the decoded output ``text``.

    ``text`` is the detokenised output (end-of-turn dropped; think and tool tokens kept,
    being ``special=false``). ``vllm``: a leading think-start removed, the rest split at the
    first think-end with no strip (no think-end: all reasoning, a cut answer); the tool
    parser runs on the content only when the request sent ``tools`` (else the native call
    text stays in the content). ``sglang-legacy``: the same split, then reasoning and
    content ``.strip()``ped (the 2025 detectors stripped the whole text and the content,
    and the streaming path rstripped the reasoning; OpenRouter-style streaming answers come
    out stripped on both sides, which is what is emulated).
    """
    if parser not in PARSERS:
        raise ValueError(f"unknown parser {parser!r}; known: {', '.join(PARSERS)}")
    reasoning, content = "", text
    if think_block != "none" and profile.think_end is not None:
        if profile.think_start and content.startswith(profile.think_start):
            content = content[len(profile.think_start) :]
        if profile.think_end in content:
            reasoning, _, content = content.partition(profile.think_end)
        else:
            reasoning, content = content, ""
    calls: list[ToolCall] = []
    if tools_sent:
        content, calls = _parse_tool_calls(profile.tool_format, content, parser, call_id)
    if parser == "sglang-legacy":
        reasoning, content = reasoning.strip(), content.strip()
    return reasoning, content, calls


# ---------------------------------------------------------------- generation


def usage_counts(
    profile: ProfileLike, true_ids: Sequence[int], params: GenerationParams, *, thinking: bool = True
) -> tuple[int, int]:
    """(completion_tokens, reasoning_tokens) of true ids under the counting convention.

    Reasoning tokens are the ids before the think-end (all of them when the answer stopped
    inside the reasoning; none when ``thinking`` is off).
    """
    completion = len(true_ids)
    if not params.count_end_of_turn and true_ids and true_ids[-1] == profile.end_of_turn_id:
        completion -= 1
    think_end_id = profile.think_end_id
    if think_end_id is not None and think_end_id in true_ids:
        reasoning = list(true_ids).index(think_end_id)
        if not params.count_think_end:
            completion -= list(true_ids).count(think_end_id)
    else:
        reasoning = len(true_ids) if thinking else 0
    return completion, reasoning


def _truncation_cut(profile: ProfileLike, ids: list[int], rng: random.Random) -> int:
    """Where a ``truncate`` fault cuts: strictly inside the reasoning, else inside the answer."""
    think_end_id = profile.think_end_id
    if think_end_id is not None and think_end_id in ids:
        n_reasoning = ids.index(think_end_id)
        # Keep at least one id of reasoning after a think-start the model wrote.
        low = 2 if ids and ids[0] == profile.think_start_id else 1
        if n_reasoning - 1 >= low:
            return rng.randint(low, n_reasoning - 1)
        return max(1, n_reasoning)  # nothing to cut inside: stop right before the think-end
    n_answer = len(ids) - 1 if ids and ids[-1] == profile.end_of_turn_id else len(ids)
    return rng.randint(1, n_answer - 1) if n_answer >= 2 else max(1, n_answer)


def _answer_ranges(rng: random.Random, params: GenerationParams) -> tuple[tuple[int, int], tuple[int, int]]:
    """(reasoning, content) token ranges of one thinking answer: the options' ranges, or one
    log-uniform length split by the reasoning share when ``answer_tokens`` is set."""
    if params.answer_tokens is None:
        return params.reasoning_tokens, params.content_tokens
    low, high = params.answer_tokens
    total = int(math.exp(rng.uniform(math.log(low), math.log(high))))
    reasoning = max(1, int(total * rng.uniform(*params.reasoning_share)))
    content = max(10, total - reasoning)
    return (reasoning, reasoning), (content, content)


def generate(
    profile: ProfileLike,
    request: ChatRequest,
    params: GenerationParams,
    *,
    content_faults: Sequence[str] = (),
    prompt_text: str | None = None,
) -> Generation:
    """The deterministic answer to ``request``: raw text, true ids, parsed fields, faults.

    ``prompt_text`` is the rendered prompt the answer follows (the profile's own template
    when None); it decides whether the model opens a think block and gives prompt_tokens.
    """
    if params.parser not in PARSERS:
        raise RequestError(f"unknown parser {params.parser!r}; known: {', '.join(PARSERS)}", 500)
    if prompt_text is None:
        prompt_text = profile_prompt_text(profile, request)
    prompt_ids = profile.encode_prompt(prompt_text)
    think_block = think_block_of(profile, prompt_text)
    thinking = think_block != "none"
    digest = prompt_digest(request)
    rng = random.Random(int.from_bytes(digest, "little") ^ params.seed)  # noqa: S311 - not crypto
    faults = [f for f in CONTENT_FAULTS if f in content_faults]
    fallbacks: list[str] = []

    reasoning = ""
    reasoning_range, content_range = _answer_ranges(rng, params) if thinking else (None, params.content_tokens)
    if thinking and "empty_reasoning" not in faults:
        reasoning = _sized_text(profile, rng, reasoning_range or params.reasoning_tokens, True)
    elif "empty_reasoning" in faults and not thinking:
        fallbacks.append("empty_reasoning")  # no think block to leave empty
    tools = _offered_tools(request) if _native_tool_calls(profile.tool_format, [("f", "{}")]) is not None else []
    if params.parallel_tool_calls and len(tools) > 1:
        calls = [_tool_call_args(rng, [tool]) for tool in tools]
    else:
        calls = [_tool_call_args(rng, tools)] if tools else []
    content_range = (3, 15) if calls else content_range
    content_text = _sized_text(profile, rng, content_range, False)
    raw = write_raw_output(
        profile, think_block=think_block, reasoning=reasoning, content=content_text, tool_calls=calls
    )
    canonical = profile.encode(raw)
    true_ids = list(canonical)

    cut: int | None = None
    if "truncate" in faults:
        cut = _truncation_cut(profile, true_ids, rng)
    if request.max_tokens is not None and len(true_ids) > request.max_tokens:
        cut = request.max_tokens if cut is None else min(cut, request.max_tokens)
    if cut is not None:
        true_ids = true_ids[:cut]
        canonical = true_ids[:]

    # What the server detokenises (skip_special_tokens: the end-of-turn goes, the
    # special=false think and tool tokens stay) and parses into the response fields.
    decoded = profile.decode([i for i in true_ids if i != profile.end_of_turn_id])
    out_reasoning, out_content, out_calls = parse_raw_output(
        profile,
        decoded,
        think_block=think_block,
        tools_sent=bool(request.tools),
        parser=params.parser,
        call_id=f"call_{digest.hex()[:24]}",
    )
    finish = "length" if cut is not None else ("tool_calls" if out_calls else "stop")

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

    completion, reasoning_tokens = usage_counts(profile, true_ids, params, thinking=thinking)
    if "bad_usage" in faults:
        completion += max(BAD_USAGE_OFFSET, len(true_ids))
    return Generation(
        reasoning=out_reasoning,
        content=out_content,
        tool_calls=out_calls,
        true_ids=true_ids,
        canonical_ids=canonical,
        finish_reason=finish,
        prompt_tokens=len(prompt_ids),
        completion_tokens=completion,
        reasoning_tokens=reasoning_tokens,
        faults=faults,
        fallbacks=fallbacks,
        raw_text=raw,
        prompt_text=prompt_text,
        prompt_ids=prompt_ids,
        think_block=think_block,
    )


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
) -> dict[str, Any]:
    """The OpenRouter-shaped JSON body for one generation.

    With ``return_token_ids`` in the request the body carries the ids as vLLM returns
    them: ``choices[0].token_ids`` (the output ids) and a top-level ``prompt_token_ids``.
    """
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
    if request.return_token_ids:
        choice["token_ids"] = generation.true_ids
    body = _envelope("chat.completion", choice, generation, request, params, provider, response_id, created)
    if request.return_token_ids:
        body["prompt_token_ids"] = generation.prompt_ids
    return body


def _envelope(
    kind: str,
    choice: dict[str, Any],
    generation: Generation,
    request: ChatRequest,
    params: GenerationParams,
    provider: str,
    response_id: str,
    created: int,
) -> dict[str, Any]:
    """The body around one choice, chat or text completion alike: ids, model, usage."""
    return {
        "id": response_id,
        "provider": provider,
        "model": request.model,
        "object": kind,
        "created": created,
        "choices": [choice],
        "usage": _usage_body(generation, params),
    }


def answer_cost(generation: Generation, params: GenerationParams) -> float:
    """What one answer costs, as its ``usage.cost`` says (and the key is charged)."""
    cost = (
        generation.completion_tokens * params.price_per_token + generation.prompt_tokens * params.prompt_price_per_token
    )
    return round(cost, 12)


def _usage_body(generation: Generation, params: GenerationParams) -> dict[str, Any]:
    cost = answer_cost(generation, params)
    return {
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "total_tokens": generation.prompt_tokens + generation.completion_tokens,
        "cost": cost,
        "completion_tokens_details": {"reasoning_tokens": generation.reasoning_tokens},
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def raw_completion_text(profile: ProfileLike, ids: Sequence[int]) -> str:
    """The text a completions server returns for ``ids`` with ``skip_special_tokens: false``.

    Every special is kept except the final end-of-turn (the stop token, which the
    detokenizer drops); a trailing incomplete UTF-8 character is held back, as an
    incremental detokenizer does.
    """
    shown = list(ids[:-1]) if ids and ids[-1] == profile.end_of_turn_id else list(ids)
    data = b"".join(profile.token_bytes(i) for i in shown)
    for drop in range(min(4, len(data)) + 1):
        try:
            return data[: len(data) - drop].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="replace")


def build_completion_body(
    profile: ProfileLike,
    generation: Generation,
    request: ChatRequest,
    params: GenerationParams,
    *,
    provider: str,
    response_id: str,
    created: int,
) -> dict[str, Any]:
    """The OpenAI text-completions body for one generation: the raw text, no reasoning or tool parser."""
    choice = {
        "index": 0,
        "text": raw_completion_text(profile, generation.true_ids),
        "logprobs": None,
        "finish_reason": "length" if generation.finish_reason == "length" else "stop",
    }
    return _envelope("text_completion", choice, generation, request, params, provider, response_id, created)


def error_body(code: int, message: str) -> dict[str, Any]:
    """An OpenRouter-style error object."""
    return {"error": {"code": code, "message": message}}
