"""What the simulator needs of a model profile (``services.profiles.Profile`` has it all)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from schemas import Message


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
