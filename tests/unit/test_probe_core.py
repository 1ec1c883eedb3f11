"""The probe's pure findings: evidence from logprob tokens and exact ids, forecast, exit decision.

The answers are built by hand from Qwen3's own special-token strings and ids (TOKENS.md:
``</think>`` 151668, ``<|im_end|>`` 151645), not by the code under test.
"""

from __future__ import annotations

from rich.console import Console

from schemas import (
    LogprobToken,
    Message,
    PromptPublished,
    ResponseReceived,
    SampleAudited,
    SampleReconstructed,
    Usage,
)
from services.probe.core import DatasetReport, ProbeAnswer, ProbeRun, forecast, render, summarize

THINK_END, EOT = "</think>", "<|im_end|>"
THINK_END_ID, EOT_ID = 151668, 151645
FACTS = {"think_start": "<think>", "think_end": THINK_END, "end_of_turn": EOT, "end_of_turn_id": EOT_ID}


def answer(
    *,
    reasoning: str,
    content: str,
    raw: list[str] | None,
    completion: int,
    accepted: bool = True,
    upstream: str = "u",
    prompt_tokens: int = 3,
    method: str = "logprobs",
    cost: float = 0.01,
) -> ProbeAnswer:
    """A probe answer whose logprob tokens are ``raw`` (None: no logprobs) and whose ids number len(raw)."""
    prompt = PromptPublished(dataset="d", sample_id="s", messages=[Message(role="user", content="q")])
    response = ResponseReceived(
        dataset="d", sample_id="s", prompt=prompt, provider="openrouter", model="m", upstream_provider=upstream,
        reasoning=reasoning, content=content,
        logprobs=None if raw is None else [LogprobToken(token=t) for t in raw],
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, cost=cost),
    )
    n = len(raw) if raw is not None else completion
    ids = [7] * (n - 1) + [EOT_ID]
    sample = SampleReconstructed(
        dataset="d", sample_id="s", profile="qwen3", response=response, prompt_ids=[1, 2, 3], output_ids=ids,
        loss_mask=[0, 0, 0] + [1] * n, method=method,  # type: ignore[arg-type]
    )
    audited = SampleAudited(dataset="d", sample_id="s", sample=sample, passed=accepted,
                            reasons=[] if accepted else ["usage_matches"])
    return ProbeAnswer(response, sample=sample, audited=audited)


# The model's text: "\nthink\n</think>\n\nhi<|im_end|>" as seven tokens.
RAW = ["\n", "think", "\n", THINK_END, "\n\n", "hi", EOT]


def test_text_that_keeps_the_whitespace_the_tokens_carry_is_kept_and_all_counted() -> None:
    found = summarize([answer(reasoning="\nthink\n", content="\n\nhi", raw=RAW, completion=len(RAW))],
                      logprobs_asked=True, **FACTS)
    assert found.whitespace == dict.fromkeys(("reasoning_start", "reasoning_end", "content_start"), "kept") | {
        "content_end": "unproven"  # "hi" ends in no whitespace: nothing to strip, nothing proven
    }
    assert (found.logprobs, found.end_of_turn, found.usage_wrong) == ("present", "counted", 0)
    assert (found.prompt_agrees, found.prompt_compared) == (1, 1)


def test_stripped_text_end_of_turn_left_out_and_logprobs_null() -> None:
    stripped = answer(reasoning="think", content="hi", raw=RAW, completion=len(RAW) - 1, accepted=False)
    found = summarize([stripped], logprobs_asked=True, **FACTS)
    assert set(found.whitespace.values()) == {"stripped", "unproven"}
    assert found.whitespace["reasoning_start"] == found.whitespace["content_start"] == "stripped"
    assert found.end_of_turn == "not counted"
    assert found.reasons == {"usage_matches": 1}
    null = summarize([answer(reasoning="x", content="y", raw=None, completion=5, method="reencode")],
                     logprobs_asked=True, **FACTS)
    assert (null.logprobs, null.end_of_turn) == ("null", "unproven")  # re-encoded ids prove no count
    assert set(null.whitespace.values()) == {"unproven"}


def test_disagreeing_answers_are_mixed_and_a_wrong_count_is_counted_apart() -> None:
    good = answer(reasoning="\nthink\n", content="\n\nhi", raw=RAW, completion=len(RAW))
    short = answer(reasoning="\nthink\n", content="\n\nhi", raw=RAW, completion=len(RAW) - 1)
    wrong = answer(reasoning="\nthink\n", content="\n\nhi", raw=RAW, completion=len(RAW) + 9, prompt_tokens=4)
    found = summarize([good, short, wrong], logprobs_asked=False, **FACTS)
    assert found.end_of_turn == "mixed" and found.usage_wrong == 1
    assert found.logprobs == "not asked"
    assert (found.prompt_agrees, found.prompt_compared) == (2, 3)


def test_forecast_cost_per_accepted_sample_and_the_exit_decision() -> None:
    answers = [answer(reasoning="r", content="c", raw=None, completion=10, method="reencode", accepted=i < 3)
               for i in range(4)]
    found = summarize(answers, logprobs_asked=False, **FACTS)
    assert found.share == 0.75 and found.dollars_per_accepted == 0.04 / 3
    outlook = forecast(found, 1000)
    assert (outlook.accepted, outlook.tokens_paid, outlook.tokens_kept) == (750, 10_000, 7_500)
    assert abs(outlook.dollars - 10.0) < 1e-9
    report = DatasetReport("d", found, {"u": found}, outlook, requests_sent=4)
    assert report.below(0.9) and not report.below(0.75)
    run = ProbeRun([report])
    assert run.failed(0.9) and not run.failed(0.5)
    assert ProbeRun(skipped={"x": "halted"}).failed(0.0)
    console = Console(width=300, record=True)
    console.print(render(run, 0.9, wide=True))
    text = console.export_text()
    assert "750 of 1,000 accepted" in text and "below min_yield" in text
    row = next(line for line in text.splitlines() if " all " in line)
    assert row.index("3 (75%)") < row.index("$0.0133") < row.index("usage_matches 1")  # under their headings
    heading = next(line for line in text.splitlines() if "reasons of the rest" in line)
    assert heading.index("accepted") < heading.index("$/accepted") < heading.index("reasons of the rest")


def test_a_profile_off_the_providers_prompt_count_on_most_answers_is_named() -> None:
    def report(prompt_tokens: list[int], offset: int = 0) -> DatasetReport:
        answers = [answer(reasoning="r", content="c", raw=None, completion=5, prompt_tokens=n) for n in prompt_tokens]
        found = summarize(answers, logprobs_asked=False, prompt_offset=offset, **FACTS)
        outlook = forecast(found, 10)
        return DatasetReport("d", found, {}, outlook, requests_sent=0, profile="qwen3", prompt_offset=offset)

    # The rendered prompt is 3 ids (answer()); the provider counts 3 on agreeing answers.
    assert report([3, 3, 3, 5]).tokenizer_mismatch is None  # one answer off: not the tokenizer
    assert report([3, 3, 5, 5]).tokenizer_mismatch is None  # half: not most
    mismatch = report([3, 7, 7, 8]).tokenizer_mismatch
    assert mismatch is not None and "profile 'qwen3'" in mismatch and "3 of 4 answers" in mismatch
    assert "+4 on 2" in mismatch and "[datasets.d] profile" in mismatch
    assert report([4, 4, 4]).tokenizer_mismatch is not None
    assert report([4, 4, 4], offset=1).tokenizer_mismatch is None  # the configured offset is the convention
    assert ProbeRun([report([9, 9])]).failed(0.0)  # exit 1 even with every answer accepted


def test_the_report_names_an_upstream_caught_stripping() -> None:
    from rich.console import Console

    from services.probe.core import DatasetReport, Findings, Forecast, ProbeRun, render

    report = DatasetReport(dataset="math", findings=Findings(answers=2), upstreams={},
                           forecast=Forecast(prompts=2, accepted=0, dollars=0.0, tokens_paid=0, tokens_kept=0),
                           requests_sent=2, strips=("openai/m (evidence math:t: whitespace may be missing)",))
    console = Console(record=True, width=400)
    console.print(render(ProbeRun(reports=[report]), 0.5, wide=True))
    assert "strips_at_edges: openai/m (evidence math:t" in console.export_text()


def test_answers_refused_for_their_output_still_compare_their_prompt_count() -> None:
    """A profile whose prompts miss the provider's count is named even when every output was refused."""
    import dataclasses

    refused = [
        dataclasses.replace(answer(reasoning="r", content="c", raw=None, completion=5, prompt_tokens=12),
                            sample=None, audited=None, dead_reason="whitespace_stripped", prompt_length=3)
        for _ in range(4)
    ]  # fmt: skip
    found = summarize(refused, logprobs_asked=False, prompt_offset=0, **FACTS)
    assert (found.accepted, found.prompt_compared, found.prompt_agrees) == (0, 4, 0)
    report = DatasetReport("d", found, {}, forecast(found, 10), requests_sent=0, profile="qwen3")
    assert report.tokenizer_mismatch is not None and "profile 'qwen3'" in report.tokenizer_mismatch
    unrendered = dataclasses.replace(refused[0], prompt_length=None)
    assert summarize([unrendered], logprobs_asked=False, prompt_offset=0, **FACTS).prompt_compared == 0
