"""The shared reference dir, the models and servers the truth covers, and chat-template rendering.

Chat templates are the official ``.jinja`` files in the shared reference dir (``reference/SOURCES.md``), read at
run time and rendered the way Hugging Face ``apply_chat_template`` does. Like every ``truth_*`` module, this one
never imports ``services/`` or ``schemas/``.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS: tuple[str, ...] = ("qwen3", "qwen3-thinking-2507", "deepseek-r1", "deepseek-v3.1", "kimi-k2-thinking",
                           "user-addedtok")  # fmt: skip
SERVERS: tuple[str, ...] = ("vllm", "sglang-strip", "openrouter", "openrouter-nolp", "openrouter-nolp-strip")
# OpenRouter-like without logprobs (they are best effort: OPENROUTER.md): the upstream's text and usage count,
# logprobs null, over a lossless upstream (vLLM-like text) and over a stripping one (SGLang before 2026).
NOLP_UPSTREAM = {"openrouter-nolp": "vllm", "openrouter-nolp-strip": "sglang-strip"}

# ---- Reference dir and template rendering ------------------------------------------------------------------------


def reference_dir() -> Path:
    """The shared reference dir: ``$DRAFTSTREAM_REFERENCE_DIR`` or ``<repo>/../shared/reference``."""
    configured = os.environ.get("DRAFTSTREAM_REFERENCE_DIR")
    default = REPO_ROOT.parent / "shared" / "reference"
    path = Path(configured) if configured else default
    if not (path / "chat-templates").is_dir():
        raise RuntimeError(
            f"conformance reference dir missing: DRAFTSTREAM_REFERENCE_DIR={configured!r} "
            f"(not usable) and default {default} has no chat-templates/; CI always provides it"
        )
    return path


def template_source(filename: str) -> str:
    """Text of a third-party chat template, read at run time (never copied into the repo)."""
    return (reference_dir() / "chat-templates" / filename).read_text(encoding="utf-8")


def _hf_tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    # transformers' chat-template `tojson` override (keeps non-ASCII, no HTML escaping).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    # The environment transformers builds for chat templates (sandbox, trim/lstrip blocks, loopcontrols).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _hf_tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_template(
    source: str,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    **kwargs: Any,
) -> str:
    """Render a chat template exactly as Hugging Face ``apply_chat_template(tokenize=False)`` does."""
    return _compile(source).render(
        messages=messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        **kwargs,
    )
