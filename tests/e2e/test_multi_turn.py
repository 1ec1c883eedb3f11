"""On-policy multi-turn regeneration end to end (issue 26): a real broker, the simulator over HTTP.

50 ShareGPT conversations of 2-6 assistant turns and 20 tool trajectories (OpenAI ``messages``
with ``tools``) are published with ``turns = "all"``; inference, reconstruct, audit, sink, the
budget and the continuation stage run in this process. The simulator renders prompts with the
OFFICIAL Qwen3 template (``../shared/reference``) and 5xx-fails some requests (one attempt
only), so turns at every depth become dead letters; they are replayed until none is left.

The truth is built here, apart from the code under test: turn k's history is the dataset's
conversation up to its k-th answer, every earlier answer replaced by the answer the sink wrote
for that turn (content, reasoning, tool calls) and each cached tool result put under the
regenerated call's id; it is rendered with the official template and encoded with the truth
tokenizer of ``tests/conformance/truth.py``.

Asserts: one row per regenerated turn, no key written twice; every conversation finished or
ended early with a reason (``conversation-state``); every row's prompt_ids equal the official
render of its regenerated history; a conversation whose turn was dead-lettered and replayed
went on to its end; the budget counted every paid turn. A second test halts the dataset
mid-conversation: the next turns wait on ``prompts.<dataset>`` unanswered until the resume.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from schemas import ConversationProgressed, Message, decode, topology
from services.common.kafka import ensure_topics
from services.continuation.core import END_REASONS, turn_points
from services.dlq.app import replay
from services.dlq.core import Filters
from services.publish.app import publish
from services.publish.core import NormaliseOptions, normalise
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from services.status.app import collect
from tests.conformance import truth as T
from tests.e2e.harness import Pipeline, dead_letters, read_all, sink_rows
from tests.e2e.test_pipeline_truth import OFFICIAL_QWEN3

pytestmark = pytest.mark.e2e

CHAT, TOOLS = "chat", "tools"
N_CHAT, N_TOOLS = 50, 20
TOOLBOX = [
    {"type": "function", "function": {"name": name, "description": f"{name} of a place",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    for name in ("get_weather", "get_time", "get_population")
]


def sharegpt_rows(n: int, rng: random.Random) -> list[dict[str, Any]]:
    """ShareGPT conversations of 2-6 assistant turns (answers by 'another model')."""
    rows = []
    for i in range(n):
        turns: list[dict[str, str]] = [{"from": "system", "value": "Answer in one sentence."}]
        for k in range(rng.randint(2, 6)):
            turns.append({"from": "human", "value": f"Conversation {i}, question {k}: what is {i} + {k}?"})
            turns.append({"from": "gpt", "value": f"(old model) {i + k}."})
        rows.append({"id": f"sg{i:03d}", "conversations": turns})
    return rows


def tool_rows(n: int, rng: random.Random) -> list[dict[str, Any]]:
    """Tool trajectories: 1-2 tool-calling turns with cached results, a final answer, sometimes a follow-up."""
    rows = []
    for i in range(n):
        tools = TOOLBOX[: 1 + i % 3]
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Trip {i}: tell me about Oslo."}]
        for step in range(1 + i % 2):
            name = tools[rng.randrange(len(tools))]["function"]["name"]
            call_id = f"orig-{i}-{step}"
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": '{"city": "Oslo"}'}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": f"{name}: result {i}.{step}"})
        messages.append({"role": "assistant", "content": "(old model) Here it is."})
        if i % 4 == 0:
            messages += [{"role": "user", "content": "Thanks, and Rome?"}, {"role": "assistant", "content": "(old)"}]
        rows.append({"id": f"tr{i:03d}", "messages": messages, "tools": tools})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def regenerated_history(original: list[dict[str, Any]], answers: list[dict[str, Any]], upto: int) -> list[dict]:
    """The official-template input of turn ``upto``: the dataset's messages with earlier answers replaced.

    ``original`` holds the conversation as the dataset has it (OpenAI shape, system first);
    ``answers[j]`` the sink's last turn of row j. The i-th cached tool result after answer j
    goes under the id of answer j's i-th tool call (semi-on-policy pairing).
    """
    points = [i for i, m in enumerate(original) if m["role"] == "assistant"]
    if original[-1]["role"] != "assistant":
        points.append(len(original))
    out: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for index, message in enumerate(original[: points[upto]]):
        if message["role"] == "assistant":
            answer = answers[points.index(index)]
            turn: dict[str, Any] = {"role": "assistant", "content": answer["content"]}
            calls = json.loads(answer["tool_calls"])
            if calls:
                turn["tool_calls"] = list(calls)
            if answer["reasoning_content"]:
                turn["reasoning_content"] = answer["reasoning_content"]
            out.append(turn)
        elif message["role"] == "tool":
            out.append({"role": "tool", "content": message["content"], "tool_call_id": calls.pop(0)["id"]})
        else:
            out.append({"role": message["role"], "content": message["content"]})
    return out


def official_prompt_ids(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """The ids vLLM feeds Qwen3 for these messages: the official template, the real tokenizer."""
    text = T.render_template(OFFICIAL_QWEN3.read_text(encoding="utf-8"), T.server_messages("qwen3", messages),
                             tools=tools, add_generation_prompt=True, bos_token="", eos_token="<|im_end|>")
    return list(T.truth_tokenizer("qwen3").encode_prompt(text))


async def conversation_states(settings: Any) -> dict[str, ConversationProgressed]:
    """The latest state of every conversation on ``conversation-state``."""
    topic = settings.kafka.topic(topology.CONVERSATIONS)
    latest: dict[str, ConversationProgressed] = {}
    for r in (await read_all(settings, topic))[topic]:
        latest[(r.key or b"").decode()] = decode(r.value, ConversationProgressed)
    return latest


async def test_every_turn_is_regenerated_on_the_regenerated_history(
    settings_factory: Callable[..., Any], report: Callable[..., str], tmp_path: Path
) -> None:
    rng = random.Random(26)
    chat_file = write_jsonl(tmp_path / "chat.jsonl", sharegpt_rows(N_CHAT, rng))
    tools_file = write_jsonl(tmp_path / "tools.jsonl", tool_rows(N_TOOLS, rng))
    sim = await start_simulator(SimulatorOptions(
        seed=26, reasoning_tokens=(8, 24), content_tokens=(8, 24), rate_5xx=0.05, logprobs=True,
        chat_template_file=str(OFFICIAL_QWEN3),
    ))  # fmt: skip
    audit = {"usage_offset": 0}
    settings = settings_factory(
        provider={"base_url": sim.url, "concurrency": 32, "max_attempts": 1, "outage_after": 1000,
                  "request_logprobs": True},  # exact ids of tool calls (vLLM re-serialises their arguments)
        datasets={CHAT: {"turns": "all", "audit": audit}, TOOLS: {"turns": "all", "send_tools": True, "audit": audit}},
    )
    out_dir = Path(settings.sink.out_dir)
    await ensure_topics(settings.kafka, [CHAT, TOOLS])
    originals: dict[str, list[dict[str, Any]]] = {}
    tools_of: dict[str, list[dict[str, Any]] | None] = {}
    for dataset, path in ((CHAT, chat_file), (TOOLS, tools_file)):
        for line in path.read_text(encoding="utf-8").splitlines():
            prompt = normalise(json.loads(line), NormaliseOptions(dataset=dataset, turns="all"))
            assert prompt.conversation is not None
            cid = f"{dataset}:{prompt.conversation.conversation_id}"
            originals[cid] = msgspec.to_builtins(prompt.conversation.original)
            tools_of[cid] = prompt.tools
    replays = 0
    dead_at: dict[str, set[int]] = {}
    pipeline = Pipeline()
    try:
        await pipeline.start_stages(settings, "budget", "inference", "reconstruct", "audit", "sink", "continuation")
        budget = pipeline.services["budget"]
        for dataset, path in ((CHAT, chat_file), (TOOLS, tools_file)):
            sent = await publish(settings, [path], dataset=dataset)
            assert sent.published == (N_CHAT if dataset == CHAT else N_TOOLS), sent

        replayed: Counter[str] = Counter()  # dead letters replayed, by key

        async def settled() -> bool:
            states = await conversation_states(settings)
            rows = {r["id"] for r in sink_rows(out_dir)}
            letters = Counter(d.key for d in await dead_letters(settings))
            dead = {key for key, n in letters.items() if n > replayed[key]}  # not replayed yet
            for cid in originals:
                state = states.get(cid)
                if state is not None and state.state != "in_progress":
                    continue
                turn = 0 if state is None else state.turns_done
                key = f"{cid}:{turn}"
                if key in rows or key not in dead:
                    return False  # its next turn is on its way
            return True

        for _ in range(6):
            await pipeline.wait(settled, 300, "every conversation ended or stopped at a dead letter")
            letters = [d for d in await dead_letters(settings) if d.stage == "inference"]
            for d in letters:
                dead_at.setdefault(d.key.rsplit(":", 1)[0], set()).add(int(d.key.rsplit(":", 1)[1]))
            done = await replay(settings, Filters(stage="inference"))
            if not done.replayed:
                break
            replays += len(done.replayed)
            replayed.update(p.record.key_text for p in done.replayed)
        states = await conversation_states(settings)
        status = await collect(settings)
        responses_topic = settings.kafka.topic("responses")
        n_responses = len((await read_all(settings, responses_topic))[responses_topic])
        await pipeline.wait(lambda: sum(s.responses for k, s in budget.ledger.scopes.items() if k != "global")
                            >= n_responses, 60, "the budget counted every response")
        budget_completion = sum(budget.ledger.scopes[d].completion_tokens for d in (CHAT, TOOLS))
    finally:
        await pipeline.stop()
        await sim.close()

    responses = (await read_all(settings, responses_topic))[responses_topic]
    paid_completion = sum(json.loads(r.value)["usage"].get("completion_tokens", 0)
                          for r in responses if not json.loads(r.value).get("reused"))
    rows = sink_rows(out_dir)
    row_ids = Counter(r["id"] for r in rows)
    by_id = {r["id"]: r for r in rows}
    ended = Counter(s.reason for s in states.values() if s.state == "ended_early")
    finished = sum(1 for s in states.values() if s.state == "finished")
    wrong_prompt: list[str] = []
    missing: list[str] = []
    for cid, original in originals.items():
        state = states.get(cid)
        if state is None:
            missing.append(cid)
            continue
        answers = []
        for turn in range(state.turns_done):
            row = by_id.get(f"{cid}:{turn}")
            if row is None:
                missing.append(f"{cid}:{turn}")
                break
            assert row["metadata"]["conversation_id"] == cid.split(":", 1)[1] and row["metadata"]["turn"] == turn
            truth = official_prompt_ids(regenerated_history(original, answers, turn), tools_of[cid])
            if row["prompt_ids"] != truth:
                wrong_prompt.append(row["id"])
            answers.append(row["conversations"][-1])
    line = report(
        conversations=len(originals), finished=finished, ended_early=dict(ended), rows=len(rows),
        turns_regenerated=sum(s.turns_done for s in states.values()),
        dead_lettered_turns=sum(map(len, dead_at.values())), replayed=replays,
        wrong_prompt_ids=len(wrong_prompt), missing=len(missing),
    )  # fmt: skip

    assert not missing, f"turns or conversations without a row or a state: {missing[:5]} {line}"
    assert all(n == 1 for n in row_ids.values()), f"a row written twice: {line}"
    assert len(rows) == sum(s.turns_done for s in states.values()), f"rows != regenerated turns: {line}"
    assert set(states) == set(originals) and all(s.state != "in_progress" for s in states.values()), line
    assert not wrong_prompt, f"prompt ids differ from the official template's render: {wrong_prompt[:5]} {line}"
    # chat has no tools: every conversation runs to its last turn
    for cid, original in originals.items():
        if cid.startswith(f"{CHAT}:"):
            assert states[cid].state == "finished", (cid, states[cid])
            assert states[cid].turns_done == len(turn_points(_messages(original))) >= 2
    assert max(s.turns_done for k, s in states.items() if k.startswith(f"{CHAT}:")) >= 5, line
    # tool trajectories: semi-on-policy; some go on past the first tool result, the rest end with a reason
    tool_states = [s for k, s in states.items() if k.startswith(f"{TOOLS}:")]
    assert all(s.reason in END_REASONS for s in tool_states if s.state == "ended_early"), line
    assert any(s.turns_done >= 2 for s in tool_states) and ended, line
    # a turn dead-lettered (at any depth) and replayed continued its conversation to the end
    assert replays > 0 and any(max(turns) >= 1 for turns in dead_at.values()), line
    for cid, turns in dead_at.items():
        assert states[cid].turns_done > max(turns), (cid, turns, states[cid])
    # `draftstream status` counts the same conversations, by state and reason
    assert Counter((s.dataset, s.state, s.reason) for s in status.conversations.values()) == Counter(
        (s.dataset, s.state, s.reason) for s in states.values()
    )
    assert budget_completion == paid_completion, f"budget {budget_completion} != paid {paid_completion}: {line}"


def _messages(original: list[dict[str, Any]]) -> list[Message]:
    return [msgspec.convert(m, Message) for m in original]


@pytest.mark.parametrize("mode", ["chat", "completions"])
async def test_a_halt_holds_the_next_turns_and_the_budget_counts_every_turn(
    mode: str, settings_factory: Callable[..., Any], report: Callable[..., str], tmp_path: Path
) -> None:
    """Continuations are prompts like any other, in either mode: a dataset halt holds them at inference;
    after the resume every conversation runs to its end, and the budget has counted each turn once."""
    from schemas import Halt, Resume
    from services.control import publish_control

    rows_file = write_jsonl(tmp_path / "chat.jsonl", sharegpt_rows(20, random.Random(7)))
    turns = sum(sum(1 for t in json.loads(line)["conversations"] if t["from"] == "gpt")
                for line in rows_file.read_text("utf-8").splitlines())
    sim = await start_simulator(SimulatorOptions(seed=7, reasoning_tokens=(8, 16), content_tokens=(8, 16),
                                                 latency_s=0.05, chat_template_file=str(OFFICIAL_QWEN3)))
    settings = settings_factory(provider={"base_url": sim.url, "concurrency": 8},
                                datasets={CHAT: {"turns": "all", "mode": mode, "audit": {"usage_offset": 0}}})
    out_dir = Path(settings.sink.out_dir)
    await ensure_topics(settings.kafka, [CHAT])
    prompts_topic, responses_topic = settings.kafka.prompts_topic(CHAT), settings.kafka.topic("responses")

    async def counts() -> tuple[int, int]:
        got = await read_all(settings, prompts_topic, responses_topic)
        return len({r.key for r in got[prompts_topic]}), len({r.key for r in got[responses_topic]})

    pipeline = Pipeline()
    try:
        await pipeline.start_stages(settings, "budget", "inference", "reconstruct", "audit", "sink", "continuation")
        budget = pipeline.services["budget"]
        await publish(settings, [rows_file], dataset=CHAT)
        await pipeline.wait(lambda: len(sink_rows(out_dir)) >= 10, 120, "the first turns accepted")
        await publish_control(settings, Halt(scope=CHAT, reason="test halt", by="test"))
        # the halt holds: once what was in flight is through, turns stay published and unanswered
        held: list[tuple[int, int]] = []

        async def holding() -> bool:
            held.append(await counts())
            return len(held) >= 4 and len(set(held[-4:])) == 1 and held[-1][0] > held[-1][1]

        await pipeline.wait(holding, 60, "next turns held on the prompts topic while halted")
        await publish_control(settings, Resume(scope=CHAT, reason="test over", by="test"))

        async def all_finished() -> bool:
            states = await conversation_states(settings)
            return len(states) == 20 and all(s.state == "finished" for s in states.values())

        await pipeline.wait(all_finished, 180, "every conversation finished after the resume")
        await pipeline.wait(lambda: CHAT in budget.ledger.scopes and budget.ledger.scopes[CHAT].responses >= turns,
                            60, "the budget counted every turn")
        counted = budget.ledger.scopes[CHAT].responses
    finally:
        await pipeline.stop()
        await sim.close()
    rows = sink_rows(out_dir)
    line = report(turns=turns, rows=len(rows), held_prompts_vs_responses=held[-1], budget_responses=counted)
    assert len(rows) == turns == len({r["id"] for r in rows}), line
    assert counted == turns, f"the budget counted {counted} responses for {turns} turns: {line}"
