"""Whole conversations in completions mode end to end: a real broker, the simulator over HTTP.

50 ShareGPT conversations of 2-6 assistant turns and 20 tool trajectories whose turns call one to
three tools at once (parallel calls) are published with ``turns = "all"`` twice: in completions
mode (the prompt rendered by the profile's template and sent as text, the raw answer split by the
profile's own format) and, as the comparison, in chat mode. The simulator calls every offered tool
once, in order, so a trajectory that ends on tool results runs to its end; one that has a final
answer ends early when the model calls tools again, in both modes alike. 5xx answers (one attempt
only) dead-letter turns at every depth; they are replayed until none is left. The ShareGPT
conversations are then published again (``--force``): every turn flows again, answered by the
response store, and not one request reaches the provider.

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
own; as many conversations finished as in chat mode; a replayed later turn continued to the end; no
turn paid twice. The same checks run for Qwen3-2507, DeepSeek-R1 and V3.1 against their templates.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from schemas import ConversationProgressed, ResponseReceived, decode
from services.common.kafka import ensure_topics
from services.continuation.core import END_REASONS
from services.dlq.app import replay
from services.dlq.core import Filters
from services.publish.app import publish
from services.publish.core import NormaliseOptions, normalise
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from tests.conformance import truth as T
from tests.e2e.harness import Pipeline, dead_letters, read_all, sink_rows
from tests.e2e.test_multi_turn import TOOLBOX, conversation_states, regenerated_history, sharegpt_rows, write_jsonl
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


# Each family's assistant turn as its official template writes it. Qwen3 (Qwen-Qwen3-0.6B.jinja):
# '<think>\n' + reasoning + '\n</think>\n\n' + content, then per call ('\n' first when content is not
# empty, '\n' between calls) '<tool_call>\n{"name": "' + name + '", "arguments": ' + args + '}\n</tool_call>';
# Qwen3-2507 and DeepSeek-R1 open the block in the prompt ('<think>\n'), the model writes the rest;
# DeepSeek-V3.1's prompt opens it with '<think>' and the model writes reasoning + '</think>' + content.
_CALLS = r"(?P<calls>\n?<tool_call>\n.*\n</tool_call>)?"
ANSWER = {
    "qwen3": re.compile(r"<think>\n(?P<r>.*?)\n</think>\n\n(?P<c>.*?)" + _CALLS, re.S),
    "qwen3-thinking-2507": re.compile(r"(?P<r>.*?)\n</think>\n\n(?P<c>.*?)" + _CALLS, re.S),
    "deepseek-r1": re.compile(r"(?P<r>.*?)\n</think>\n\n(?P<c>.*)(?P<calls>)", re.S),
    "deepseek-v3.1": re.compile(r"(?P<r>.*?)</think>(?P<c>.*)(?P<calls>)", re.S),
}
CALL = re.compile(r'<tool_call>\n\{"name": "(?P<name>[^"]+)", "arguments": (?P<args>.*?)\}\n</tool_call>', re.S)


def true_answer(ids: list[int], model: str = "qwen3") -> dict[str, Any]:
    """The model's answer, read from its true ids with its family's output format, in a row turn's shape
    (``tool_calls`` as JSON text) for :func:`tests.e2e.test_multi_turn.regenerated_history`."""
    tok = T.truth_tokenizer(model)
    eot = tok.token_id(T._SPECS[model].eos if model.startswith("deepseek") else "<|im_end|>")
    text = tok.decode([i for i in ids if i != eot])
    m = ANSWER[model].fullmatch(text)
    assert m is not None, text
    calls = [{"id": f"c{k}", "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
             for k, c in enumerate(CALL.finditer(m["calls"] or ""))]  # fmt: skip
    return {"role": "assistant", "content": m["c"], "reasoning_content": m["r"], "tool_calls": json.dumps(calls)}


def official_ids(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, model: str = "qwen3") -> list[int]:
    """The official template's render of ``messages`` as a server hands them to it, thinking on, and its true ids."""
    spec = T._SPECS[model]
    thinking = {spec.thinking_kwarg: True} if spec.thinking_kwarg else {}  # the profiles think
    text = T.render_template(T._template_text(model), T.server_messages(model, messages), tools=tools,
                             add_generation_prompt=True, bos_token=spec.bos, eos_token=spec.eos, **thinking)
    return list(T.truth_tokenizer(model).encode_prompt(text))


@dataclass
class Run:
    """One run's conversations: what was published, where they ended, the rows and the simulator's truth."""

    every: list[str] = field(default_factory=list)  # every conversation published
    originals: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # the ones checked in full
    tools_of: dict[str, list[dict[str, Any]] | None] = field(default_factory=dict)
    states: dict[str, ConversationProgressed] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    truths: dict[str, list[int]] = field(default_factory=dict)
    replays: int = 0
    replayed: Counter[str] = field(default_factory=Counter)  # dead-lettered turns replayed, by key
    reused: set[str] = field(default_factory=set)  # turns answered again from the response store
    requests_again: int = -1  # provider requests while the re-published conversations flowed again


async def run_conversations(
    settings: Any, sim: Any, files: dict[str, Path], checked: tuple[str, ...], *, again: tuple[str, ...] = ()
) -> Run:
    """Publish ``files`` (dataset -> file) as ``turns = "all"``, replay inference dead letters until every
    conversation has ended, and collect states, rows and the truth. The datasets in ``again`` are then
    published a second time and every turn flows again, answered from the response store."""
    run = Run()
    for dataset, path in files.items():
        for line in path.read_text(encoding="utf-8").splitlines():
            prompt = normalise(json.loads(line), NormaliseOptions(dataset=dataset, turns="all"))
            assert prompt.conversation is not None
            cid = f"{dataset}:{prompt.conversation.conversation_id}"
            run.every.append(cid)
            if dataset in checked:
                run.originals[cid] = msgspec.to_builtins(prompt.conversation.original)
                run.tools_of[cid] = prompt.tools
    out_dir = Path(settings.sink.out_dir)
    await ensure_topics(settings.kafka, list(files))
    pipeline = Pipeline()
    try:
        await pipeline.start_stages(settings, "inference", "reconstruct", "audit", "sink", "continuation")
        for dataset, path in files.items():
            await publish(settings, [path], dataset=dataset)
        replayed = run.replayed

        async def settled() -> bool:
            states = await conversation_states(settings)
            rows = {r["id"] for r in sink_rows(out_dir)}
            letters = Counter(d.key for d in await dead_letters(settings))
            dead = {key for key, n in letters.items() if n > replayed[key]}  # not replayed yet
            for cid in run.every:
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
            run.replays += len(done.replayed)
            replayed.update(p.record.key_text for p in done.replayed)
        run.states = await conversation_states(settings)
        if again:
            responses_topic, t0 = settings.kafka.topic("responses"), time.time()
            turns = {f"{cid}:{t}" for cid in run.every if cid.split(":", 1)[0] in again
                     for t in range(run.states[cid].turns_done)}  # fmt: skip
            for dataset in again:  # force: the keys are on the topic already
                await publish(settings, [files[dataset]], dataset=dataset, force=True)

            async def flowed_again() -> bool:
                got = (await read_all(settings, responses_topic))[responses_topic]
                run.reused = {f"{r.dataset}:{r.sample_id}" for r in (decode(x.value, ResponseReceived) for x in got)
                              if r.reused}  # fmt: skip
                return turns <= run.reused

            await pipeline.wait(flowed_again, 120, "every turn of the re-published conversations answered again")
            run.requests_again = sim.requests_after(t0)
    finally:
        await pipeline.stop()
        run.truths = sim.truth()
        await sim.close()
    run.rows = sink_rows(out_dir)
    return run


@dataclass
class Findings:
    """What the truth contradicts, by sample key."""

    wrong_prompt: list[str] = field(default_factory=list)
    wrong_output: list[str] = field(default_factory=list)
    dataset_answers: list[str] = field(default_factory=list)
    own_answers_missing: list[str] = field(default_factory=list)
    wrong_prefix_fact: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    extends: Counter[bool] = field(default_factory=Counter)
    parallel_call_turns: int = 0


def check_rows(run: Run, model: str) -> Findings:
    """Every checked conversation's rows against the truth: ids, history, prefix facts."""
    found = Findings()
    by_id = {r["id"]: r for r in run.rows}
    tok = T.truth_tokenizer(model)
    for cid, original in run.originals.items():
        state = run.states.get(cid)
        if state is None:
            found.missing.append(cid)
            continue
        answers: list[dict[str, Any]] = []
        previous: dict[str, Any] | None = None
        for turn in range(state.turns_done):
            key = f"{cid}:{turn}"
            row = by_id.get(key)
            if row is None or key not in run.truths:
                found.missing.append(key)
                break
            if row["output_ids"] != run.truths[key]:
                found.wrong_output.append(key)
            history = regenerated_history(original, answers, turn)
            if row["prompt_ids"] != official_ids(history, run.tools_of[cid], model):
                found.wrong_prompt.append(key)
            seen = tok.decode(row["prompt_ids"])
            if "(old" in seen:
                found.dataset_answers.append(key)
            if any(a["content"] and a["content"] not in seen for a in answers):
                found.own_answers_missing.append(key)
            fact = previous is not None and row["prompt_ids"][: len(previous["input_ids"])] == previous["input_ids"]
            if previous is not None:
                found.extends[fact] += 1
            if row["metadata"]["extends_previous_turn"] is not fact:
                found.wrong_prefix_fact.append(key)
            answers.append(true_answer(run.truths[key], model))
            found.parallel_call_turns += len(json.loads(answers[-1]["tool_calls"])) > 1
            previous = row
    return found


def assert_every_turn_true(run: Run, found: Findings, line: str) -> None:
    """Every regenerated turn a row, once; every conversation ended; nothing the truth contradicts."""
    checked = [s for k, s in run.states.items() if k in run.originals]
    assert not found.missing, f"turns or conversations without a row or a state: {found.missing[:5]} {line}"
    assert all(n == 1 for n in Counter(r["id"] for r in run.rows).values()), f"a row written twice: {line}"
    assert set(run.states) == set(run.every) and all(s.state != "in_progress" for s in run.states.values()), line
    assert sum(1 for r in run.rows if r["id"].rsplit(":", 1)[0] in run.originals) == sum(
        s.turns_done for s in checked), line  # fmt: skip
    assert all(s.reason in END_REASONS for s in run.states.values() if s.state == "ended_early"), line
    assert not found.wrong_output, f"output ids differ from the simulator's truth: {found.wrong_output[:5]} {line}"
    assert not found.wrong_prompt, f"prompt ids differ from the official render: {found.wrong_prompt[:5]} {line}"
    assert not found.dataset_answers and not found.own_answers_missing, (
        found.dataset_answers[:3], found.own_answers_missing[:3], line)  # fmt: skip
    assert not found.wrong_prefix_fact, f"prefix facts the ids contradict: {found.wrong_prefix_fact[:5]} {line}"


def expected_end(cid: str, original: list[dict[str, Any]]) -> tuple[str, str]:
    """A ShareGPT conversation, or a trajectory ending on tool results, runs to its end; a trajectory with
    a final answer and a follow-up ends where the model calls tools again."""
    if ":sg" in cid or original[-1]["role"] == "tool":
        return "finished", "finished"
    return "ended_early", "unexpected_tool_call"


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
    files = {CHAT_C: chat_file, CHAT_M: chat_file, TOOLS_C: tools_file, TOOLS_M: tools_file}
    run = await run_conversations(settings, sim, files, COMPLETIONS, again=(CHAT_C,))
    found = check_rows(run, "qwen3")

    def finished(names: tuple[str, ...]) -> int:
        return sum(1 for s in run.states.values() if s.dataset in names and s.state == "finished")

    ended = Counter(f"{s.dataset}/{s.reason}" for s in run.states.values() if s.state == "ended_early")
    ours = [s for s in run.states.values() if s.dataset in COMPLETIONS]
    line = report(
        conversations=len(run.originals), rows=sum(1 for r in run.rows if r["dataset"] in COMPLETIONS),
        turns_regenerated=sum(s.turns_done for s in ours), finished_completions=finished(COMPLETIONS),
        finished_chat=finished(CHAT_MODE), ended_early=dict(ended), parallel_call_turns=found.parallel_call_turns,
        replayed=run.replays, wrong_prompt_ids=len(found.wrong_prompt), wrong_output_ids=len(found.wrong_output),
        extends_previous=dict(found.extends), missing=len(found.missing), reused_turns=len(run.reused),
        requests_while_reused=run.requests_again,
    )  # fmt: skip
    assert_every_turn_true(run, found, line)
    for cid, original in run.originals.items():
        assert (run.states[cid].state, run.states[cid].reason) == expected_end(cid, original), run.states[cid]
    # the re-published conversations flowed again through the response store: no turn paid twice
    assert run.requests_again == 0 and len(run.reused) >= N_CHAT * 2, line
    assert found.parallel_call_turns >= 10 and max(s.turns_done for s in ours) >= 4, line
    assert finished(COMPLETIONS) == finished(CHAT_MODE), line
    # a completions-mode turn dead-lettered after turn 0 and replayed: its conversation went on to its end
    later = [k for k in run.replayed if k.rsplit(":", 1)[0] in run.originals and int(k.rsplit(":", 1)[1]) >= 1]
    assert run.replays > 0 and later, line
    assert all(run.states[k.rsplit(":", 1)[0]].turns_done > int(k.rsplit(":", 1)[1]) for k in later), line


# Profiles other than the simulator's default, each against its own official template. Qwen3-2507 keeps
# the reasoning within a tool loop and drops it before a new user query; DeepSeek-R1 and V3.1 drop it
# from every history turn (and their templates render no tools: their conversations here are chats).
FAMILIES = {"qwen3-thinking-2507": True, "deepseek-r1": False, "deepseek-v3.1": False}


@pytest.mark.parametrize("model", sorted(FAMILIES))
async def test_other_families_in_completions_mode_match_their_official_templates(
    model: str, settings_factory: Callable[..., Any], report: Callable[..., str], tmp_path: Path
) -> None:
    with_tools = FAMILIES[model]
    files = {CHAT_C: write_jsonl(tmp_path / "chat.jsonl", sharegpt_rows(12, random.Random(7)))}
    if with_tools:
        files[TOOLS_C] = write_jsonl(tmp_path / "tools.jsonl", parallel_tool_rows(8))
    sim = await start_simulator(SimulatorOptions(
        profile=model, seed=7, reasoning_tokens=(8, 24), content_tokens=(8, 24), rate_5xx=0.04, keep_truth=True,
        parallel_tool_calls=True,
    ))  # fmt: skip
    common = {"turns": "all", "mode": "completions", "profile": model, "audit": {"usage_offset": 0}}
    settings = settings_factory(
        provider={"base_url": sim.url, "concurrency": 16, "max_attempts": 1, "outage_after": 1000},
        datasets={name: {**common, "send_tools": name == TOOLS_C} for name in files},
    )
    run = await run_conversations(settings, sim, files, tuple(files))
    found = check_rows(run, model)
    line = report(
        conversations=len(run.originals), rows=len(run.rows), turns_regenerated=sum(s.turns_done for s in
        run.states.values()), parallel_call_turns=found.parallel_call_turns, replayed=run.replays,
        wrong_prompt_ids=len(found.wrong_prompt), wrong_output_ids=len(found.wrong_output),
        extends_previous=dict(found.extends), missing=len(found.missing),
    )  # fmt: skip
    assert_every_turn_true(run, found, line)
    for cid, original in run.originals.items():
        assert (run.states[cid].state, run.states[cid].reason) == expected_end(cid, original), run.states[cid]
    # the prefix facts: reasoning dropped before each new user query; kept within a tool loop (2507)
    assert found.extends[False] > 0 and (found.extends[True] > 0) is with_tools, line
    assert (found.parallel_call_turns > 0) is with_tools, line
