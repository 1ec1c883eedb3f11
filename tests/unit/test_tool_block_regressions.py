"""The fuzzer's tool-tier findings (``tests/fuzz/test_fuzz_tools.py``), shrunk, kept as regressions.

Each is an answer the rule before issue 53 (``proof.TOOLS_COUNTED``, the ``sglang`` convention without
its strip before the block) accepted with ids that are not the model's: truth from the official
templates and the real tokenizers (``fuzz/tool_answers.py``), the server's behaviour from the engines'
code. Under the rule each is a dead letter whose message names the place the parser changed.
"""

from __future__ import annotations

import pytest

from services.common.records import DeadLetter
from services.profiles.conventions import CONVENTIONS
from services.reconstruct.core import SOUND, reconstruct
from tests.conformance.test_matrix import profile_for
from tests.fuzz import tool_answers as A
from tests.fuzz.test_fuzz_tools import SEED, Finding, classes, judged_alone

_EMPTY = A.Call("get_weather", "{}", body='{"name":"get_weather","arguments":{}}')
FINDINGS = {
    # Hermes wrapper whitespace: "}}</tool_call>" written, vLLM's hermes parser kept the call, the template's
    # "}}\n</tool_call>" rebuilt: as many ids.
    "wrapper": (Finding(A.ToolAnswer("qwen3", 2, "", (A.Call("search_docs", "{}", "\n", "",
                                                             '{"name":"search_docs","arguments":{}}'),)), "vllm"),
                "the block wrapper"),
    # A number respelled: "5.00" written, SGLang's detector returned json.dumps' "5.0", rebuilt "5.0".
    "spelling": (Finding(A.ToolAnswer("deepseek-r1", 5, "", (A.Call("get_weather", '{"tags":5.00}'),)), "sglang"),
                 "the argument text"),
    # SGLang 0.5.23's Qwen25Detector .strip()s the content before the block: ".\n" came back ".".
    "strip": (Finding(A.ToolAnswer("qwen3-thinking-2507", 8, ".\n", (_EMPTY,)), "sglang"),
              "the content before the block"),
    # vLLM 0.33's deepseek_v3 parser appends the text after the block to the content: "：" + block + " "
    # came back content "： ", rebuilt with the space before the block.
    "appended": (Finding(A.ToolAnswer("deepseek-r1", 4, "：", (A.Call("search_docs", "{}"),), (), " "), "vllm"),
                 "the text after the block"),
}


@pytest.mark.parametrize("name", FINDINGS)
def test_the_old_rule_accepted_it_with_wrong_ids(name: str) -> None:
    finding, _ = FINDINGS[name]
    assert classes(finding) == {name}
    assert judged_alone(finding)


@pytest.mark.parametrize("name", FINDINGS)
def test_refused_under_the_rule_naming_the_place(name: str) -> None:
    finding, place = FINDINGS[name]
    assert not judged_alone(finding, SOUND, CONVENTIONS)
    case = A.case_of(finding.answer, SEED, finding.server)
    answer = A.response(case, A.served(finding.answer, case, finding.server), "regression-0", finding.server)
    verdict = reconstruct(answer, profile_for(finding.answer.model, case.conversation.thinking),
                          CONVENTIONS[A.DECLARED[finding.server]])
    assert isinstance(verdict, DeadLetter), verdict
    assert verdict.reason in ("tool_call_text_lost", "tool_arguments_reserialized")
    assert place in verdict.message, verdict.message
