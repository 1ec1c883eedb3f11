"""Profiles for the audit unit tests: a kimi-k2 stand-in and the real deepseek-r1 tokenizer.

kimi-k2's tokenizer lives in the user's model folder, not in any package, so its tests
use a small stand-in tokenizer object implementing the profile interface with the real
kimi-k2 special ids from DESIGN.md: characters are their code points, a few merged
pieces ("hello", "ab") have ids of their own (so a non-canonical split exists), and an
unpaired surrogate id decodes to U+FFFD; like the real thinking profiles it reads the think
layout off the rendered prompt. deepseek-r1 is the real profile from services.profiles
with its real R1/V3 128k BPE tokenizer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

KIMI_SPECIALS = {
    "<|im_end|>": 163586,
    "<think>": 163606,
    "</think>": 163607,
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
}
KIMI_MERGES = {"hello": 150001, "ab": 150000}


@dataclass
class KimiStandIn:
    """A tiny tokenizer with kimi-k2's special ids (see the module docstring)."""

    name: str = "kimi-k2"
    end_of_turn: str = "<|im_end|>"
    end_of_turn_id: int = 163586
    think_start: str | None = "<think>"
    think_start_id: int | None = 163606
    think_end: str | None = "</think>"
    think_end_id: int | None = 163607
    tool_tokens: dict[str, int] = field(
        default_factory=lambda: {k: v for k, v in KIMI_SPECIALS.items() if "tool" in k}
    )
    tool_format: str = "kimi"
    vocab_size: int = 163840
    think_location: str | None = "model"

    def thinks(self) -> bool:
        """Thinking is on whenever the profile has a think location."""
        return self.think_location is not None and self.think_start is not None

    def prompt_state(self, prompt_text: str) -> str:
        """'open' / 'closed' when the prompt ends with the think start / end, else 'none'."""
        if self.think_start is None or self.think_end is None:
            return "none"
        tail = prompt_text.rstrip()
        return "open" if tail.endswith(self.think_start) else "closed" if tail.endswith(self.think_end) else "none"

    def encode(self, text: str) -> list[int]:
        """Specials first, then the longest merge, else the code point."""
        ids: list[int] = []
        pieces = sorted([*KIMI_SPECIALS.items(), *KIMI_MERGES.items()], key=lambda kv: -len(kv[0]))
        i = 0
        while i < len(text):
            for piece, piece_id in pieces:
                if text.startswith(piece, i):
                    ids.append(piece_id)
                    i += len(piece)
                    break
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids

    def decode(self, ids: list[int]) -> str:
        """Inverse of encode; an unpaired surrogate or unknown id decodes to U+FFFD."""
        back = {v: k for k, v in (*KIMI_SPECIALS.items(), *KIMI_MERGES.items())}
        out = []
        for i in ids:
            if i in back:
                out.append(back[i])
            elif i < 0x110000 and not 0xD800 <= i <= 0xDFFF:
                out.append(chr(i))
            else:
                out.append("\ufffd")
        return "".join(out)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many."""
        return [self.encode(t) for t in texts]

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        """Decode many."""
        return [self.decode(b) for b in batch]


@functools.cache
def deepseek() -> Any:
    """The real deepseek-r1 profile (services.profiles), loaded once per test session."""
    from services.profiles import load_profile

    return load_profile("deepseek-r1")


@functools.cache
def kimi() -> KimiStandIn:
    """The kimi-k2 stand-in."""
    return KimiStandIn()


def replacement_id(profile: Any) -> int:
    """An id that decodes to U+FFFD on its own (half of a multi-byte character)."""
    if isinstance(profile, KimiStandIn):
        return 0xD800
    found = profile.backend.id_of_bytes(b"\xe6")  # the first byte of a 3-byte character
    assert found is not None, "no byte-level id for 0xE6 in this tokenizer"
    return int(found)
