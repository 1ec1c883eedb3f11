"""The conformance matrix's "completions" column: the model's raw text, as a completions server returns it.

For every truth model of ``truth.py`` (official templates + real tokenizers, never our code),
the prompt goes out the way completions mode sends it: rendered by the inference stage's
request builder (the dataset profile's template, tools in the model's native format) and
posted as text. The server answers with the raw text the model wrote (the truth's output
ids detokenised with every special kept, the stop token dropped as a server's detokenizer
does, a trailing partial character withheld), ``usage.prompt_tokens`` counted by the real
tokenizer over the prompt text it received and ``usage.completion_tokens`` over the ids
generated. Each response then goes through reconstruct and audit. Required: 0 accepted with
ids that differ from the truth (prompt ids included: our render against the official one),
and at least 98 % accepted for every model, tool calls included, of the answers that stopped by
themselves and of the answers that lost nothing (the stopped ones, and the cut ones whose every byte
is in the text at an end no withheld partial character could extend); the tool calls derived
from the raw text are the model's (names and arguments).
An answer cut at ``max_tokens`` is printed apart: its text may end in a character the
server holds back (a last token the text cannot pin, ``truncated_tail_*``), in every mode
alike; a dataset with ``require_stop`` (the default) refuses it anyway.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import pytest

from schemas import PromptPublished, ResponseReceived, SampleReconstructed, Usage
from services.audit.core import audit_batch
from services.common.config import DatasetSettings, load_settings
from services.common.kafka import DeadLetter
from services.inference.adapters.providers import SimulatorProvider
from services.profiles.conventions import CONVENTIONS
from services.reconstruct.core import reconstruct_batch
from tests.conformance import truth as T
from tests.conformance.test_matrix import THRESHOLDS, _differences, _messages, _profile_settings, profile_for


@dataclass
class Column:
    """One model's completions-mode results."""

    cases: int = 0
    with_tools: int = 0
    accepted: int = 0
    accepted_with_tools: int = 0
    stopped: int = 0  # answers that ended by themselves (not cut at max_tokens)
    accepted_stopped: int = 0
    # Answers whose text lost nothing, as the rest of the matrix counts it: stopped ones, and cut ones
    # whose every byte is in the text and whose end is no place a withheld partial character could sit.
    lossless: int = 0
    accepted_lossless: int = 0
    wrong: list[str] = field(default_factory=list)
    calls_differ: list[str] = field(default_factory=list)  # derived tool calls that are not the model's
    reasons: Counter[str] = field(default_factory=Counter)


def _completions_response(case: Any, index: int, sent_prompt: str, prompt: PromptPublished) -> ResponseReceived:
    """What a completions server returns for ``case`` when it receives ``sent_prompt``."""
    tok = T.truth_tokenizer(case.model)
    ids = case.output_ids[:-1] if case.finished else case.output_ids
    text = T._utf8_prefix(b"".join(tok.token_bytes(t) for t in ids))  # noqa: SLF001 - the truth's detokenizer
    return ResponseReceived(
        dataset="conf",
        sample_id=prompt.sample_id,
        prompt=prompt,
        provider="completions",
        model=case.model,
        finish_reason="stop" if case.finished else "length",
        usage=Usage(prompt_tokens=len(tok.encode_prompt(sent_prompt)), completion_tokens=len(case.output_ids)),
        tools_sent=case.conversation.tools_sent,
        mode="completions",
        text=text,
        sent_prompt=sent_prompt,
    )


def _calls(sample: SampleReconstructed) -> list[tuple[str, Any]]:
    """The tool calls derived from the raw text: (name, arguments as JSON)."""
    return [(c.function.name, json.loads(c.function.arguments)) for c in sample.response.tool_calls]


def _cut_lost_nothing(case: Any, response: ResponseReceived, profile: Any) -> bool:
    """A cut answer whose text holds every byte of its ids and cannot be read as hiding part of a character."""
    tok = T.truth_tokenizer(case.model)
    if response.text.encode("utf-8") != b"".join(tok.token_bytes(t) for t in case.output_ids):
        return False  # the server withheld a trailing partial character
    tail = response.text.encode("utf-8")[-16:]
    prefixes = profile.partial_char_prefixes()
    return not any(tail[start:] in prefixes for start in range(len(tail)))


def run_column(model: str) -> Column:
    """Every conversation of ``model`` through completions mode, reconstruct and audit."""
    column = Column()
    by_thinking: dict[bool, list[tuple[Any, ResponseReceived]]] = {}
    for index, case in enumerate(T.build_cases(model)):
        conv = case.conversation
        name, sections = _profile_settings(model, conv.thinking)
        settings = load_settings(None, profiles=sections, provider={"mode": "completions"})
        provider = SimulatorProvider(settings, client=None)  # type: ignore[arg-type]  # no request is sent
        # A row's tools always reach the model (services/inference/tool_route.py): a case whose request offers
        # none (its history holds tool turns all the same) is a row without tools.
        prompt = PromptPublished(dataset="conf", sample_id=f"{model}-{index}", messages=_messages(conv),
                                 tools=conv.tools if conv.tools_sent else None, max_tokens=conv.max_tokens)
        dataset = DatasetSettings(profile=name)
        sent = provider.completion_prompt(prompt, dataset)
        by_thinking.setdefault(conv.thinking, []).append((case, _completions_response(case, index, sent, prompt)))
    for thinking, members in by_thinking.items():
        profile = profile_for(model, thinking)
        verdicts = reconstruct_batch([r for _, r in members], profile, CONVENTIONS["vllm"])
        audited = iter(audit_batch([v for v in verdicts if isinstance(v, SampleReconstructed)], profile, THRESHOLDS))
        for (case, response), verdict in zip(members, verdicts, strict=True):
            tools = bool(case.conversation.generation.calls)
            column.cases += 1
            column.with_tools += tools
            column.stopped += case.finished
            lossless = case.finished or _cut_lost_nothing(case, response, profile)
            column.lossless += lossless
            if isinstance(verdict, DeadLetter):
                column.reasons[f"reconstruct/{verdict.reason}"] += 1
                continue
            result = next(audited)
            if not result.passed:
                column.reasons[f"audit/{result.reasons[0]}"] += 1
                continue
            column.accepted += 1
            column.accepted_with_tools += tools
            column.accepted_stopped += case.finished
            column.accepted_lossless += lossless
            wrong = _differences(verdict, case)
            if wrong:
                column.wrong.append(f"{response.sample_id} ({'+'.join(wrong)})")
            if case.finished and _calls(verdict) != [(c.name, json.loads(c.arguments))
                                                      for c in case.conversation.generation.calls]:
                column.calls_differ.append(response.sample_id)
    return column


@cache
def columns() -> dict[str, Column]:
    """The column for every truth model, computed once, printed as the matrix prints its cells."""
    out = {model: run_column(model) for model in T.MODELS}
    print("\nconformance: completions mode (truth: official templates + real tokenizers)")
    print(f"{'model':<22}{'cases':>6}{'tools':>6}{'accepted':>9}{'share':>7}{'stopped':>8}{'share':>7}"
          f"{'lossless':>9}{'share':>7}{'wrong':>6}  dead letters")
    for model, c in out.items():
        reasons = ", ".join(f"{r} {n}" for r, n in c.reasons.most_common())
        share, stopped = c.accepted / max(c.cases, 1), c.accepted_stopped / max(c.stopped, 1)
        lossless = c.accepted_lossless / max(c.lossless, 1)
        print(f"{model:<22}{c.cases:>6}{c.with_tools:>6}{c.accepted:>9}{share:>7.1%}{c.stopped:>8}{stopped:>7.1%}"
              f"{c.lossless:>9}{lossless:>7.1%}{len(c.wrong):>6}  {reasons}")
    return out


@pytest.mark.long(40)  # computes the columns the other tests here read from its cache
def test_completions_column_accepts_no_sample_with_wrong_ids() -> None:
    cols = columns()
    wrong = {m: c.wrong for m, c in cols.items() if c.wrong}
    assert not wrong, wrong
    assert sum(c.accepted for c in cols.values()) > 0  # the comparison compared something


@pytest.mark.parametrize("model", T.MODELS)
def test_completions_column_accepts_98_percent(model: str) -> None:
    c = columns()[model]
    assert c.cases >= 30 and c.stopped >= 20
    assert c.accepted_stopped / c.stopped >= 0.98, dict(c.reasons)
    # Cut answers included, counted as the rest of the matrix counts lossless answers.
    assert c.lossless > c.stopped and c.accepted_lossless / c.lossless >= 0.98, (c.lossless, dict(c.reasons))


def test_completions_column_covers_tool_calls() -> None:
    cols = columns()
    differ = {m: c.calls_differ for m, c in cols.items() if c.calls_differ}
    assert not differ, f"tool calls derived from the raw text are not the ones the model wrote: {differ}"
    with_tools = sum(c.with_tools for c in cols.values())
    assert with_tools > 0, "no conversation with a tool call: the column would say nothing about tools"
    assert sum(c.accepted_with_tools for c in cols.values()) / with_tools >= 0.98
