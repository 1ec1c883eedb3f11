"""The fuzzer's tool-tier findings (``tests/fuzz/test_fuzz_tools.py``), shrunk, kept as regressions.

Each is an answer the rule before issue 53 (``proof.TOOLS_COUNTED``; the ``sglang`` convention without its
strip before the block) accepted with ids that are not the model's. Truth: the official templates and the
real tokenizers (``fuzz/tool_answers.py``, seed 43's conversations). The server's reply is what the
engine's own code returned for the model's text when the fuzzer ran it (vLLM 0.33.0, SGLang 0.5.23), kept
here as data so these run with the unit tests. Under the rule each is a dead letter naming the place.
"""

from __future__ import annotations

from typing import Any

import pytest

from services.common.records import DeadLetter
from services.profiles.conventions import CONVENTIONS
from services.reconstruct.core import SOUND, reconstruct
from tests.conformance.test_matrix import profile_for
from tests.fuzz import tool_answers as A
from tests.fuzz.test_fuzz_tools import OLD_RULE_SEED, Finding, Item, classes, judged_alone


def _reply(content: str | None, name: str, arguments: str) -> dict[str, Any]:
    """The engine's reply to a finding: its content and one call (the reasoning is the base conversation's, which
    both engines returned whole)."""
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"content": content, "tool_calls": [call], "finish_reason": "tool_calls"}


# name: (the finding, the engine's reply, the place the refusal must name)
FINDINGS: dict[str, tuple[Finding, dict[str, Any], str]] = {
    # "}}</tool_call>" written; vLLM's hermes parser kept the call; the template's "}}\n</tool_call>" was
    # rebuilt: as many ids.
    "wrapper": (Finding(A.ToolAnswer("qwen3", 2, "", (A.Call("search_docs", "{}", "\n", "",
                                                             '{"name":"search_docs","arguments":{}}'),)), "vllm"),
                _reply(None, "search_docs", "{}"),
                "the block wrapper"),
    # "5.00" written; SGLang's DeepSeekV3Detector returned json.dumps' "5.0"; rebuilt "5.0".
    "spelling": (Finding(A.ToolAnswer("deepseek-r1", 5, "", (A.Call("get_weather", '{"tags":5.00}'),)), "sglang"),
                 _reply("", "get_weather", '{"tags": 5.0}'),
                 "the argument text"),
    # SGLang's DeepSeekV31Detector .strip()s the content before the block: "—\n" came back "—".
    "strip": (Finding(A.ToolAnswer("deepseek-v3.1", 7, "—\n", (A.Call("get_weather", "{}"),)), "sglang"),
              _reply("—", "get_weather", "{}"), "the content before the block"),
    # vLLM's deepseek_v3 parser appends the text after the block to the content: "：" + block + " " came back
    # content "： ", rebuilt with the space before the block.
    "appended": (Finding(A.ToolAnswer("deepseek-r1", 4, "：", (A.Call("search_docs", "{}"),), (), " "), "vllm"),
                 _reply("： ", "search_docs", "{}"),
                 "the text after the block"),
}


def _item(name: str) -> Item:
    finding, reply, _ = FINDINGS[name]
    case = A.case_of(finding.answer, OLD_RULE_SEED, finding.server)
    return finding.answer, finding.server, case, {**reply, "reasoning": case.conversation.generation.reasoning}


@pytest.mark.parametrize("name", FINDINGS)
def test_the_old_rule_accepted_it_with_wrong_ids(name: str) -> None:
    assert classes(FINDINGS[name][0]) == {name}
    assert judged_alone(_item(name))


@pytest.mark.parametrize("name", FINDINGS)
def test_refused_under_the_rule_naming_the_place(name: str) -> None:
    answer, server, case, reply = _item(name)
    assert not judged_alone((answer, server, case, reply), SOUND, CONVENTIONS)
    sent = A.response(case, A.served(answer, case, server, reply), "regression-0", server)
    verdict = reconstruct(sent, profile_for(answer.model, case.conversation.thinking), CONVENTIONS[A.DECLARED[server]])
    assert isinstance(verdict, DeadLetter), verdict
    assert verdict.reason in ("tool_call_text_lost", "tool_arguments_reserialized")
    assert FINDINGS[name][2] in verdict.message, verdict.message
