"""The text's own evidence and unique-candidate restoration, against real tokenizers.

Every expected id sequence is the raw model text encoded by the tokenizer library itself
(``tokenizers`` / ``tiktoken`` built here from the package files, see test_reconstruct.py);
the response fields are what the named server returns from that raw text (PARSERS.md).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from schemas import Usage
from services.profiles.conventions import CONVENTIONS
from services.reconstruct.core import COUNT_TRUSTED, reconstruct
from services.reconstruct.proof import TOOLS_COUNTED
from services.reconstruct.restore import WHITESPACE, WHITESPACE_CANDIDATES, Slot, restore
from tests.unit.test_profiles import deepseek, qwen
from tests.unit.test_reconstruct import R1_EOS, TOOLS, dead, ok, qwen_ids, r1_ids, response, tc

OPENROUTER = CONVENTIONS["openrouter"]
LEGACY = CONVENTIONS["sglang-legacy"]
VLLM = CONVENTIONS["vllm"]


# -- step 1: the text's own evidence ------------------------------------------------------


def test_fields_that_show_whitespace_at_every_edge_were_not_stripped() -> None:
    """R1 through a lossless upstream: whitespace shown at an edge proves nothing was stripped there.

    Every edge a strip could touch shows its whitespace, so the ids are exact with no count
    at all. One edge's whitespace says nothing about the span's other end: a server may strip
    one end only (``.lstrip()``, SGLang's streaming ``.rstrip()`` of the reasoning).
    """
    got = ok(reconstruct(response(reasoning="\nLet me think.\n", content="\n\nThe answer is 4.\n"), deepseek(),
                         OPENROUTER))  # fmt: skip
    assert got.output_ids == r1_ids("\nLet me think.\n</think>\n\nThe answer is 4.\n" + R1_EOS)
    one_end = reconstruct(response(reasoning="Let me think.\n", content="\n\nThe answer is 4.\n"), deepseek(),
                          OPENROUTER)  # fmt: skip
    assert dead(one_end).reason == "lossy_text_unverifiable"
    assert "1 place(s)" in dead(one_end).message


def test_fields_without_whitespace_at_their_edges_prove_nothing() -> None:
    no_count = response(reasoning="Let me think.", content="The answer is 4.")
    assert dead(reconstruct(no_count, deepseek(), OPENROUTER)).reason == "lossy_text_unverifiable"


def test_evidence_is_per_strip_not_per_answer() -> None:
    """SGLang before 2026 kept the reasoning's trailing "\\n" but stripped the content: the kept
    newline must not vouch for the content ("\\n\\n" lost there: the count shows it)."""
    truth = r1_ids("plan\n</think>\n\nThe answer is 4." + R1_EOS)
    stripped = response(reasoning="plan\n", content="The answer is 4.", completion=len(truth))
    verdict = dead(reconstruct(stripped, deepseek(), LEGACY))
    assert verdict.reason in {"whitespace_stripped", "whitespace_ambiguous"}
    assert "content_start" in verdict.message and "reasoning_end" not in verdict.message


# -- step 2: unique-candidate restoration --------------------------------------------------


def test_two_character_strip_with_the_same_count_is_not_accepted() -> None:
    """The issue's regression: the strip removed "\\n\\n" AND the space after it, and the count stayed.

    "Consequently" is two R1 tokens, " Consequently" one: "\\n\\n Consequently" and
    "Consequently" are two tokens either way. Every single whitespace string inserted alone
    changes the count (the old check), the pair does not.
    """
    truth_text = "plan\n</think>\n\n Consequently it is 4." + R1_EOS
    rebuilt_text = "plan\n</think>Consequently it is 4." + R1_EOS
    assert len(r1_ids(truth_text)) == len(r1_ids(rebuilt_text))
    for single in (" ", "\n", "\n\n", "\t"):
        assert len(r1_ids("plan\n</think>" + single + "Consequently it is 4." + R1_EOS)) != len(r1_ids(truth_text))
    stripped = response(reasoning="plan\n", content="Consequently it is 4.", completion=len(r1_ids(truth_text)))
    for convention in (LEGACY, OPENROUTER):
        verdict = dead(reconstruct(stripped, deepseek(), convention))
        assert verdict.reason == "whitespace_ambiguous"
        assert "never accepts alone" in verdict.message
        # The search finds several candidates even where a unique count was trusted.
        searched = dead(reconstruct(stripped, deepseek(), convention, rule=COUNT_TRUSTED))
        assert searched.reason == "whitespace_ambiguous"
        assert "candidate(s) reproduce the count" in searched.message


def test_two_character_strip_regression_on_qwen3() -> None:
    truth_text = "<think>\nplan\n</think>\n\n Consequently it is 4.<|im_end|>"
    assert len(qwen_ids(truth_text)) == len(qwen_ids("<think>\nplan\n</think>Consequently it is 4.<|im_end|>"))
    stripped = response(reasoning="\nplan\n", content="Consequently it is 4.", completion=len(qwen_ids(truth_text)))
    # The reasoning shows its edges, the content does not: OpenRouter's field-by-field strip stays possible.
    assert dead(reconstruct(stripped, qwen(), OPENROUTER)).reason == "whitespace_ambiguous"


def test_a_count_that_pins_the_only_candidate_never_accepts_alone() -> None:
    """R1 "2+2=4\\n</think>42 apples": a space, newline or tab at any open edge adds a token
    (digits and a final letter merge with none), so among the candidates only "nothing was
    stripped" fits. The candidates are not every string a strip takes (U+00A0, longer mixed
    runs), so the edges stay unproven and the answer is refused; the search itself, under the
    rule that trusted a unique count, still finds the one candidate."""
    truth = r1_ids("2+2=4\n</think>42 apples" + R1_EOS)
    for ws in (" ", "\n", "\t", "\n\n"):
        assert len(r1_ids(ws + "2+2=4\n</think>42 apples" + R1_EOS)) > len(truth)
        assert len(r1_ids("2+2=4\n</think>42 apples" + ws + R1_EOS)) > len(truth)
    fields = {"reasoning": "2+2=4\n", "content": "42 apples"}
    refused = dead(reconstruct(response(**fields, completion=len(truth)), deepseek(), LEGACY))
    assert refused.reason == "whitespace_ambiguous"
    assert "never accepts alone" in refused.message
    trusted = ok(reconstruct(response(**fields, completion=len(truth)), deepseek(), LEGACY, rule=COUNT_TRUSTED))
    assert trusted.output_ids == truth
    more = dead(reconstruct(response(**fields, completion=len(truth) + 1), deepseek(), LEGACY))
    assert more.reason == "whitespace_stripped"
    searched = dead(reconstruct(response(**fields, completion=len(truth) + 1), deepseek(), LEGACY, rule=COUNT_TRUSTED))
    assert searched.reason == "whitespace_stripped" and "candidate(s) reproduce the count" in searched.message


def test_a_long_reasoning_is_searched_in_windows_around_its_edges() -> None:
    """A reasoning of thousands of characters: each edge is searched in a window, the result is the same.

    The search is what is tested: under the rule that trusted a unique count it restores the
    one candidate (the sound rule refuses the unproven edges, as above)."""
    reasoning = "2+2=4, " * 600 + "so 4\n"
    truth = r1_ids(reasoning + "</think>42 apples" + R1_EOS)
    got = ok(reconstruct(response(reasoning=reasoning, content="42 apples", completion=len(truth)), deepseek(), LEGACY,
                         rule=COUNT_TRUSTED))
    assert got.output_ids == truth
    more = dead(reconstruct(response(reasoning=reasoning, content="42 apples", completion=len(truth) + 1),
                            deepseek(), LEGACY))
    assert more.reason == "whitespace_stripped"


def test_the_reasoning_count_is_used_only_where_its_convention_is_established() -> None:
    truth = r1_ids("2+2=4\n</think>42 apples" + R1_EOS)
    before_think_end = truth.index(128799)
    wrong = response(reasoning="2+2=4\n", content="42 apples", completion=len(truth))
    wrong.usage = Usage(completion_tokens=len(truth), reasoning_tokens=before_think_end + 1)
    # Not established for any built-in provider: the count is not read.
    assert all(c.reasoning_count is None for c in CONVENTIONS.values())
    # The search with the reasoning count, under the rule that trusted a unique count (the sound
    # rule refuses these unproven edges whatever the counts say).
    assert ok(reconstruct(wrong, deepseek(), LEGACY, rule=COUNT_TRUSTED)).output_ids == truth
    counted = replace(LEGACY, reasoning_count="before_think_end")
    refused = dead(reconstruct(wrong, deepseek(), counted, rule=COUNT_TRUSTED))
    assert "0 candidate(s)" in refused.message
    right = response(reasoning="2+2=4\n", content="42 apples", completion=len(truth))
    right.usage = Usage(completion_tokens=len(truth), reasoning_tokens=before_think_end)
    assert ok(reconstruct(right, deepseek(), counted, rule=COUNT_TRUSTED)).output_ids == truth
    assert dead(reconstruct(right, deepseek(), counted)).reason == "whitespace_ambiguous"


def test_restore_counts_every_joint_candidate() -> None:
    """Two gaps in one piece of text: the joint search finds the pair a single-gap search misses."""
    text = "Consequently it is 4."
    slots = [Slot(0, 0, WHITESPACE), Slot(len(text), len(text), WHITESPACE)]
    base = r1_ids(text)
    outcome = restore(text, slots, specials=(), encode_batch=lambda ts: [r1_ids(t) for t in ts],
                      base_count=len(base), target=len(base))
    truth_pairs = [
        (a, b) for a in WHITESPACE_CANDIDATES[:13] for b in WHITESPACE_CANDIDATES[:13]
        if len(r1_ids(a + text + b)) == len(base)
    ]
    assert ("\n\n ", "") not in truth_pairs or outcome.matches >= 2
    assert outcome.matches >= len(truth_pairs) >= 2
    assert outcome.text is None


def test_restore_refuses_past_its_cap() -> None:
    text = "a b"
    slots = [Slot(0, 0, WHITESPACE), Slot(3, 3, WHITESPACE)]
    outcome = restore(text, slots, specials=(), encode_batch=lambda ts: [r1_ids(t) for t in ts],
                      base_count=len(r1_ids(text)), target=len(r1_ids(text)) + 3, cap=100)
    assert outcome.capped and outcome.text is None


# -- step 3: re-serialised tool arguments --------------------------------------------------

QWEN_HEAD = "<think>\np\n</think>\n\n<tool_call>\n"
QWEN_TAIL = "\n</tool_call><|im_end|>"


def _qwen_call(body: str) -> list[int]:
    return qwen_ids(QWEN_HEAD + body + QWEN_TAIL)


def test_qwen3_reserialised_calls_are_refused_even_where_the_count_pinned_one_form() -> None:
    """vLLM hermes returns json.dumps(json.loads(call)): the count once pinned the shortest form it knew.

    Under the rule nothing in a re-serialised call is proven, so every form is refused; the
    count-trusting rule (``TOOLS_COUNTED``) still pins the compact one, and would as wrongly pin it
    for a model that wrote a spelling outside its forms with as many ids (issue 53's class 2).
    """
    calls = [tc("calc", '{"expr": "6*7"}')]
    compact = _qwen_call('{"name":"calc","arguments":{"expr":"6*7"}}')
    answer = response(reasoning="\np\n", content="\n\n", tool_calls=calls, tools=TOOLS, completion=len(compact))
    assert ok(reconstruct(answer, qwen(), VLLM, rule=TOOLS_COUNTED)).output_ids == compact
    for body in ('{"name":"calc","arguments":{"expr":"6*7"}}', '{"name": "calc", "arguments": {"expr": "6*7"}}'):
        truth = _qwen_call(body)
        verdict = dead(reconstruct(response(reasoning="\np\n", content="\n\n", tool_calls=calls, tools=TOOLS,
                                            completion=len(truth)), qwen(), VLLM))
        assert verdict.reason == "tool_arguments_reserialized"
        assert "the block wrapper" in verdict.message and "the text after the block" in verdict.message


def _r1_tool_answer(written: str, returned: str, convention_name: str, content: str = "\n\n") -> tuple[list[int], Any]:
    """R1's true ids when it wrote ``written`` as arguments, and our verdict on ``returned`` with that count."""
    block = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calc\n```json\n" + written
             + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    truth = r1_ids("\nplan\n</think>\n\n" + block + R1_EOS)
    verdict = reconstruct(response(reasoning="\nplan\n", content=content, tool_calls=[tc("calc", returned)],
                                   tools=TOOLS, completion=len(truth)), deepseek(), CONVENTIONS[convention_name])
    return truth, verdict


def test_r1_reserialised_arguments_under_sglang_are_refused_naming_the_strip_before_the_block() -> None:
    """SGLang 0.5.23's DeepSeekV3Detector .strip()s the content before the block and re-serialises the
    arguments (ensure_ascii=False: "\\u6771" written comes back "東"); the count pinned a form once."""
    for written in ('{"city":"東京"}', '{"city": "\\u6771\\u4eac"}'):
        _, verdict = _r1_tool_answer(written, '{"city": "東京"}', "sglang", content="")
        refused = dead(verdict)
        assert refused.reason == "tool_arguments_reserialized"
        assert "the content before the block" in refused.message and "the argument text" in refused.message


def test_arguments_in_the_models_own_form_are_still_refused_for_the_text_after_the_block() -> None:
    """'{"expr":"6*7"}' is not json.dumps' own form, so no parser re-serialised it; what followed the
    block is still the parser's, and a count that fits does not prove it empty."""
    truth, verdict = _r1_tool_answer('{"expr":"6*7"}', '{"expr":"6*7"}', "openrouter")
    refused = dead(verdict)
    assert refused.reason == "tool_arguments_reserialized"  # OpenRouter's upstream may re-serialise R1's
    assert "the text after the block" in refused.message
    _, raw = _r1_tool_answer('{"expr":"6*7"}', '{"expr":"6*7"}', "vllm")
    assert dead(raw).reason == "tool_call_text_lost"


# -- step 4: the server's prompt normalisation ----------------------------------------------

BARE_TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


def _official_qwen3_prompt_ids(tools: list[dict[str, object]]) -> list[int]:
    """The official Qwen3 template (shared reference) rendered the Hugging Face way, real tokenizer."""
    from tests.conformance import truth

    text = truth.render_template(truth.template_source("Qwen-Qwen3-0.6B.jinja"),
                                 [{"role": "user", "content": "What is 2+2?"}], tools=tools,
                                 add_generation_prompt=True, bos_token="", eos_token="<|im_end|>")
    return truth.truth_tokenizer("qwen3").encode_prompt(text)


def _prompt_ids_under(convention_name: str, tools: list[dict[str, object]]) -> list[int]:
    answer = response(reasoning="\np\n", content="\n\nIt is noon.\n", tools=tools)
    return list(ok(reconstruct(answer, qwen(), CONVENTIONS[convention_name])).prompt_ids)


def test_vllm_renders_a_missing_tool_description_as_null() -> None:
    served = [{"type": "function", "function": {"name": "now", "description": None,
                                                "parameters": BARE_TOOL["function"]["parameters"]}}]  # type: ignore[index]
    truth = _official_qwen3_prompt_ids(served)
    assert truth != _official_qwen3_prompt_ids([BARE_TOOL])  # the null field changes the prompt
    assert _prompt_ids_under("vllm", [BARE_TOOL]) == truth


def test_sglang_renders_every_tool_with_defer_loading_null() -> None:
    described = {"type": "function", "function": {"name": "calc", "description": "calculator",
                                                  "parameters": BARE_TOOL["function"]["parameters"]}}  # type: ignore[index]
    truth = _official_qwen3_prompt_ids([{**described, "defer_loading": None}])
    assert truth != _official_qwen3_prompt_ids([described])
    assert _prompt_ids_under("sglang", [described]) == truth
    # Providers whose rendering is the request as sent keep it so.
    assert _prompt_ids_under("sglang-legacy", [described]) == _official_qwen3_prompt_ids([described])


# -- step 6: R1 after a tool result ------------------------------------------------------------


def test_r1_after_a_tool_result_is_rebuilt_as_the_official_template_has_it() -> None:
    """R1's official template opens no think block after a tool result; vLLM then returns the whole
    answer as reasoning. The rebuilt ids have no think token, and the audit accepts them."""
    from schemas import Message, ToolCall, ToolFunction
    from services.audit.core import audit_batch
    from services.common.config import AuditThresholds
    from tests.conformance import truth

    call = ToolCall(function=ToolFunction(name="calc", arguments='{"expr": "6*7"}'), id="c1")
    messages = [Message(role="user", content="What is 6*7?"), Message(role="assistant", content="", tool_calls=[call]),
                Message(role="tool", content="42", tool_call_id="c1")]
    wire = [{"role": "user", "content": "What is 6*7?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "6*7"}'}}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    official = truth.render_template(truth.template_source("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"), wire,
                                     add_generation_prompt=True, bos_token="<｜begin▁of▁sentence｜>",
                                     eos_token=R1_EOS)
    assert "<think>" not in official[-40:]
    answer = "The tool says 6*7 = 42.\n\nSo the answer is **42**."
    truth_ids = r1_ids(answer + R1_EOS)
    got = ok(reconstruct(response(messages=messages, reasoning=answer, content="", completion=len(truth_ids)),
                         deepseek(), VLLM))
    assert got.output_ids == truth_ids
    assert got.prompt_ids == r1_ids(official)
    (verdict,) = audit_batch([got], deepseek(), AuditThresholds())
    assert verdict.passed, verdict.reasons
    # The model may also have opened and closed a block itself: the count tells.
    thought = r1_ids("<think>\nhm\n</think>\n\n" + answer + R1_EOS)
    both = ok(reconstruct(response(messages=messages, reasoning="\nhm\n", content="\n\n" + answer,
                                   completion=len(thought)), deepseek(), VLLM))
    assert both.output_ids == thought
    assert dead(reconstruct(response(messages=messages, reasoning=answer, content=""), deepseek(),
                            VLLM)).reason == "lossy_text_unverifiable"
