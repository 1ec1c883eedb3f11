"""The fuzzer's findings, shrunk to minimal cases (``test_fuzz_edges.shrink``), kept as regressions.

Each is an answer of a server that strips (SGLang before 2026) declared lossless (``kind =
"openai"``, no convention), accepted with wrong ids under the rule that trusted a unique count
and a declared convention. Truth: the official template and the real Qwen3 tokenizer
(``fuzz/answers.py``). Not marked ``fuzz``: these run with the unit tests.
"""

from __future__ import annotations

import pytest

from schemas import ResponseReceived
from services.reconstruct.core import COUNT_TRUSTED, SOUND
from tests.fuzz import answers as A
from tests.fuzz.test_fuzz_edges import SEED, Finding, judged_alone

FINDINGS = (
    # "</think>" + " v": the content's leading space lost; "v" is one id as " v" is (the "\n\n trailing" class).
    Finding("qwen3-thinking-2507", "sglang-strip", "vllm", 0, "prefix", " v", 395),
    # ".\n" before the end-of-turn stripped to ".": one id either way.
    Finding("qwen3-thinking-2507", "sglang-strip", "vllm", 2, "?", ".\n", 31),
)
# Answers whose lost edge shows in their counts ("\n\n" + " Then" is two ids, "Then" one): the fact
# takes two of them (verify.MIN_EVIDENCE).
TELLING = tuple(Finding("qwen3-thinking-2507", "sglang-strip", "vllm", 0, "x", content, 0)
                for content in ("\n\n Then we stop.", "\n\n So it ends.", "\n\n We are done."))  # fmt: skip


def _served(finding: Finding, k: int) -> ResponseReceived:
    case = A.case_of(finding.model, SEED, finding.base, finding.reasoning, finding.content)
    return A.response(case, A.served(case, finding.loss, False), f"telling-{k}", "openai", None)


@pytest.mark.parametrize("finding", FINDINGS, ids=lambda f: repr(f.content))
def test_the_trusted_count_accepted_it_with_wrong_ids(finding: Finding) -> None:
    assert judged_alone(finding, COUNT_TRUSTED)


@pytest.mark.parametrize("finding", FINDINGS, ids=lambda f: repr(f.content))
def test_refused_once_the_stream_showed_the_server_strips(finding: Finding) -> None:
    assert not judged_alone(finding, SOUND, before=[_served(t, k) for k, t in enumerate(TELLING)])


@pytest.mark.parametrize("finding", FINDINGS, ids=lambda f: repr(f.content))
def test_refused_under_the_right_convention(finding: Finding) -> None:
    assert not judged_alone(finding, SOUND, declared="sglang-legacy")
