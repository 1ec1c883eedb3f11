"""A loaded, verified profile: the model's tokenizer, special tokens, chat template and formats."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from schemas import Message, ToolCall, wire_messages
from services.profiles.backends import TokenizerBackend
from services.profiles.spec import TOOL_FORMATS, ProfileError, ProfileSpec, PromptState
from services.profiles.toolcalls import TOOL_PIECES, Piece, tojson

_TEMPLATES = Path(__file__).parent / "templates"


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)  # noqa: DTZ005 - templates format the local date



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
        build = TOOL_PIECES.get(self.tool_format)
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
                env.filters["tojson"] = tojson
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
