"""Provider conventions: what a provider's text has lost, as facts of that provider.

A text API returns ``reasoning``, ``content`` and ``tool_calls`` parsed out of the decoded
model output. Which parts of the raw text survive that parsing is a fact of the engine and
its version (``../shared/reference/PARSERS.md``, ``OPENROUTER.md``), not something to
learn from the data. Reconstruction reads a :class:`Convention` to know where text may be
missing; where it may, the ids are accepted only on evidence (native ids, logprob tokens,
or a usage count that proves nothing was lost), else the sample is a dead letter naming
what was lost.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CONVENTIONS", "Convention", "convention_for"]


@dataclass(frozen=True)
class Convention:
    """What one provider kind keeps of the raw model output, and how it counts tokens."""

    name: str
    # reasoning and content .strip()ped (SGLang before 2026; OpenRouter's upstreams: unknown).
    strips_whitespace: bool
    # Tool formats whose structured arguments the tool parser re-serialises (json.loads/dumps).
    reserialized_tool_formats: frozenset[str]
    # Tool formats whose parser regex consumes the whitespace around the arguments.
    trimmed_argument_formats: frozenset[str]
    # usage.completion_tokens - (number of generated ids, end-of-turn included).
    completion_offset: int = 0
    # usage.prompt_tokens - len(prompt ids).
    prompt_offset: int = 0
    source: str = ""


CONVENTIONS: dict[str, Convention] = {
    "vllm": Convention(
        name="vllm",
        strips_whitespace=False,
        reserialized_tool_formats=frozenset({"qwen", "dsml"}),
        trimmed_argument_formats=frozenset({"kimi"}),
        source="vLLM reasoning parsers partition at </think> with no strip; hermes re-serialises "
        "arguments with json.dumps; kimi_k2's regex consumes \\s* around arguments (PARSERS.md); "
        "deepseek_v4 (0.33.0, run) returns JSON built from the DSML parameters",
    ),
    "sglang": Convention(
        name="sglang",
        strips_whitespace=False,
        reserialized_tool_formats=frozenset({"qwen", "deepseek-r1", "deepseek-v3.1", "dsml"}),
        trimmed_argument_formats=frozenset(),
        source="SGLang after PR #24251 keeps whitespace; its DeepSeek/Qwen tool detectors re-serialise "
        "arguments (PARSERS.md)",
    ),
    "sglang-legacy": Convention(
        name="sglang-legacy",
        strips_whitespace=True,
        reserialized_tool_formats=frozenset({"qwen", "deepseek-r1", "deepseek-v3.1", "dsml"}),
        trimmed_argument_formats=frozenset(),
        source="SGLang before 2026 .strip()ped reasoning and content (PARSERS.md)",
    ),
    "openrouter": Convention(
        name="openrouter",
        strips_whitespace=True,
        reserialized_tool_formats=frozenset({"qwen", "deepseek-r1", "deepseek-v3.1", "kimi", "dsml"}),
        trimmed_argument_formats=frozenset({"kimi"}),
        source="OpenRouter does not document whether its upstreams trim whitespace or re-serialise "
        "arguments (OPENROUTER.md): assume they may; request logprobs for exact ids, or set "
        "provider.convention to the upstream's engine when it is known",
    ),
}

_BY_KIND = {"openai": "vllm", "simulator": "vllm", "sglang": "sglang", "openrouter": "openrouter"}


def convention_for(kind: str, configured: str | None = None) -> Convention:
    """The convention of a provider kind (``provider.convention`` wins when set)."""
    name = configured or _BY_KIND.get(kind, "openrouter")
    if name not in CONVENTIONS:
        raise ValueError(f"unknown provider convention {name!r}: known are {', '.join(CONVENTIONS)}")
    return CONVENTIONS[name]
