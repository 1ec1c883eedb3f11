"""Raw tool text through the real engines: tools in the prompt text, no ``tools`` parameter, no tool parser.

Chat mode with ``tool_route = "prompt"`` writes a row's tools into the system text as the template writes them
(``services/profiles/tooltext.py``) and sends no ``tools`` parameter. This checks that route against vLLM 0.33.0's
and SGLang 0.5.23's own serving code (``engines.py``, in a child process, from the hash-pinned ``.run/engines``),
over the true model text of every truth case that offers tools (``truth.py``: official templates, real
tokenizers; answers with one or two tool calls, arguments spelled the ways models write JSON):

- the messages our inference provider builds (its own code path, ``tools_in_text``) go to the engine's request
  model without tools; vLLM runs with its reasoning and tool parsers configured (``--tool-call-parser``: a request
  without tools leaves the text alone) and again with no tool parser; SGLang with its reasoning parser;
- the prompt the engine renders from those messages (the official template, no tools) is the very prompt the
  ``tools`` parameter would have rendered (the tools as the engine's request model dumps them);
- our reconstruct and audit accept every finished answer with exact ids: the tool block came back in ``content``
  as the model wrote it. No output id but the stop token is a special token of these models, so the engines'
  default ``skip_special_tokens`` cannot drop a tool or think marker (checked, not assumed).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import msgspec

from schemas import PromptPublished, ResponseReceived, SampleReconstructed, ToolCall, Usage
from services.audit.core import audit_batch
from services.common.config import load_settings
from services.common.kafka import DeadLetter
from services.inference.adapters.providers import make_provider
from services.profiles.conventions import CONVENTIONS
from services.reconstruct.core import reconstruct_batch
from tests.conformance import engines as E
from tests.conformance import truth as T
from tests.conformance.test_matrix import THRESHOLDS, _messages, profile_for

# Models whose template writes its tool block into the system text (Kimi declares tools in a turn of its own).
MODELS = ("qwen3", "qwen3-thinking-2507", "deepseek-r1", "deepseek-v3.1")
# Each column: the engine, its tool parser configured or not, and the convention our provider is set to.
COLUMNS = {"real-vllm": "vllm", "real-vllm-no-tool-parser": "vllm", "real-sglang": "sglang"}


def _offered(model: str) -> list[tuple[int, T.Case]]:
    return [(i, c) for i, c in enumerate(T.build_cases(model)) if c.conversation.tools_sent]


def _prompt(case: T.Case, index: int) -> PromptPublished:
    conv = case.conversation
    return PromptPublished(dataset="raw", sample_id=f"{case.model}-{index}", messages=_messages(conv),
                           tools=conv.tools, max_tokens=conv.max_tokens)  # fmt: skip


def sent_messages(case: T.Case, index: int, convention: str) -> list[dict[str, Any]]:
    """The messages our inference provider sends on the raw-tool-text route (its own code path)."""
    settings = load_settings(None, provider={"kind": "openai", "base_url": "http://engine.test/v1",
                                             "convention": convention},
                             datasets={"raw": {"profile": case.model, "tool_route": "prompt"}})  # fmt: skip
    provider = make_provider(settings, client=None)  # type: ignore[arg-type] - nothing is sent
    profile = profile_for(case.model, case.conversation.thinking)
    provider._load_profile = lambda _name: profile  # the truth model's profile, thinking on or off as the case
    written = provider.tools_in_text(_prompt(case, index), settings.dataset("raw"))
    assert written is not None, f"{case.model}: the template cannot write its tools in system text"
    return written


# --- the child process: the engines' own code -----------------------------------------------------------


def _child(given: dict[str, Any]) -> dict[str, Any]:
    engines = E._load_engines()
    out: dict[str, Any] = {"responses": {}, "server_tools": {}}
    for model in MODELS:
        tok = E.TokenizerShim(T.truth_tokenizer(model))
        for index, case in _offered(model):
            out["server_tools"][f"{model}/{index}"] = {
                name: engines[name].respond(case, T)["server_tools"] for name in ("real-vllm", "real-sglang")
            }
            for column in COLUMNS:
                messages = given[column][f"{model}/{index}"]
                # The request as the raw route sends it: our messages, no tools.
                raw = dataclasses.replace(case, conversation=dataclasses.replace(
                    case.conversation, messages=messages, tools=None, tools_sent=False))  # fmt: skip
                if column == "real-vllm-no-tool-parser":
                    text, ids = E._output_text(raw, T)
                    reasoning_parser = E.VLLM_PARSERS[model][0]
                    got = engines["real-vllm"].parse(text, ids, E._request_fields(raw), tok, (reasoning_parser, None),
                                                     finished=raw.finished)  # fmt: skip
                else:
                    got = engines[column].respond(raw, T)
                out["responses"][f"{column}/{model}/{index}"] = got
    return E._finish(out)


@cache
def engine_run() -> dict[str, Any]:
    """The engines' answers on the raw route (one child process per session)."""
    given = {column: {f"{m}/{i}": sent_messages(c, i, convention) for m in MODELS for i, c in _offered(m)}
             for column, convention in COLUMNS.items()}  # fmt: skip
    E.ensure_engines_env()
    base = E.REPO_ROOT / ".run" / f"engine-raw-tool-text-{id(given)}"
    request, out = base.with_suffix(".in.json"), base.with_suffix(".out.json")
    try:
        request.write_text(json.dumps(given, ensure_ascii=False), encoding="utf-8")
        subprocess.run([sys.executable, "-m", "tests.conformance.test_raw_tool_text", str(request), str(out)],  # noqa: S603
                       cwd=E.REPO_ROOT, check=True, timeout=900)  # fmt: skip
        return {"given": given, **json.loads(out.read_text(encoding="utf-8"))}
    finally:
        request.unlink(missing_ok=True)
        out.unlink(missing_ok=True)


# --- the parent: our reconstruct and audit over the engines' answers ------------------------------------


def _official_prompt_ids(case: T.Case, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    conv = dataclasses.replace(case.conversation, messages=messages, tools=tools, tools_sent=tools is not None)
    return list(T.truth_tokenizer(case.model).encode_prompt(T.render_prompt(case.model, conv)))


def run_column(column: str) -> dict[str, Any]:
    """Every tool-offering case through one engine column, then our reconstruct + audit."""
    run = engine_run()
    convention = CONVENTIONS[COLUMNS[column]]
    engine = "real-sglang" if column == "real-sglang" else "real-vllm"
    found: dict[str, Any] = {"cases": 0, "finished": 0, "accepted": 0, "exact": 0, "with_calls": 0, "wrong": [],
                             "prompt_differs": [], "structured": 0, "dead": []}  # fmt: skip
    for model in MODELS:
        members = []
        for index, case in _offered(model):
            key = f"{model}/{index}"
            got = run["responses"][f"{column}/{key}"]
            sent = run["given"][column][key]
            # What the engine renders from our messages is what its tools parameter would have rendered.
            raw_prompt = _official_prompt_ids(case, sent, None)
            if raw_prompt != _official_prompt_ids(case, case.conversation.messages, run["server_tools"][key][engine]):
                found["prompt_differs"].append(key)
            response = ResponseReceived(
                dataset="raw", sample_id=f"{model}-{index}", prompt=_prompt(case, index), provider=engine,
                model=model, reasoning=got["reasoning"] or "", content=got["content"] or "",
                tool_calls=[msgspec.convert(c, ToolCall) for c in got["tool_calls"]],
                finish_reason=got["finish_reason"], tools_sent=True,
                usage=Usage(prompt_tokens=len(raw_prompt), completion_tokens=len(case.output_ids)),
            )  # fmt: skip
            members.append((case, response, raw_prompt))
            found["structured"] += bool(got["tool_calls"])
        for thinking in (False, True):
            group = [m for m in members if m[0].conversation.thinking == thinking]
            if not group:
                continue
            profile = profile_for(model, thinking)
            verdicts = reconstruct_batch([r for _, r, _ in group], profile, convention)
            passed = [v for v in verdicts if isinstance(v, SampleReconstructed)]
            audited = iter(audit_batch(passed, profile, THRESHOLDS))
            for (case, response, raw_prompt), verdict in zip(group, verdicts, strict=True):
                found["cases"] += 1
                found["finished"] += case.finished
                if isinstance(verdict, DeadLetter):
                    found["dead"].append(f"{response.sample_id}: {verdict.reason} {verdict.message[:80]}")
                    continue
                if not next(audited).passed:
                    found["dead"].append(f"{response.sample_id}: audit")
                    continue
                found["accepted"] += 1
                if list(verdict.output_ids) != case.output_ids or list(verdict.prompt_ids) != raw_prompt:
                    found["wrong"].append(response.sample_id)
                    continue
                found["exact"] += 1
                text = T.truth_tokenizer(model).decode(case.output_ids)
                found["with_calls"] += "<tool_call>" in text or "tool▁calls▁begin" in text
    return found


def test_engines_are_the_pinned_ones() -> None:
    assert engine_run()["versions"] == {"vllm": E.VLLM_VERSION, "sglang": E.SGLANG_VERSION}


def test_no_output_id_but_the_stop_is_special_so_skipping_special_tokens_keeps_the_block() -> None:
    for model in MODELS:
        tok = T.truth_tokenizer(model)
        for _, case in _offered(model):
            assert not [i for i in case.output_ids if i in tok.special_ids and i != tok.eot_id], case.conversation.name


def test_raw_tool_text_through_the_engines_is_lossless() -> None:
    """0 wrong, every finished answer accepted with exact ids, the tool blocks among them; no parser ran."""
    for column in COLUMNS:
        found = run_column(column)
        print(f"\nraw tool text, {column}: {found['cases']} answers offering tools, {found['accepted']} accepted, "
              f"{found['exact']} exact ({found['with_calls']} with tool calls), {len(found['wrong'])} wrong; "
              f"dead: {found['dead'][:4]}")  # fmt: skip
        assert not found["wrong"], (column, found["wrong"])
        assert not found["prompt_differs"], (column, found["prompt_differs"])
        assert found["structured"] == 0, column  # no tools parameter: no parser took a call apart
        assert found["accepted"] >= found["finished"] > 0, (column, found["dead"])
        assert found["with_calls"] >= 20, column


def test_vllm_deepseek_v4_drops_a_dsml_block_sent_without_tools_as_the_vllm_convention_says() -> None:
    """DeepSeek-V4 on the raw route through vLLM 0.33.0's own deepseek_v4 pair (engines.run_dsv4, a child process):
    a DSML block the model wrote comes back neither in the content nor as a call when the request has no tools
    parameter (with one, the call comes back), and the newline before ``</think>`` is gone. So the raw route is
    not lossless for V4 there: the ``vllm`` convention names ``dsml`` in ``drops_block_without_tools``, and none
    of the formats whose raw route the engines keep whole (MODELS, above)."""
    from services.profiles import profile_spec
    from tests.conformance.test_dsv4_encoding import SHAPES, WEATHER, _encoder_block

    block = _encoder_block([WEATHER])
    answers = []
    for tools in (None, T._TOOLS):
        for content in ("Checking.", ""):
            fields = {"messages": SHAPES["single_turn"], "tools": tools, "chat_template_kwargs": {"thinking": True}}
            answers.append({"text": "The user wants the weather.\n</think>" + content + block, "fields": fields})
    replies = E.run_dsv4(answers)["responses"]
    for answer, got in zip(answers, replies, strict=True):
        assert got["reasoning"] == "The user wants the weather.", got  # the "\n" before </think> stripped
        assert "DSML" not in (got["content"] or ""), got  # the block is out of the content either way
        called = [c["function"]["name"] for c in got["tool_calls"]]
        assert called == ([] if answer["fields"]["tools"] is None else ["get_weather"]), got  # no tools: lost
    dropped = CONVENTIONS["vllm"].drops_block_without_tools
    assert profile_spec("deepseek-v4").tool_format in dropped
    assert dropped.isdisjoint(profile_spec(model).tool_format for model in MODELS)


if __name__ == "__main__":
    source, target = sys.argv[1:]
    result = _child(json.loads(Path(source).read_text(encoding="utf-8")))
    Path(target).write_text(json.dumps(result, ensure_ascii=False), encoding="utf-8")
