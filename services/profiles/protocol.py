"""What the stages read of a loaded profile, as a structural type.

:class:`services.profiles.Profile` satisfies it; reconstruction, the audit and the
simulator type their profile parameters with it, so a test's stand-in (a small tokenizer
with a model's real special ids) can take a real profile's place. Each stage uses a part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from schemas import Message, ToolCall
from services.profiles.spec import PromptState
from services.profiles.toolcalls import Piece


class ProfileLike(Protocol):
    """The face of ``services.profiles.Profile``: special tokens, tokenizer, chat template, formats."""

    @property
    def name(self) -> str:
        """Profile name."""
        ...

    @property
    def end_of_turn(self) -> str:
        """End-of-turn token string."""
        ...

    @property
    def end_of_turn_id(self) -> int:
        """End-of-turn token id."""
        ...

    @property
    def think_start(self) -> str | None:
        """Think-start token string (None: the model never thinks)."""
        ...

    @property
    def think_start_id(self) -> int | None:
        """Think-start token id."""
        ...

    @property
    def think_end(self) -> str | None:
        """Think-end token string."""
        ...

    @property
    def think_end_id(self) -> int | None:
        """Think-end token id."""
        ...

    @property
    def tool_tokens(self) -> dict[str, int]:
        """Tool-call special tokens by string."""
        ...

    @property
    def tool_format(self) -> str:
        """Native tool-call format: qwen, deepseek-r1, deepseek-v3.1, kimi, dsml or none."""
        ...

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary (every valid id is below it)."""
        ...

    @property
    def special_ids(self) -> frozenset[int]:
        """Control ids: what the text of an answer can never hold."""
        ...

    @property
    def special_strings(self) -> tuple[str, ...]:
        """Every control string of the profile."""
        ...

    def thinks(self) -> bool:
        """Whether the model produces a think block under this profile."""
        ...

    def encode(self, text: str) -> list[int]:
        """Ids of model-generated text: specials parsed, no BOS, no normalisation."""
        ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` of many texts."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a rendered prompt as a server tokenizes it."""
        ...

    def encode_prompt_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode_prompt` of many prompts."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ids, special tokens kept."""
        ...

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        """:meth:`decode` of many sequences."""
        ...

    def token_strings(self, ids: list[int]) -> list[str]:
        """Raw vocabulary strings of ids."""
        ...

    def token_bytes(self, id_: int) -> bytes:
        """The bytes one token stands for."""
        ...

    def id_of_bytes(self, b: bytes) -> int | None:
        """The id whose bytes are exactly ``b``, else None."""
        ...

    def id_of_token_string(self, s: str) -> int | None:
        """The id of a raw vocabulary string, else None."""
        ...

    def render_prompt(
        self, messages: Sequence[Message], tools: list[dict[str, Any]] | None, *, reasoning: bool = False
    ) -> str:
        """The chat-templated prompt over the messages as sent (history reasoning with ``reasoning``)."""
        ...

    def prompt_state(self, prompt_text: str) -> PromptState:
        """Whether the rendered prompt opened the think block, closed it, or left it alone."""
        ...

    def tool_call_pieces(self, calls: Sequence[ToolCall]) -> list[Piece]:
        """Native text of structured tool calls with its gaps."""
        ...

    def partial_char_prefixes(self) -> frozenset[bytes]:
        """Visible byte strings some token extends with an incomplete UTF-8 character."""
        ...
