"""End-to-end accounting and ground truth from outside the code under test.

A real broker, the simulator over real HTTP with every content fault on, and every stage
in this process: publish → inference → reconstruct → audit → sink, with the budget service
reading along. The truth is independent of reconstruction: the simulator writes the raw
text Qwen3 generates in Qwen3's own format, keeps its encoding per sample key apart from
the answers (``GET /_sim/truth``: it never travels through the pipeline), parses it as
vLLM does, and renders prompts from the OFFICIAL Qwen3 chat template
(``../shared/reference``); the test computes the true prompt ids itself from that template
and the real tokenizer (``tests/conformance/truth.py``), never with our ``render_prompt``.

Asserts, per variant (token ids rebuilt by re-encoding the text, or from logprobs):

- every published prompt ends in exactly one place: one row in the sink files, or dead
  letters for that key only; published == accepted + dead-lettered keys;
- no sample hit by truncate / empty_reasoning / bad_usage is accepted;
- among accepted samples, zero differ from the true ids when a fault changed the token
  count (``noncanonical_len``), and 100% of canonical generations equal the true ids;
- every accepted sample's prompt_ids, input_ids and loss_mask equal the official-template truth;
- without logprobs, same-length non-canonical samples slip through (the documented blind
  spot: counted and printed, expected > 0); with logprobs, none do and every accepted
  sample, non-canonical included, equals the true ids.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from schemas import SampleAudited, decode
from services.audit.app import create_app as audit_app
from services.budget.app import create_app as budget_app
from services.common.kafka import ensure_topics
from services.inference.app import create_app as inference_app
from services.publish.app import publish
from services.reconstruct.app import create_app as reconstruct_app
from services.simulator.app import start_simulator
from services.simulator.options import SimulatorOptions
from services.sink.app import create_app as sink_app
from tests.conformance import truth as T
from tests.e2e.harness import Pipeline, dead_letters, read_all, sink_rows

pytestmark = pytest.mark.e2e

DATASET = "truth"
N_PROMPTS = 150
# Faults that must never reach the training files, whatever the reconstruction method.
REJECTED_FAULTS = frozenset({"truncate", "empty_reasoning", "bad_usage"})
NONCANONICAL = ("noncanonical_len", "noncanonical_same")
OFFICIAL_QWEN3 = T.reference_dir() / "chat-templates" / "Qwen-Qwen3-0.6B.jinja"
SYSTEM = "Reason briefly, then answer."


def question(i: int) -> str:
    """The i-th user question."""
    return f"Question {i}: what is {i} * {i + 3} - {i % 7}?"


def true_prompt_ids(i: int) -> list[int]:
    """The prompt ids a vLLM server feeds Qwen3 for prompt i: official template, real tokenizer."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(i)}]
    text = T.render_template(OFFICIAL_QWEN3.read_text(encoding="utf-8"), messages, add_generation_prompt=True,
                             bos_token="", eos_token="<|im_end|>")
    return list(T.truth_tokenizer("qwen3").encode_prompt(text))


def write_prompts(path: Path, n: int) -> Path:
    """A JSONL file of ``n`` OpenAI-style prompts with stable ids."""
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            row = {
                "id": f"q{i:04d}",
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(i)}],
            }
            f.write(json.dumps(row) + "\n")
    return path


async def publish_and_settle(pipeline: Pipeline, settings: Any, prompts_file: Path, dataset: str, n: int) -> None:
    """Publish ``n`` prompts and wait until each has a sink row or a dead letter."""
    published = await publish(settings, [prompts_file], dataset=dataset)
    assert published.published == n, published
    out_dir = Path(settings.sink.out_dir)

    async def settled() -> bool:
        done = {r["id"] for r in sink_rows(out_dir)} | {d.key for d in await dead_letters(settings)}
        return len(done) >= n

    await pipeline.wait(settled, 200, "every prompt accepted or dead-lettered")


def effective_faults(recorded: list[str]) -> set[str]:
    """The content faults that really changed a generation (a ``<name>_fallback`` cancels ``<name>``)."""
    names = set(recorded)
    return {n for n in names if not n.endswith("_fallback") and f"{n}_fallback" not in names}


@pytest.mark.parametrize("logprobs", [False, True], ids=["reencode", "logprobs"])
async def test_pipeline_accounts_for_every_prompt_and_matches_ground_truth(
    logprobs: bool, settings_factory: Callable[..., Any], report: Callable[..., str], tmp_path: Path
) -> None:
    """Every prompt in exactly one place; accepted ids equal the simulator's true ids."""
    sim = await start_simulator(
        SimulatorOptions(
            seed=11,
            # >= ~60 output ids, so one re-split token pair stays within the 5% round-trip tolerance.
            reasoning_tokens=(40, 80),
            content_tokens=(20, 40),
            rate_truncate=0.08,
            rate_empty_reasoning=0.08,
            rate_bad_usage=0.08,
            rate_noncanonical_len=0.15,
            rate_noncanonical_same=0.25,
            rate_429=0.05,
            retry_after_s=0.05,
            logprobs=logprobs,
            keep_truth=True,
            chat_template_file=str(OFFICIAL_QWEN3),
        )
    )
    settings = settings_factory(
        provider={
            "base_url": sim.url,
            "concurrency": 32,
            "request_logprobs": logprobs,
            "backoff_initial_s": 0.05,
            "backoff_max_s": 0.2,
            "max_attempts": 8,
        },
        # The simulator counts every output id (offset 0). Configured, not learned: while an
        # offset is being learned, any gap within +-2 passes, so a noncanonical_len sample
        # (gap 1) among the first learn_offset_samples would be accepted with wrong ids.
        datasets={DATASET: {"audit": {"usage_offset": 0}}},
        # A third of these answers are faulty on purpose, to prove where each one ends; the quality
        # halt (on by default at min_yield 0.9) would stop the run before every prompt is answered.
        budget={"min_yield": 0},
    )
    out_dir = Path(settings.sink.out_dir)
    prompts_file = write_prompts(tmp_path / "prompts.jsonl", N_PROMPTS)
    await ensure_topics(settings.kafka, [DATASET])
    accepted_topic = settings.kafka.topic("accepted")
    responses_topic = settings.kafka.topic("responses")

    pipeline = Pipeline()
    try:
        budget = budget_app(settings)
        await pipeline.start("budget", budget)
        await pipeline.start("inference", inference_app(settings))
        await pipeline.start("reconstruct", reconstruct_app(settings))
        await pipeline.start("audit", audit_app(settings))
        await pipeline.start("sink", sink_app(settings))
        await publish_and_settle(pipeline, settings, prompts_file, DATASET, N_PROMPTS)
        n_responses = len((await read_all(settings, responses_topic))[responses_topic])
        await pipeline.wait(
            lambda: DATASET in budget.ledger.scopes and budget.ledger.scopes[DATASET].responses >= n_responses,
            60,
            "the budget counted every response",
        )
        budget_completion = budget.ledger.scopes[DATASET].completion_tokens
    finally:
        await pipeline.stop()
        stats = sim.stats()
        truths = sim.truth()
        await sim.close()

    prompts_topic = settings.kafka.prompts_topic(DATASET)
    got = await read_all(settings, prompts_topic, accepted_topic, responses_topic)
    published_keys = Counter((r.key or b"").decode() for r in got[prompts_topic])
    accepted = {}
    for r in got[accepted_topic]:
        audited = decode(r.value, SampleAudited)
        accepted[f"{audited.dataset}:{audited.sample_id}"] = audited
    rows = sink_rows(out_dir)
    row_keys = Counter(r["id"] for r in rows)
    letters = await dead_letters(settings)
    dead_keys = {d.key for d in letters}
    key_faults = {k: effective_faults(v) for k, v in stats["key_faults"].items()}

    # --- ground truth, per accepted sample
    wrong_by_fault: Counter[str] = Counter()
    right_by_fault: Counter[str] = Counter()
    canonical_total = canonical_equal = 0
    no_truth: list[str] = []
    sink_differs: list[str] = []
    rejected_fault_accepted: list[str] = []
    rows_by_key = {r["id"]: r for r in rows}
    prompt_wrong: list[str] = []
    for key, audited in accepted.items():
        truth_prompt = true_prompt_ids(int(audited.sample_id[1:]))
        row = rows_by_key.get(key)
        if list(audited.sample.prompt_ids) != truth_prompt or (
            row is not None and (row["input_ids"][: len(truth_prompt)] != truth_prompt
                                 or row["loss_mask"] != [0] * len(truth_prompt) + [1] * len(audited.sample.output_ids))
        ):
            prompt_wrong.append(key)
        truth = truths.get(key)
        if truth is None:
            no_truth.append(key)
            continue
        output_ids = list(audited.sample.output_ids)
        row = rows_by_key.get(key)
        if row is not None and row["output_ids"] != output_ids:
            sink_differs.append(key)
        faults = key_faults.get(key, set())
        if faults & REJECTED_FAULTS:
            rejected_fault_accepted.append(f"{key}:{sorted(faults)}")
        kinds = [f for f in NONCANONICAL if f in faults]
        if not kinds:
            canonical_total += 1
            canonical_equal += output_ids == truth
        for kind in kinds:
            (right_by_fault if output_ids == truth else wrong_by_fault)[kind] += 1
    all_equal = sum(1 for k, a in accepted.items() if list(a.sample.output_ids) == truths.get(k))
    fault_keys = Counter(f for faults in key_faults.values() for f in faults)
    total_completion = sum(
        json.loads(r.value).get("usage", {}).get("completion_tokens", 0) for r in got[responses_topic]
    )

    line = report(
        variant="logprobs" if logprobs else "reencode",
        published=len(published_keys),
        accepted_rows=len(rows),
        dead_lettered_keys=len(dead_keys),
        dead_letter_reasons=dict(Counter(f"{d.stage}/{d.reason}" for d in letters)),
        faults_by_key=dict(sorted(fault_keys.items())),
        canonical_accepted=canonical_total,
        canonical_equal_truth=canonical_equal,
        accepted_equal_truth=f"{all_equal}/{len(accepted)}",
        noncanonical_same_accepted_wrong_ids=wrong_by_fault["noncanonical_same"],
        noncanonical_same_accepted_right_ids=right_by_fault["noncanonical_same"],
        noncanonical_len_accepted_wrong_ids=wrong_by_fault["noncanonical_len"],
        noncanonical_len_accepted_right_ids=right_by_fault["noncanonical_len"],
        methods=dict(Counter(a.sample.method for a in accepted.values())),
        prompt_ids_differ_from_official_template=len(prompt_wrong),
    )

    # --- accounting: every prompt in exactly one place
    assert len(published_keys) == N_PROMPTS and max(published_keys.values()) == 1, line
    assert all(n == 1 for n in row_keys.values()), f"a key written twice to the sink: {line}"
    assert not set(row_keys) & dead_keys, f"keys both accepted and dead-lettered: {set(row_keys) & dead_keys}"
    assert set(row_keys) | dead_keys == set(published_keys), f"keys lost or invented: {line}"
    assert len(published_keys) == len(row_keys) + len(dead_keys), line
    assert set(accepted) == set(row_keys), "the accepted topic and the sink files disagree"
    assert not sink_differs, f"sink rows whose output_ids differ from the accepted sample: {sink_differs[:5]}"
    assert not no_truth, f"accepted samples the simulator holds no truth for: {no_truth[:5]}"
    assert not prompt_wrong, f"prompt ids / input ids / loss mask differ from the official template: {prompt_wrong[:5]}"
    assert budget_completion == total_completion, f"budget {budget_completion} != responses {total_completion}: {line}"

    # --- the faults really fired, and the ones that must be rejected were
    for fault in (*REJECTED_FAULTS, *NONCANONICAL):
        assert fault_keys[fault] > 0, f"fault {fault} never fired: {line}"
    assert not rejected_fault_accepted, f"truncated/empty/bad-usage samples accepted: {rejected_fault_accepted[:5]}"
    reasons = {r for d in letters for r in d.reasons.split(",") if r} | {d.reason for d in letters}
    assert {"finish_stop", "reasoning_nonempty", "usage_matches"} <= reasons, line

    # --- ground truth
    assert canonical_total > 0, line
    assert canonical_equal == canonical_total, f"canonical generations rebuilt wrong: {line}"
    assert wrong_by_fault["noncanonical_len"] == 0, f"a count-changing fault was accepted with wrong ids: {line}"
    if logprobs:
        assert wrong_by_fault["noncanonical_same"] == 0, line
        assert all_equal == len(accepted), f"with logprobs every accepted sample must equal the truth: {line}"
        # Non-canonical generations are recovered, not merely rejected.
        assert right_by_fault["noncanonical_len"] > 0 and right_by_fault["noncanonical_same"] > 0, line
        assert {a.sample.method for a in accepted.values()} == {"logprobs"}, line
    else:
        # The documented blind spot: same length, same text, other ids; no count check sees it.
        assert wrong_by_fault["noncanonical_same"] > 0, line
        assert right_by_fault["noncanonical_len"] == 0, line
        assert "noncanonical_len" not in {f for a in accepted for f in key_faults.get(a, set())}, line
