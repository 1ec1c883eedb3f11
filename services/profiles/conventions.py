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

__all__ = ["CONVENTIONS", "STRIP_UNITS", "Convention", "convention_for"]

# What a stripping server can ``.strip()``: the whole decoded output its reasoning parser
# sees (think-start removed: its start is the reasoning's start, its end the content's
# end), the reasoning field, the content field. A ``.strip()`` takes both ends of its span
# at once, so one end showing whitespace proves the span was not stripped.
STRIP_UNITS = ("text", "reasoning", "content")


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
    # The ways this provider strips (each a set of STRIP_UNITS .strip()ped together); empty
    # with strips_whitespace: every unit on its own. A way is ruled out for a sample when one
    # of its units shows whitespace at an end (see open_strip_units).
    strip_patterns: tuple[frozenset[str], ...] = ()
    # What usage.reasoning_tokens counts, where that is established: "before_think_end" = the
    # output ids before the think-end (a think-start the model wrote included). None: not
    # established, the count is not used (OpenRouter's completion_tokens_details and SGLang's
    # usage.reasoning_tokens are reported, but what they count is unverified: OPENROUTER.md).
    reasoning_count: str | None = None
    # Tool fields the server's request model fills with null before the template renders the
    # tools (PARSERS.md "Corrections": vLLM `description`, SGLang 0.5.23 `defer_loading`).
    tool_null_fields: tuple[str, ...] = ()
    # Tool formats whose tool parser ``.strip()``s the content before the block, whatever the
    # reasoning parser kept (SGLang 0.5.23's Qwen25Detector / DeepSeekV3Detector / DeepSeekV31Detector:
    # ``normal_text = text[:idx].strip()``; PARSERS.md "Corrections").
    strips_before_tool: frozenset[str] = frozenset()
    # Tool formats whose block the server's parsers take out of the content even when the request
    # has no ``tools`` parameter, returning no call for it either: raw tool text (tools written
    # into the system text) does not come back, so its calls cannot be proven through this server
    # (vLLM 0.33's deepseek_v4 pair, run by tests/conformance/test_raw_tool_text.py).
    drops_block_without_tools: frozenset[str] = frozenset()
    # Tool formats (the model families) whose reasoning parser ``.rstrip()``s the reasoning wherever it ends
    # (at the think-end, a tool block, or the cut): the whitespace the model wrote before its think-end does
    # not come back and nothing in the text shows it (vLLM 0.33's grammar-engine parsers ``deepseek_v4`` and
    # ``kimi_k2``: ``strip_trailing_reasoning_whitespace``; run by tests/conformance/test_reasoning_end.py).
    strips_reasoning_end: frozenset[str] = frozenset()

    def open_strip_units(self, shown: frozenset[str]) -> frozenset[str]:
        """The units that may have been stripped, given those whose ends show whitespace (kept)."""
        if not self.strips_whitespace:
            return frozenset()
        patterns = self.strip_patterns or tuple(frozenset({unit}) for unit in STRIP_UNITS)
        return frozenset().union(*(p for p in patterns if p.isdisjoint(shown)))


# SGLang before PR #24251: .strip() of the whole text and of the content (non-streaming),
# plus .rstrip() of the reasoning when streaming.
_SGLANG_LEGACY_STRIPS = (frozenset({"text", "content"}), frozenset({"text", "content", "reasoning"}))

# An unknown upstream: SGLang's old ways, or any field on its own or both (SGLang 2026 still
# strips the content before a tool block). No known engine strips the raw text and leaves
# the content alone, so a content that shows its whitespace rules out the whole-text strip.
_OPENROUTER_STRIPS = (
    *_SGLANG_LEGACY_STRIPS,
    frozenset({"reasoning", "content"}),
    frozenset({"reasoning"}),
    frozenset({"content"}),
)

# The tool formats whose SGLang detector .strip()s the content before the block (DSML's and Kimi's keep it).
_DETECTORS_STRIP = frozenset({"qwen", "deepseek-r1", "deepseek-v3.1"})

CONVENTIONS: dict[str, Convention] = {
    "vllm": Convention(
        name="vllm",
        strips_whitespace=False,
        reserialized_tool_formats=frozenset({"qwen", "dsml", "kimi"}),
        trimmed_argument_formats=frozenset({"kimi"}),
        source="vLLM's deepseek_r1 and qwen3 reasoning parsers partition at </think> with no strip; its "
        "deepseek_v4 and kimi_k2 parsers .rstrip() the reasoning (0.33.0, run); hermes re-serialises "
        "arguments with json.dumps; kimi_k2's regex consumes \\s* around arguments; its request "
        "model renders a missing tool description as null (PARSERS.md); "
        "deepseek_v4 (0.33.0, run) returns JSON built from the DSML parameters; kimi_k2 (0.33.0, run by "
        "the fuzzer's tool tier) returns arguments it rebuilt, values typed by the tool's schema; deepseek_v4 "
        "drops a DSML block from the content even with no tools parameter (0.33.0, run)",
        tool_null_fields=("description",),
        drops_block_without_tools=frozenset({"dsml"}),
        strips_reasoning_end=frozenset({"dsml", "kimi"}),
    ),
    "sglang": Convention(
        name="sglang",
        strips_whitespace=False,
        reserialized_tool_formats=frozenset({"qwen", "deepseek-r1", "deepseek-v3.1", "dsml"}),
        trimmed_argument_formats=frozenset(),
        source="SGLang after PR #24251 keeps whitespace in reasoning and content; its DeepSeek/Qwen tool "
        "detectors .strip() the content before the block and re-serialise arguments; 0.5.23 renders every "
        "tool with defer_loading null (PARSERS.md)",
        tool_null_fields=("defer_loading",),
        strips_before_tool=_DETECTORS_STRIP,
    ),
    "sglang-legacy": Convention(
        name="sglang-legacy",
        strips_whitespace=True,
        reserialized_tool_formats=frozenset({"qwen", "deepseek-r1", "deepseek-v3.1", "dsml"}),
        trimmed_argument_formats=frozenset(),
        source="SGLang before 2026 .strip()ped the whole text and the content; streaming also "
        ".rstrip()ped the reasoning (PARSERS.md)",
        strip_patterns=_SGLANG_LEGACY_STRIPS,
        strips_before_tool=_DETECTORS_STRIP,
    ),
    "openrouter": Convention(
        name="openrouter",
        strips_whitespace=True,
        # Formats some engine re-serialises (vLLM hermes; SGLang's Qwen/DeepSeek detectors): both
        # engines keep Kimi's arguments raw (PARSERS.md), so no upstream is known to rewrite them.
        reserialized_tool_formats=frozenset({"qwen", "deepseek-r1", "deepseek-v3.1", "dsml"}),
        trimmed_argument_formats=frozenset({"kimi"}),
        source="OpenRouter does not document whether its upstreams trim whitespace or re-serialise "
        "arguments (OPENROUTER.md): assume they may (as SGLang before 2026 did, or field by field) "
        "and let each answer's own whitespace and its usage count decide; logprobs, where an "
        "upstream returns them, give exact ids",
        strip_patterns=_OPENROUTER_STRIPS,
        strips_before_tool=_DETECTORS_STRIP,
    ),
}

_BY_KIND = {"openai": "vllm", "simulator": "vllm", "sglang": "sglang", "openrouter": "openrouter"}


def convention_for(kind: str, configured: str | None = None) -> Convention:
    """The convention of a provider kind (``provider.convention`` wins when set)."""
    name = configured or _BY_KIND.get(kind, "openrouter")
    if name not in CONVENTIONS:
        raise ValueError(f"unknown provider convention {name!r}: known are {', '.join(CONVENTIONS)}")
    return CONVENTIONS[name]
