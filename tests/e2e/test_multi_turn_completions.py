"""Whole conversations in completions mode end to end: a real broker, the simulator over HTTP.

50 ShareGPT conversations of 2-6 assistant turns and 20 tool trajectories whose turns call one to
three tools at once (parallel calls) are published with ``turns = "all"`` twice: in completions
mode (the prompt rendered by the profile's template and sent as text, the raw answer split by the
profile's own format) and, as the comparison, in chat mode. The simulator calls every offered tool
once, in order, so a trajectory that ends on tool results runs to its end; one that has a final
answer ends early when the model calls tools again, in both modes alike. 5xx answers (one attempt
only) dead-letter turns at every depth; they are replayed until none is left.

The truth is built here, apart from the code under test: each turn's answer is the simulator's
true output ids (``GET /_sim/truth``) decoded by the truth tokenizer and read with Qwen3's output
format as its OFFICIAL template writes an assistant turn; turn k's history is the dataset's
conversation up to its k-th answer with every earlier answer replaced by those, each cached tool
result under the regenerated call; it is rendered by the official template and encoded by the
truth tokenizer (``tests/conformance/truth.py``).

Asserts, for the completions datasets: every regenerated turn a row, no key twice, every
conversation finished or ended early with a reason; every row's prompt ids equal the official
render of its regenerated history, carry the model's earlier answers and none of the dataset's;
0 rows whose output ids differ from the simulator's truth; the row's prefix fact equal to the ids'
own; and as many conversations finished as in chat mode.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from services.common.kafka import ensure_topics
from services.continuation.core import END_REASONS
from services.dlq.app import replay
from services.dlq.core import Filters
from services.publish.app import publish
from services.publish.core import NormaliseOptions, normalise
from services.simulator.app import SimulatorOptions, start_simulator
from tests.conformance import truth as T
from tests.e2e.harness import Pipeline, dead_letters, sink_rows
from tests.e2e.test_multi_turn import TOOLBOX, conversation_states, sharegpt_rows, write_jsonl
from tests.e2e.test_pipeline_truth import OFFICIAL_QWEN3

pytestmark = pytest.mark.e2e

N_CHAT, N_TOOLS = 50, 20
CHAT_C, TOOLS_C, CHAT_M, TOOLS_M = "chatc", "toolsc", "chatm", "toolsm"
COMPLETIONS, CHAT_MODE = (CHAT_C, TOOLS_C), (CHAT_M, TOOLS_M)


def parallel_tool_rows(n: int) -> list[dict[str, Any]]:
    """Trajectories of 1-3 tool rounds, each calling every offered tool (1-3: parallel calls) with cached
    results; every fourth goes on with a final answer and a follow-up question (where the model calls tools
    again: ended early), the rest end on tool results (the model answers last: finished)."""
    rows = []
    for i in range(n):
        tools = TOOLBOX[: 1 + i % 3]
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Trip {i}: tell me about Oslo."}]
        for step in range(1 + (i // 3) % 3):
            calls = [{"id": f"orig-{i}-{step}-{k}", "type": "function",
                      "function": {"name": t["function"]["name"], "arguments": '{"city": "Oslo"}'}}
                     for k, t in enumerate(tools)]  # fmt: skip
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": f"{c['function']['name']}: {i}.{step}"}
                         for c in calls]  # fmt: skip
        if i % 4 == 0:
            messages += [{"role": "assistant", "content": "(old model) Here it is."},
                         {"role": "user", "content": "Thanks, and Rome?"}, {"role": "assistant", "content": "(old)"}]
        rows.append({"id": f"tr{i:03d}", "messages": messages, "tools": tools})
    return rows


# Qwen3's assistant turn as the official template writes it (Qwen-Qwen3-0.6B.jinja):
# '<think>\n' + reasoning + '\n</think>\n\n' + content, then per call ('\n' first when content is not
# empty, '\n' between calls) '<tool_call>\n{"name": "' + name + '", "arguments": ' + args + '}\n</tool_call>'.
ANSWER = re.compile(r"<think>\n(?P<r>.*?)\n</think>\n\n(?P<c>.*?)(?P<calls>\n?<tool_call>\n.*\n</tool_call>)?", re.S)
CALL = re.compile(r'<tool_call>\n\{"name": "(?P<name>[^"]+)", "arguments": (?P<args>.*?)\}\n</tool_call>', re.S)


def true_answer(ids: list[int]) -> dict[str, Any]:
    """The model's answer as a history turn, read from its true ids with Qwen3's output format."""
    text = T.truth_tokenizer("qwen3").decode([i for i in ids if i != 151645])  # <|im_end|>
    m = ANSWER.fullmatch(text)
    assert m is not None, text
    calls = [{"id": f"c{k}", "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
             for k, c in enumerate(CALL.finditer(m["calls"] or ""))]  # fmt: skip
    return {"role": "assistant", "content": m["c"], "reasoning_content": m["r"], "tool_calls": calls}


def true_history(original: list[dict[str, Any]], answers: list[dict[str, Any]], upto: int) -> list[dict[str, Any]]:
    """Turn ``upto``'s history: the dataset's messages, earlier answers replaced, tool results re-paired."""
    points = [i for i, m in enumerate(original) if m["role"] == "assistant"]
    if original[-1]["role"] != "assistant":
        points.append(len(original))
    out: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for index, message in enumerate(original[: points[upto]]):
        if message["role"] == "assistant":
            answer = answers[points.index(index)]
            calls = list(answer["tool_calls"])
            out.append({k: v for k, v in answer.items() if v})
        elif message["role"] == "tool":
            out.append({"role": "tool", "content": message["content"], "tool_call_id": calls.pop(0)["id"]})
        else:
            out.append({"role": message["role"], "content": message["content"]})
    return out


def official_ids(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    text = T.render_template(OFFICIAL_QWEN3.read_text(encoding="utf-8"), T.server_messages("qwen3", messages),
                             tools=tools, add_generation_prompt=True, bos_token="", eos_token="<|im_end|>")
    return list(T.truth_tokenizer("qwen3").encode_prompt(text))


async def test_whole_conversations_in_completions_mode_match_the_official_template(
    settings_factory: Callable[..., Any], report: Callable[..., str], tmp_path: Path
) -> None:
    chat_file = write_jsonl(tmp_path / "chat.jsonl", sharegpt_rows(N_CHAT, random.Random(42)))
    tools_file = write_jsonl(tmp_path / "tools.jsonl", parallel_tool_rows(N_TOOLS))
    sim = await start_simulator(SimulatorOptions(
        seed=42, reasoning_tokens=(8, 24), content_tokens=(8, 24), rate_5xx=0.04, logprobs=True, keep_truth=True,
        parallel_tool_calls=True, chat_template_file=str(OFFICIAL_QWEN3),
    ))  # fmt: skip
    audit = {"usage_offset": 0}
    datasets: dict[str, Any] = {}
    for name, mode, tools in ((CHAT_C, "completions", False), (TOOLS_C, "completions", True),
                              (CHAT_M, "chat", False), (TOOLS_M, "chat", True)):  # fmt: skip
        datasets[name] = {"turns": "all", "mode": mode, "send_tools": tools, "audit": audit}
    settings = settings_factory(
        provider={"base_url": sim.url, "concurrency": 32, "max_attempts": 1, "outage_after": 1000,
                  "request_logprobs": True},  # chat mode: exact ids of the tool calls a parser re-serialised
        datasets=datasets,
    )
    out_dir = Path(settings.sink.out_dir)
    await ensure_topics(settings.kafka, list(datasets))
    files = {CHAT_C: chat_file, CHAT_M: chat_file, TOOLS_C: tools_file, TOOLS_M: tools_file}
    originals: dict[str, list[dict[str, Any]]] = {}  # the completions-mode conversations, checked in full
    tools_of: dict[str, list[dict[str, Any]] | None] = {}
    every: list[str] = []
    for dataset, path in files.items():
        for line in path.read_text(encoding="utf-8").splitlines():
            prompt = normalise(json.loads(line), NormaliseOptions(dataset=dataset, turns="all"))
            assert prompt.conversation is not None
            cid = f"{dataset}:{prompt.conversation.conversation_id}"
            every.append(cid)
            if dataset in COMPLETIONS:
                originals[cid] = msgspec.to_builtins(prompt.conversation.original)
                tools_of[cid] = prompt.tools
    n_conversations = len(every)
    replays = 0
    pipeline = Pipeline()
    try:
        await pipeline.start_stages(settings, "inference", "reconstruct", "audit", "sink", "continuation")
        for dataset, path in files.items():
            await publish(settings, [path], dataset=dataset)
        replayed: Counter[str] = Counter()

        async def settled() -> bool:
            states = await conversation_states(settings)
            rows = {r["id"] for r in sink_rows(out_dir)}
            letters = Counter(d.key for d in await dead_letters(settings))
            dead = {key for key, n in letters.items() if n > replayed[key]}  # not replayed yet
            for cid in every:
                state = states.get(cid)
                if state is not None and state.state != "in_progress":
                    continue
                key = f"{cid}:{0 if state is None else state.turns_done}"
                if key in rows or key not in dead:
                    return False  # its next turn is on its way
            return True

        for _ in range(8):
            await pipeline.wait(settled, 120, "every conversation ended or stopped at a dead letter")
            done = await replay(settings, Filters(stage="inference"))
            if not done.replayed:
                break
            replays += len(done.replayed)
            replayed.update(p.record.key_text for p in done.replayed)
        states = await conversation_states(settings)
    finally:
        await pipeline.stop()
        truths = sim.truth()
        await sim.close()

    rows = sink_rows(out_dir)
    by_id = {r["id"]: r for r in rows}
    row_ids = Counter(r["id"] for r in rows)
    tok = T.truth_tokenizer("qwen3")
    wrong_prompt: list[str] = []
    wrong_output: list[str] = []
    dataset_answers: list[str] = []
    own_answers_missing: list[str] = []
    wrong_prefix_fact: list[str] = []
    missing: list[str] = []
    extends = Counter()
    for cid, original in originals.items():
        state = states.get(cid)
        if state is None:
            missing.append(cid)
            continue
        answers: list[dict[str, Any]] = []
        previous: dict[str, Any] | None = None
        for turn in range(state.turns_done):
            key = f"{cid}:{turn}"
            row = by_id.get(key)
            if row is None or key not in truths:
                missing.append(key)
                break
            if row["output_ids"] != truths[key]:
                wrong_output.append(key)
            if row["prompt_ids"] != official_ids(true_history(original, answers, turn), tools_of[cid]):
                wrong_prompt.append(key)
            seen = tok.decode(row["prompt_ids"])
            if "(old model)" in seen:
                dataset_answers.append(key)
            if any(a["content"] and a["content"] not in seen for a in answers):
                own_answers_missing.append(key)
            if previous is not None:
                fact = row["prompt_ids"][: len(previous["input_ids"])] == previous["input_ids"]
                extends[fact] += 1
                if row["metadata"]["extends_previous_turn"] is not fact:
                    wrong_prefix_fact.append(key)
            elif row["metadata"]["extends_previous_turn"]:
                wrong_prefix_fact.append(key)
            answers.append(true_answer(truths[key]))
            previous = row

    def finished(names: tuple[str, ...]) -> int:
        return sum(1 for s in states.values() if s.dataset in names and s.state == "finished")

    ended = Counter(f"{s.dataset}/{s.reason}" for s in states.values() if s.state == "ended_early")
    ours = [s for k, s in states.items() if s.dataset in COMPLETIONS]
    parallel_turns = sum(1 for cid in originals for t in range(states[cid].turns_done if cid in states else 0)
                         if f"{cid}:{t}" in truths and len(true_answer(truths[f"{cid}:{t}"])["tool_calls"]) > 1)
    line = report(
        conversations=len(originals), rows=sum(1 for r in rows if r["dataset"] in COMPLETIONS),
        turns_regenerated=sum(s.turns_done for s in ours), finished_completions=finished(COMPLETIONS),
        finished_chat=finished(CHAT_MODE), ended_early=dict(ended), parallel_call_turns=parallel_turns,
        replayed=replays, wrong_prompt_ids=len(wrong_prompt), wrong_output_ids=len(wrong_output),
        extends_previous=dict(extends), missing=len(missing),
    )  # fmt: skip

    assert not missing, f"turns or conversations without a row or a state: {missing[:5]} {line}"
    assert all(n == 1 for n in row_ids.values()), f"a row written twice: {line}"
    assert len(states) == n_conversations and all(s.state != "in_progress" for s in states.values()), line
    assert sum(1 for r in rows if r["dataset"] in COMPLETIONS) == sum(s.turns_done for s in ours), line
    assert all(s.reason in END_REASONS for s in states.values() if s.state == "ended_early"), line
    assert not wrong_output, f"rows whose output ids differ from the simulator's truth: {wrong_output[:5]} {line}"
    assert not wrong_prompt, f"prompt ids differ from the official template's render: {wrong_prompt[:5]} {line}"
    assert not dataset_answers and not own_answers_missing, (dataset_answers[:3], own_answers_missing[:3], line)
    assert not wrong_prefix_fact, f"prefix facts that the ids contradict: {wrong_prefix_fact[:5]} {line}"
    # every ShareGPT conversation runs to its last turn; trajectories ending on tool results too
    for cid, original in originals.items():
        if cid.startswith(f"{CHAT_C}:") or original[-1]["role"] == "tool":
            assert states[cid].state == "finished", (cid, states[cid])
        else:
            assert (states[cid].state, states[cid].reason) == ("ended_early", "unexpected_tool_call"), states[cid]
    assert parallel_turns >= 10 and max(s.turns_done for s in ours) >= 4, line
    assert finished(COMPLETIONS) == finished(CHAT_MODE), line
    assert replays > 0, line
