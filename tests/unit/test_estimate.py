"""``draftstream estimate``: exact prompt tokens (checked against the official template and a real
tokenizer, not our own renderer), completion bounds, dollars and cap verdicts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from schemas import PromptPublished
from services.common.config import DatasetSettings, Settings
from services.estimate.app import DatasetFiles, Estimator, estimate_files, report_for
from services.estimate.core import (
    Caps,
    DatasetEstimate,
    Observed,
    ScopeTotals,
    build_report,
    cap_checks,
    expected_completion,
)
from services.inference.adapters.request_bodies import chat_request_body
from services.publish.app import Rejection, iter_prompts
from services.publish.core import NormaliseOptions
from tests.conformance import truth

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "services" / "demo" / "data"
QWEN3_TEMPLATE = "Qwen-Qwen3-0.6B.jinja"


def demo_prompts(name: str) -> list[PromptPublished]:
    items = iter_prompts([DEMO / f"{name}.jsonl"], NormaliseOptions(dataset=name))
    return [p for p in items if p is not None and not isinstance(p, Rejection)]


def server_count(prompt: PromptPublished, dataset: DatasetSettings) -> int:
    """Prompt tokens as an OpenAI-compatible server counts them: the request body we send, rendered
    by the official Qwen3 template (HF semantics) and encoded by the truth tokenizer (qwen ranks)."""
    from services.profiles import profile_spec

    body = chat_request_body(
        prompt, dataset, model="m", max_tokens=1, extra_body={}, logprobs=False,
        template_kwargs=profile_spec("qwen3").render_kwargs() or None,
    )  # fmt: skip
    text = truth.render_template(
        truth.template_source(QWEN3_TEMPLATE),
        truth.server_messages("qwen3", body["messages"]),
        tools=body.get("tools"),
        add_generation_prompt=True,
        bos_token="",
        eos_token="<|im_end|>",
        **body.get("chat_template_kwargs", {}),
    )
    return len(truth.truth_tokenizer("qwen3").encode_prompt(text))


@pytest.mark.parametrize(
    ("name", "send_tools"), [("math", False), ("code", False), ("tools", False), ("tools", True)]
)
def test_prompt_tokens_match_the_official_template_and_tokenizer(name: str, send_tools: bool) -> None:
    settings = Settings(datasets={name: DatasetSettings(profile="qwen3", send_tools=send_tools, max_tokens=2048)})
    estimate = estimate_files(settings, DatasetFiles(name, [DEMO / f"{name}.jsonl"]))
    prompts = demo_prompts(name)
    assert estimate.prompts == len(prompts) > 0
    expected = sum(server_count(p, settings.dataset(name)) for p in prompts)
    assert estimate.prompt_tokens == expected
    assert estimate.tools_sent == sum(1 for p in prompts if p.tools)  # they reach the model whatever send_tools says
    assert estimate.tools_in_text == sum(1 for p in prompts if p.tools_in_text)
    assert estimate.completion_bound == 2048 * len(prompts)


@pytest.mark.parametrize(
    "section", [{}, {"send_tools": False}, {"send_tools": True}, {"tool_route": "prompt"}, {"mode": "completions"}]
)
def test_every_row_s_tools_reach_the_model_exactly_once(section: dict[str, object]) -> None:
    """Whatever the setting, each row counts as the OFFICIAL template renders it with its tools, once.

    Read from the file itself, not through publish: a row with a ``tools`` field is rendered with
    them; a Glaive row (functions in its own system text, no field) without a second ``# Tools``.
    """
    rows = [json.loads(line) for line in (DEMO / "tools.jsonl").read_text(encoding="utf-8").splitlines()]
    assert any("tools" in r for r in rows) and any("tools" not in r for r in rows)
    settings = Settings(datasets={"tools": DatasetSettings.model_validate(section)})
    estimate = estimate_files(settings, DatasetFiles("tools", [DEMO / "tools.jsonl"]))
    tokenizer = truth.truth_tokenizer("qwen3")
    expected = 0
    for row in rows:
        text = truth.render_template(
            truth.template_source(QWEN3_TEMPLATE), truth.server_messages("qwen3", row["messages"]),
            tools=row.get("tools"), add_generation_prompt=True, bos_token="", eos_token="<|im_end|>",
        )  # fmt: skip
        expected += len(tokenizer.encode_prompt(text))
    assert estimate.prompt_tokens == expected
    assert (estimate.tools_sent, estimate.tools_in_text) == (len(rows), sum(1 for r in rows if "tools" not in r))


def test_prompt_max_tokens_wins_over_the_dataset() -> None:
    estimator = Estimator(Settings(datasets={"d": DatasetSettings(max_tokens=1000)}), "d")
    base = demo_prompts("math")[0]
    estimator.add(base)
    estimator.add(PromptPublished(dataset="d", sample_id="own", messages=base.messages, max_tokens=10))
    assert estimator.flush().completion_bound == 1010


def test_expected_completion_is_the_observed_mean_capped_by_max_tokens() -> None:
    seen = Observed(responses=4, completion_tokens=2000, cost_usd=1.0)
    assert seen.mean_completion == 500
    assert expected_completion(4096, seen) == 500
    assert expected_completion(300, seen) == 300
    assert expected_completion(4096, None) == 4096
    assert expected_completion(4096, Observed()) == 4096
    estimate = DatasetEstimate(dataset="d", profile="p", observed=seen)
    estimate.add(10, 4096)
    estimate.add(20, 100)
    assert (estimate.prompt_tokens, estimate.completion_bound, estimate.completion_expected) == (30, 4196, 600)
    assert estimate.has_observations


def test_dollars_and_cap_verdicts() -> None:
    prices = {"m": {"prompt": 1.0, "completion": 10.0}}  # USD per million tokens
    observed = DatasetEstimate(dataset="a", profile="p", observed=Observed(responses=10, completion_tokens=1000))
    for _ in range(100):
        observed.add(1000, 2000)  # expected 100 each
    blind = DatasetEstimate(dataset="b", profile="p")
    blind.add(1000, 2000)
    report = build_report(
        [observed, blind],
        model="m",
        prices=prices,
        caps={"a": Caps(completion_tokens=50_000), "b": Caps(completion_tokens=1000, usd=1.0)},
        global_caps=Caps(usd=0.01),
        spent={"a": Observed(responses=10, completion_tokens=1000), "global": Observed(cost_usd=0.5)},
    )
    bound_a, expected_a = report.usd["a"]
    assert bound_a == pytest.approx((100_000 * 1 + 200_000 * 10) / 1e6)
    assert expected_a == pytest.approx((100_000 * 1 + 10_000 * 10) / 1e6)
    verdicts = {(c.scope, c.measure): c.verdict for c in report.checks}
    assert verdicts[("a", "completion tokens")] == "reached only at the bound"  # 1000 + 10,000 < 50,000 < 201,000
    assert verdicts[("b", "completion tokens")] == "reached at the bound (no responses observed yet)"
    assert verdicts[("b", "USD")] == "not reached, even at the bound"
    assert verdicts[("global", "USD")] == "already reached"
    unpriced = build_report([blind], model="other", prices=prices, caps={"b": Caps(usd=1.0)},
                            global_caps=Caps(), spent={})  # fmt: skip
    assert not unpriced.priced and unpriced.usd["b"] == (None, None)
    assert unpriced.checks[0].verdict == "unknown (no price for the model)"
    totals = ScopeTotals()
    totals.add(observed, 1.0, 0.5)
    assert cap_checks("x", Caps(completion_tokens=5_000), totals, None)[0].verdict == "reached at the observed mean"


def test_estimate_core_is_pure() -> None:
    code = (
        "import sys, services.estimate.core; "
        "bad = [m for m in ('aiokafka', 'httpx', 'aiohttp', 'services.common.config') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_estimate_command_on_the_demo_datasets(tmp_path: Path) -> None:
    from services.cli import app

    config = tmp_path / "draftstream.toml"
    config.write_text(
        '[budget]\nprices = { "qwen/qwen3-8b" = { prompt = 0.05, completion = 0.25 } }\n'
        "[datasets.math]\nmax_tokens = 2048\ncap_completion_tokens = 100000\n"
    )
    files = [str(DEMO / f"{n}.jsonl") for n in ("math", "code", "tools")]
    # The table is laid out at the terminal's width: a terminal wide enough for every figure whole.
    no_broker = {"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "COLUMNS": "160"}
    result = CliRunner().invoke(app, ["estimate", *files, "-c", str(config)], env=no_broker)
    assert result.exit_code == 0, result.output
    settings = Settings(datasets={"math": DatasetSettings(max_tokens=2048)})
    math_tokens = estimate_files(settings, DatasetFiles("math", [DEMO / "math.jsonl"])).prompt_tokens
    row = next(line for line in result.stdout.splitlines() if line.startswith("│ math"))
    assert f"{math_tokens:,}" in row and "204,800" in row  # 100 prompts x 2048
    assert "reached at the bound (no responses observed yet)" in result.stdout  # 204,800 > 100,000
    assert "broker not reachable" in result.stdout
    assert report_for(settings, [], None).checks == []


def test_a_multi_turn_dataset_counts_every_turn(tmp_path: Path) -> None:
    """``turns = "all"``: one request per assistant turn, each on the history up to that turn (the
    dataset's answers standing in), counted by the official template and the real tokenizer."""
    import json

    from schemas import Message

    pairs = [("Name a prime.", "7"), ("And another?", "11"), ("Their sum?", "18")]
    record = {"id": "c1", "conversations": [{"from": "system", "value": "Be brief."}] + [
        turn for q, a in pairs for turn in ({"from": "human", "value": q}, {"from": "gpt", "value": a})]}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    settings = Settings(datasets={"chat": DatasetSettings(turns="all", max_tokens=100)})
    estimate = estimate_files(settings, DatasetFiles("chat", [path]))
    histories = []
    for k in range(len(pairs)):
        messages = [Message(role="system", content="Be brief.")]
        for q, a in pairs[:k]:
            messages += [Message(role="user", content=q), Message(role="assistant", content=a)]
        histories.append(messages + [Message(role="user", content=pairs[k][0])])
    dataset = settings.dataset("chat")
    expected = sum(server_count(PromptPublished(dataset="chat", sample_id=f"t{k}", messages=m), dataset)
                   for k, m in enumerate(histories))  # fmt: skip
    assert (estimate.prompts, estimate.completion_bound) == (3, 300)
    assert estimate.prompt_tokens == expected
    last = estimate_files(Settings(datasets={"chat": DatasetSettings(max_tokens=100)}), DatasetFiles("chat", [path]))
    assert last.prompts == 1  # turns = "last": the final question only


def test_estimate_says_by_which_route_the_tools_travel(tmp_path: Path) -> None:
    """The demo tools file (16 rows with a tools field, 64 Glaive rows) under an old ``send_tools = true``."""
    from services.cli import app
    from services.inference.tool_route import PARSED_ADVICE

    config = tmp_path / "draftstream.toml"
    config.write_text("[datasets.tools]\nsend_tools = true\n")
    no_broker = {"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"}
    result = CliRunner().invoke(app, ["estimate", str(DEMO / "tools.jsonl"), "-c", str(config)], env=no_broker)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith("tools of dataset tools: ")]
    assert len(lines) == 2, result.stdout
    assert PARSED_ADVICE in lines[0] and '[send_tools = true: read as tool_route = "parameter"]' in lines[0]
    assert lines[0].endswith("(16 request(s) with a tools field)")
    assert "own system text" in lines[1] and lines[1].endswith("provable (64 request(s))")
    row = next(line for line in result.stdout.splitlines() if line.startswith("│ tools"))
    assert row.split("│")[5].strip() == "80"  # with tools: every row offers some
