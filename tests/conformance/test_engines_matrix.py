"""The conformance matrix with the real engines as the provider side: columns real-vllm and real-sglang.

Every truth case (``truth.py``: the raw text each model writes and its true ids, from the official templates
and real tokenizers) goes through vLLM 0.33.0's and SGLang 0.5.23's own non-streaming parsing and serving
code (``engines.py``, in a child process, from the hash-pinned ``.run/engines``), then through our reconstruct
+ audit exactly as ``test_matrix.py`` runs them. Required, per engine:

- 0 accepted samples whose prompt_ids, output_ids, input_ids or loss_mask differ from the truth;
- ≥ 95 % accepted of the answers whose text lost nothing, as in ``test_matrix.py``: by the bytes (the
  engine's fields reassemble to the raw text byte for byte, by the truth's own reassembly,
  ``truth.reassemble``) and by the convention (a re-serialising tool parser loses the model's JSON even
  when one answer's result equals it). Answers whose bytes came through are also counted apart and printed:
  those a re-serialising parser returned are accepted only when the count singles out one candidate;
- every dead letter names a specific reason;
- no import-time stand-in (``engine_stubs.py``) was called while parsing: the engines never touched a tensor.

The table is printed (``make conformance`` shows it). Prompt ids: the truth is the official template over
the tools as the engine's own request model dumps them (``model_dump()``: SGLang 0.5.23 adds
``"defer_loading": null`` to every tool, vLLM ``"description": null`` to a tool without one); vLLM returns
that prompt's ids, SGLang returns none unless asked, so ``usage.prompt_tokens`` is its length.
"""

from __future__ import annotations

from collections import Counter
from functools import cache
from typing import Any

import msgspec
import pytest

from schemas import PromptPublished, ResponseReceived, SampleReconstructed, ToolCall, Usage
from services.audit.core import audit_batch
from services.common.kafka import DeadLetter
from services.profiles.conventions import CONVENTIONS
from services.reconstruct.core import reconstruct_batch
from tests.conformance import engines as E
from tests.conformance import truth as T
from tests.conformance.test_matrix import (
    THRESHOLDS,
    VAGUE,
    Cell,
    _differences,
    _messages,
    lossy_by_convention,
    profile_for,
)

ENGINE_CONVENTION = {"real-vllm": "vllm", "real-sglang": "sglang"}
# The one stand-in call allowed while parsing: vLLM's logger asks whether this process is the first rank
# before a log-once message (vllm/logger.py -> parallel_state.is_local_first_rank); no tensor involved.
ALLOWED_STUB_CALLS = ("torch.distributed.is_initialized from ",)
ALLOWED_STUB_CALLERS = ("/vllm/distributed/parallel_state.py:",)


@cache
def engine_run() -> dict[str, Any]:
    """Both engines' responses to every truth case (one child process per test session)."""
    return E.run_engines(T.MODELS)


def _received(case: T.Case, engine: str, index: int, got: dict[str, Any]) -> ResponseReceived:
    conv = case.conversation
    prompt = PromptPublished(dataset="conf", sample_id=f"{case.model}-{index}", messages=_messages(conv),
                             tools=conv.tools, max_tokens=conv.max_tokens)  # fmt: skip
    return ResponseReceived(
        dataset="conf",
        sample_id=prompt.sample_id,
        prompt=prompt,
        provider=engine,
        model=case.model,
        reasoning=got["reasoning"] or "",
        content=got["content"] or "",
        tool_calls=[msgspec.convert(c, ToolCall) for c in got["tool_calls"]],
        finish_reason=got["finish_reason"],
        usage=Usage(prompt_tokens=len(case.prompt_ids), completion_tokens=len(case.output_ids)),
        native_prompt_ids=got["prompt_token_ids"],
        tools_sent=conv.tools_sent,
    )


def lost_nothing(case: T.Case, got: dict[str, Any]) -> bool:
    """Whether the engine's fields reassemble to the raw text (end-of-turn excluded) byte for byte."""
    fields = {**got, "reasoning": got["reasoning"] or "", "content": got["content"] or ""}
    raw = case.raw_output[: -len(T.truth_tokenizer(case.model).eot)] if case.finished else case.raw_output
    return T.reassemble(case, fields) == raw


def run_engine_cell(model: str, engine: str) -> Cell:
    """Every conversation of one model through one real engine, then our reconstruct and audit."""
    cell, convention = Cell(), CONVENTIONS[ENGINE_CONVENTION[engine]]
    responses = engine_run()["responses"]
    groups: dict[bool, list[tuple[T.Case, ResponseReceived, bool]]] = {}
    for index, case in enumerate(T.build_cases(model)):
        got = responses[f"{engine}/{model}/{index}"]
        case = T.with_server_tools(case, got["server_tools"])  # the prompt the engine renders is the truth
        response = _received(case, engine, index, got)
        profile = profile_for(model, case.conversation.thinking)
        # As in test_matrix.py: lossless when the bytes came through AND the engine's convention cannot have
        # lost them (a re-serialising tool parser loses the model's JSON even when, for one answer, the result
        # equals it: nothing in the answer can show that). Byte-identical answers are counted apart.
        bytes_kept = lost_nothing(case, got)
        lossless = bytes_kept and not lossy_by_convention(response, profile, convention.name)
        groups.setdefault(case.conversation.thinking, []).append((case, response, lossless, bytes_kept))
    for thinking, members in groups.items():
        profile = profile_for(model, thinking)
        verdicts = reconstruct_batch([r for _, r, _, _ in members], profile, convention)
        audited = iter(audit_batch([v for v in verdicts if isinstance(v, SampleReconstructed)], profile, THRESHOLDS))
        for (case, response, lossless, bytes_kept), verdict in zip(members, verdicts, strict=True):
            cell.cases += 1
            cell.lossless += lossless
            cell.bytes_kept += bytes_kept
            if isinstance(verdict, DeadLetter):
                cell.reasons[f"reconstruct/{verdict.reason}{'' if lossless else ' (lossy)'}"] += 1
                if verdict.reason in VAGUE:
                    cell.vague.append(response.sample_id)
                continue
            result = next(audited)
            if not result.passed:
                cell.reasons[f"audit/{result.reasons[0]}{'' if lossless else ' (lossy)'}"] += 1
                continue
            cell.accepted += 1
            cell.accepted_lossless += lossless
            cell.accepted_bytes_kept += bytes_kept
            wrong = _differences(verdict, case)
            if wrong:
                cell.wrong.append(f"{response.sample_id} ({'+'.join(wrong)}; {sorted(case.conversation.features)})")
            else:
                cell.exact += 1
    return cell


@cache
def engine_matrix() -> dict[tuple[str, str], Cell]:
    """The whole real-engine matrix, computed once per test session."""
    return {(m, e): run_engine_cell(m, e) for e in E.ENGINES for m in T.MODELS}


def _print_engine_table(cells: dict[tuple[str, str], Cell]) -> None:
    versions = engine_run()["versions"]
    print(f"\nconformance matrix, real engines (vLLM {versions['vllm']}, SGLang {versions['sglang']}; "
          "truth: official templates + real tokenizers)")  # fmt: skip
    print(f"{'model':<22}{'engine':<13}{'samples':>8}{'accepted':>9}{'wrong':>6}{'lost nothing':>13}"
          f"{'of which accepted':>18}  dead letters")  # fmt: skip
    for (model, engine), c in cells.items():
        share = f"{c.accepted_lossless}/{c.lossless}"
        reasons = ", ".join(f"{r} {n}" for r, n in c.reasons.most_common())
        counts = f"{c.cases:>8}{c.accepted:>9}{len(c.wrong):>6}{c.lossless:>13}{share:>18}"
        print(f"{model:<22}{engine:<13}{counts}  {reasons}")
    for engine in E.ENGINES:
        column = [c for (_, e), c in cells.items() if e == engine]
        lossless, kept = sum(c.lossless for c in column), sum(c.accepted_lossless for c in column)
        same, same_kept = sum(c.bytes_kept for c in column), sum(c.accepted_bytes_kept for c in column)
        print(f"{engine}: {sum(c.cases for c in column)} samples, {sum(c.accepted for c in column)} accepted, "
              f"{sum(len(c.wrong) for c in column)} accepted with ids that differ from the truth; "
              f"lost nothing (bytes and convention): {kept}/{lossless} accepted ({kept / max(lossless, 1):.1%}); "
              f"bytes unchanged: {same_kept}/{same} accepted ({same_kept / max(same, 1):.1%})")  # fmt: skip


def test_engines_env_is_the_pinned_one() -> None:
    assert engine_run()["versions"] == {"vllm": E.VLLM_VERSION, "sglang": E.SGLANG_VERSION}


def test_no_stand_in_was_called_while_parsing() -> None:
    calls = [c for c in engine_run()["stub_calls"]
             if not (c.startswith(ALLOWED_STUB_CALLS) and any(p in c for p in ALLOWED_STUB_CALLERS))]  # fmt: skip
    assert not calls, calls


def test_engines_parsed_something() -> None:
    """The engines' parsers really split: reasoning and structured tool calls came back from both."""
    for engine in E.ENGINES:
        got = [v for k, v in engine_run()["responses"].items() if k.startswith(engine + "/")]
        assert sum(bool(v["reasoning"]) for v in got) >= 50, engine
        assert sum(bool(v["tool_calls"]) for v in got) >= 20, engine


def test_no_accepted_engine_sample_differs_from_the_official_truth() -> None:
    cells = engine_matrix()
    _print_engine_table(cells)
    wrong = {f"{m}/{e}": c.wrong for (m, e), c in cells.items() if c.wrong}
    assert not wrong, wrong
    assert sum(c.exact for c in cells.values()) > 0


@pytest.mark.parametrize("engine", E.ENGINES)
def test_engines_accept_at_least_95_percent_of_what_lost_nothing(engine: str) -> None:
    cells = {m: c for (m, e), c in engine_matrix().items() if e == engine}
    lossless = sum(c.lossless for c in cells.values())
    kept = sum(c.accepted_lossless for c in cells.values())
    assert lossless >= 30
    assert kept / lossless >= 0.95, {m: dict(c.reasons) for m, c in cells.items()}


def test_every_engine_dead_letter_names_a_specific_reason() -> None:
    vague = {f"{m}/{e}": c.vague for (m, e), c in engine_matrix().items() if c.vague}
    assert not vague, vague
    assert sum(Counter(c.reasons).total() for c in engine_matrix().values()) > 0
