"""What a row needs to say how it was made: digests of the tokenizer and template, and our version.

A row found in a training set months later names its profile; these digests say which
tokenizer file and which chat template text that profile was at the time, and the version
says which draftstream wrote it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.profiles import Profile

VOCABULARY = "vocabulary"
"""``tokenizer_source`` when no file backs the tokenizer: the digest is of its token bytes in id order."""


@dataclass(frozen=True)
class ProfileProvenance:
    """The sha256 digests of a loaded profile's tokenizer file and of the chat template it renders with."""

    profile: str
    tokenizer_sha256: str
    tokenizer_source: str  # the file's name (tokenizer.json, qwen.tiktoken, ...) or VOCABULARY
    chat_template_sha256: str  # "" for a profile with no chat template


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _vocabulary_sha256(profile: Profile) -> str:
    digest = hashlib.sha256()
    for id_ in range(profile.vocab_size):
        try:
            token = profile.token_bytes(id_)
        except (KeyError, ValueError):
            token = b""  # a hole in the id space (tiktoken's reserved ranges)
        digest.update(len(token).to_bytes(4, "big") + token)
    return digest.hexdigest()


def profile_provenance(profile: Profile) -> ProfileProvenance:
    """The digests of ``profile`` as loaded: its tokenizer file (else its vocabulary) and template."""
    source: Path | None = getattr(profile.backend, "source", None)
    if source is not None and source.is_file():
        tokenizer_sha256, name = sha256_file(source), source.name
    else:
        tokenizer_sha256, name = _vocabulary_sha256(profile), VOCABULARY
    template = profile.chat_template or ""
    return ProfileProvenance(
        profile=profile.name,
        tokenizer_sha256=tokenizer_sha256,
        tokenizer_source=name,
        chat_template_sha256=hashlib.sha256(template.encode("utf-8")).hexdigest() if template else "",
    )


@cache
def draftstream_version() -> str:
    """The installed draftstream's version ("unknown" when it is run from a checkout not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("draftstream")
    except PackageNotFoundError:
        return "unknown"


__all__ = ["VOCABULARY", "ProfileProvenance", "draftstream_version", "profile_provenance", "sha256_file"]
