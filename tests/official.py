"""Truth from outside the code under test: the official chat templates of the shared reference,
rendered by transformers itself."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def reference_dir() -> Path:
    """``$DRAFTSTREAM_REFERENCE_DIR``, else ``../shared/reference`` next to the repository."""
    return Path(os.environ.get("DRAFTSTREAM_REFERENCE_DIR") or REPO.parent / "shared" / "reference")


def official_template(name: str) -> str:
    """An official chat template from the shared reference (skips when it is not there)."""
    path = reference_dir() / "chat-templates" / name
    if not path.is_file():
        pytest.fail(f"reference template {path} not found (set DRAFTSTREAM_REFERENCE_DIR): the truth must come from it")
    return path.read_text(encoding="utf-8")


def hf_render(template: str, messages: list[dict[str, Any]], *, generation: bool, **kwargs: Any) -> str:
    """``template`` rendered by transformers itself (not by the code under test)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=template, add_generation_prompt=generation, **kwargs
    )
    return str(rendered[0])
