"""What a profile declares about its model before its tokenizer is loaded, and the error a profile raises."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

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
