"""Self-checks of the conformance truth harness, against facts from the shared reference dir."""

from __future__ import annotations

import json
import re
import unicodedata

import pytest
from tokenizers import Tokenizer

from tests.conformance import truth as T
from tests.conformance import truth_reference

_DS_BOS, _DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def cases() -> dict[str, list[T.Case]]:
    return {model: T.build_cases(model) for model in T.MODELS}


def _raw_text(case: T.Case) -> str:
    """The raw output without its end-of-turn, as a detokenizer with skip_special_tokens shows it."""
    eot = T.truth_tokenizer(case.model).eot
    return case.raw_output[: -len(eot)] if case.finished else case.raw_output


def test_reference_dir_missing_names_both_places(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("DRAFTSTREAM_REFERENCE_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setattr(truth_reference, "REPO_ROOT", tmp_path / "repo")
    with pytest.raises(RuntimeError, match="nowhere") as info:
        T.reference_dir()
    assert "shared/reference" in str(info.value)


@pytest.mark.parametrize(
    ("model", "token", "expected"),
    [  # TOKENS.md
        ("qwen3", "<|endoftext|>", 151643),
        ("qwen3", "<|im_end|>", 151645),
        ("qwen3", "<tool_call>", 151657),
        ("qwen3", "</tool_call>", 151658),
        ("qwen3", "<tool_response>", 151665),
        ("qwen3", "<think>", 151667),
        ("qwen3", "</think>", 151668),
        ("deepseek-r1", _DS_BOS, 0),
        ("deepseek-r1", _DS_EOS, 1),
        ("deepseek-r1", "<think>", 128798),
        ("deepseek-r1", "</think>", 128799),
        ("deepseek-v3.1", "<｜User｜>", 128803),
        ("deepseek-v3.1", "<｜Assistant｜>", 128804),
        ("deepseek-v3.1", "<｜tool▁calls▁begin｜>", 128806),
        ("deepseek-v3.1", "<｜tool▁sep｜>", 128814),
        ("kimi-k2-thinking", "<|im_end|>", 163586),
        ("kimi-k2-thinking", "<think>", 163606),
        ("kimi-k2-thinking", "</think>", 163607),
        ("kimi-k2-thinking", "<|tool_calls_section_begin|>", 163595),
        ("kimi-k2-thinking", "<|tool_call_end|>", 163599),
    ],
)
def test_special_token_ids(model: str, token: str, expected: int) -> None:
    tok = T.truth_tokenizer(model)
    assert tok.encode_output(token) == [expected]
    assert tok.encode_prompt(token) == [expected]
    assert tok.decode([expected]) == token


def test_deepseek_think_example_from_tokens_md() -> None:
    tok = T.truth_tokenizer("deepseek-r1")
    assert tok.encode_output("</think>\n\nHello") == [128799, 271, 19923]
    assert tok.encode_prompt("</think>\n\nHello") == [128799, 271, 19923]


@pytest.mark.parametrize(("thinking", "last"), [(True, 128798), (False, 128799)])
def test_prompt_truth_of_a_simple_case(thinking: bool, last: int) -> None:
    # V3.1 renders `<bos><｜User｜>Hello<｜Assistant｜><think>` (thinking) or `…</think>`; ids per TOKENS.md.
    text = T.render_template(
        T.template_source("deepseek-ai-DeepSeek-V3.1.jinja"),
        [{"role": "user", "content": "Hello"}],
        add_generation_prompt=True,
        bos_token=_DS_BOS,
        eos_token=_DS_EOS,
        thinking=thinking,
    )
    assert T.truth_tokenizer("deepseek-v3.1").encode_prompt(text) == [0, 128803, 19923, 128804, last]


def test_qwen_prompt_is_nfc_normalised_but_output_is_raw() -> None:
    tok = T.truth_tokenizer("qwen3")
    ohm, omega = "\u2126", "\u03a9"
    assert tok.encode_prompt(f"a {ohm} b") == tok.encode_prompt(f"a {omega} b")
    assert tok.encode_output(f"a {ohm} b") != tok.encode_output(f"a {omega} b")
    assert tok.decode(tok.encode_output(f"<think>{ohm}</think>")) == f"<think>{ohm}</think>"


def test_qwen_cases_normalise_only_the_prompt(cases) -> None:
    tok = T.truth_tokenizer("qwen3")
    checked = 0
    for case in cases["qwen3"]:
        if "non_nfc_prompt" in case.conversation.features:
            assert case.prompt_ids == tok.encode_output(unicodedata.normalize("NFC", case.prompt_text))
            assert case.prompt_ids != tok.encode_output(case.prompt_text)
            checked += 1
        if case.finished and "non_nfc_output" in case.conversation.features:
            assert case.output_ids == tok.encode_output(case.raw_output)
            assert case.output_ids != tok.encode_prompt(case.raw_output)
    assert checked >= 10


_PROMPT_ENDS = {  # SOURCES.md "Generation-prompt endings seen"
    ("qwen3", True): "<|im_start|>assistant\n",
    ("qwen3", False): "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    ("qwen3-thinking-2507", True): "<|im_start|>assistant\n<think>\n",
    ("deepseek-r1", True): "<｜Assistant｜><think>\n",
    ("deepseek-v3.1", True): "<｜Assistant｜><think>",
    ("deepseek-v3.1", False): "<｜Assistant｜></think>",
    ("kimi-k2-thinking", True): "<|im_assistant|>assistant<|im_middle|>",
    ("user-addedtok", False): "<start_of_turn>model\n",
}


def test_generation_prompt_endings(cases) -> None:
    for model, model_cases in cases.items():
        for case in model_cases:
            conv = case.conversation
            if model == "deepseek-v3.1" and "after_tool_result" in conv.features:
                assert case.prompt_text.endswith("<｜tool▁output▁end｜>")  # the template opens no turn
                continue
            assert case.prompt_text.endswith(_PROMPT_ENDS[model, conv.thinking]), conv.name


def test_case_invariants(cases) -> None:
    for model, model_cases in cases.items():
        tok = T.truth_tokenizer(model)
        assert len(model_cases) >= 30
        for case in model_cases:
            conv = case.conversation
            assert case.input_ids == case.prompt_ids + case.output_ids
            assert case.loss_mask == [0] * len(case.prompt_ids) + [1] * len(case.output_ids)
            assert not any("reasoning_content" in m for m in conv.messages)
            if case.finished:
                assert case.output_ids[-1] == tok.eot_id and tok.eot_id not in case.output_ids[:-1]
                assert case.output_ids == tok.encode_output(case.raw_output)
                assert case.raw_output == conv.generation.raw
            else:
                assert len(case.output_ids) == conv.max_tokens and tok.eot_id not in case.output_ids
                assert conv.generation.raw.startswith(case.raw_output.rstrip("\ufffd"))


def test_feature_coverage(cases) -> None:
    common = {"system", "no_system", "multi_turn", "truncated", "truncated_in_content", "non_nfc_prompt",
              "non_nfc_output", "content_leading_space"}  # fmt: skip
    common |= {f"ws:{k}" for k in T._WS} | {f"uni:{k}" for k in T._UNI}
    extra = {
        "qwen3": {"thinking_off", "truncated_in_reasoning", "text_after_tools", "truncated_mid_char"},
        "qwen3-thinking-2507": {"truncated_in_reasoning", "text_after_tools"},
        "deepseek-r1": {"truncated_in_reasoning"},
        "deepseek-v3.1": {"thinking_off", "truncated_in_reasoning", "after_tool_result"},
        "kimi-k2-thinking": {"truncated_in_reasoning", "after_tool_result", "truncated_mid_char"},
        "user-addedtok": {"added_tok_nn", "added_tok_br"},
    }
    tools = {"tools_sent", "history_tool_calls", "tool_call_answer", "multi_tool_calls", "args_noncanonical",
             "content_empty", "history_args_noncanonical", "history_tools_without_tools_sent"}  # fmt: skip
    thinks = {"history_reasoning_dropped", "history_content_leading_newlines"}
    for model, model_cases in cases.items():
        seen = set().union(*(c.conversation.features for c in model_cases))
        want = common | extra[model] | (tools | thinks if model != "user-addedtok" else set())
        assert want <= seen, (model, sorted(want - seen))


def test_conversations_are_deterministic() -> None:
    def key(cs: list[T.Case]) -> list:
        return [(c.conversation.messages, c.prompt_ids, c.output_ids, c.conversation.max_tokens) for c in cs]

    for model in ("qwen3", "kimi-k2-thinking"):
        assert key(T.build_cases(model, 8, seed=3)) == key(T.build_cases(model, 8, seed=3))
        assert key(T.build_cases(model, 8, seed=3)) != key(T.build_cases(model, 8, seed=4))


def test_vllm_fields_concatenate_back_to_the_raw_text(cases) -> None:
    starts = {"qwen3": "<think>", "kimi-k2-thinking": "<think>"}
    for model, model_cases in cases.items():
        for case in model_cases:
            conv = case.conversation
            r = T.emulate(case, "vllm")
            assert r["prompt_token_ids"] == case.prompt_ids and r["logprobs"] is None
            assert r["usage"] == {"prompt_tokens": len(case.prompt_ids), "completion_tokens": len(case.output_ids)}
            # lossy only where vLLM really loses text: hermes re-serialisation, text after tools, partial char
            expected_lossy = bool(
                conv.features & {"text_after_tools", "truncated_mid_char"}
                or (model.startswith("qwen3") and "args_noncanonical" in conv.features)
            )
            assert r["lossy"] == expected_lossy, (conv.name, r["lossy_why"])
            if r["tool_calls"] or r["lossy"]:
                continue
            if model == "user-addedtok" or not conv.thinking:
                assert r["reasoning"] == "" and r["content"] == _raw_text(case), conv.name
            else:
                closed = "</think>" if "</think>" in _raw_text(case) else ""
                joined = starts.get(model, "") + r["reasoning"] + closed + r["content"]
                assert joined == _raw_text(case), conv.name


def test_vllm_hand_written_r1_split() -> None:
    # PARSERS.md: R1 output "R\n</think>\n\nA" -> reasoning "R\n", content "\n\nA" (newlines kept).
    case = next(c for c in T.build_cases("deepseek-r1", 1))
    tok = T.truth_tokenizer("deepseek-r1")
    raw = "R\n</think>\n\nA" + _DS_EOS
    case = T.Case(case.model, case.conversation, raw, case.prompt_text, case.prompt_ids, tok.encode_output(raw),
                  [], [], True)  # fmt: skip
    r = T.emulate(case, "vllm")
    assert (r["reasoning"], r["content"], r["finish_reason"], r["lossy"]) == ("R\n", "\n\nA", "stop", False)
    s = T.emulate(case, "sglang-strip")
    assert (s["reasoning"], s["content"], s["lossy"]) == ("R\n", "A", True)
    assert "whitespace stripped" in s["lossy_why"]


def test_sglang_strip_strips(cases) -> None:
    stripped_lossy = 0
    for model, model_cases in cases.items():
        for case in model_cases:
            r = T.emulate(case, "sglang-strip")
            assert r["prompt_token_ids"] is None and r["logprobs"] is None
            assert "<think>" not in r["reasoning"] + r["content"]
            raw = _raw_text(case)
            assert r["reasoning"] in raw and r["content"] in raw  # stripped slices, nothing added
            if case.conversation.thinking and "</think>" not in raw and model != "user-addedtok":
                assert r["reasoning"] == r["reasoning"].strip(), case.conversation.name  # truncated: whole strip
            if model != "user-addedtok" and (case.conversation.thinking or r["tool_calls"]):
                if model != "kimi-k2-thinking" or not r["tool_calls"]:  # Kimi's tool detector does not strip
                    assert r["content"] == r["content"].strip(), case.conversation.name
                assert r["reasoning"] == r["reasoning"].lstrip()
            if model == "deepseek-r1" and case.finished:  # "\n\n" after </think> is always stripped
                assert r["lossy"] and "whitespace stripped" in r["lossy_why"]
            stripped_lossy += "whitespace stripped" in r["lossy_why"]
    assert stripped_lossy > 50


def test_tool_arguments_per_server(cases) -> None:
    for model in ("qwen3", "deepseek-r1", "kimi-k2-thinking"):
        for case in cases[model]:
            calls = case.conversation.generation.calls
            if not case.finished or not calls:
                continue
            raw_args = [c.arguments for c in calls]
            canonical = [json.dumps(json.loads(a), ensure_ascii=False) for a in raw_args]
            vllm = [c["function"]["arguments"] for c in T.emulate(case, "vllm")["tool_calls"]]
            sglang = [c["function"]["arguments"] for c in T.emulate(case, "sglang-strip")["tool_calls"]]
            assert vllm == (canonical if model == "qwen3" else raw_args)  # hermes re-serialises
            assert sglang == (raw_args if model == "kimi-k2-thinking" else canonical)
            if model == "kimi-k2-thinking":
                ids = [c["id"] for c in T.emulate(case, "vllm")["tool_calls"]]
                assert all(re.fullmatch(r"functions\.\w+:\d+", i) for i in ids)


def test_openrouter_logprobs_cover_every_generated_token(cases) -> None:
    for model_cases in cases.values():
        for case in model_cases:
            r = T.emulate(case, "openrouter")
            assert r["prompt_token_ids"] is None and set(r) >= {"reasoning", "content", "tool_calls"}
            produced = len(case.output_ids) - (1 if case.finished else 0)  # end-of-turn omitted
            assert len(r["logprobs"]) == produced == r["usage"]["completion_tokens"] - int(case.finished)
            raw = b"".join(bytes(item["bytes"]) for item in r["logprobs"])
            assert raw.decode("utf-8", errors="replace") == _raw_text(case)
            vllm = T.emulate(case, "vllm")
            assert (r["reasoning"], r["content"], r["lossy"]) == (vllm["reasoning"], vllm["content"], vllm["lossy"])


def test_server_view_of_history_tool_arguments(cases) -> None:
    # vLLM parses history arguments to a dict, so Qwen's `tojson` re-serialises them; R1 keeps the string.
    for model in ("qwen3", "deepseek-r1"):
        case = next(c for c in cases[model] if "history_args_noncanonical" in c.conversation.features)
        sent = [tc["function"]["arguments"] for m in case.conversation.messages for tc in m.get("tool_calls") or []]
        for args in sent:
            canonical = json.dumps(json.loads(args), ensure_ascii=False)
            assert args != canonical
            if model == "qwen3":
                assert canonical in case.prompt_text and args not in case.prompt_text
            else:
                assert args in case.prompt_text


def test_user_addedtok_folder(tmp_path) -> None:
    info = T.build_user_addedtok_folder(tmp_path / "profile")
    config = json.loads((tmp_path / "profile" / "tokenizer_config.json").read_text(encoding="utf-8"))
    flags = {v["content"]: v for v in config["added_tokens_decoder"].values()}
    assert flags["\n\n"]["special"] is False and flags["\n\n"]["normalized"] is False
    assert flags["<br>"]["special"] is False and flags["<end_of_turn>"]["special"] is True
    assert config["chat_template"] == info["chat_template"]
    tok = Tokenizer.from_file(str(tmp_path / "profile" / "tokenizer.json"))
    assert tok.token_to_id("<end_of_turn>") == info["end_of_turn_id"] and tok.token_to_id("<bos>") == info["bos_id"]
    nn, br = info["ordinary_added"]["\n\n"], info["ordinary_added"]["<br>"]
    ids = tok.encode("a\n\nb<br>", add_special_tokens=False).ids
    assert nn in ids and br in ids
    assert tok.decode([nn, br], skip_special_tokens=True) == "\n\n<br>"  # ordinary: survives skip_special


def test_user_addedtok_outputs_use_the_ordinary_added_ids(cases) -> None:
    info = T.user_addedtok_folder()
    for case in cases["user-addedtok"]:
        n_nn = len(re.findall("\n\n", case.raw_output.replace("\n\n\n", "\n\n")))
        assert case.output_ids.count(info["ordinary_added"]["\n\n"]) >= min(n_nn, 1)
        if case.finished and "<br>" in case.raw_output:
            assert info["ordinary_added"]["<br>"] in case.output_ids
            assert case.output_ids[-1] == info["end_of_turn_id"]


@pytest.mark.parametrize("model", ["deepseek-r1", "deepseek-v3.1", "user-addedtok"])
def test_prompts_match_transformers(model: str, cases) -> None:
    # transformers renders + tokenizes the same templates independently. It drops None-valued keys (5.x), which
    # breaks the R1 template on `content: None` tool-call turns, so those conversations are left out here.
    from transformers import PreTrainedTokenizerFast

    if model == "user-addedtok":
        hf = PreTrainedTokenizerFast.from_pretrained(str(T.user_addedtok_folder()["path"]))
    else:
        hf = PreTrainedTokenizerFast(tokenizer_file=str(T.deepseek_v3_tokenizer_path()), bos_token=_DS_BOS,
                                     eos_token=_DS_EOS)  # fmt: skip
        hf.chat_template = T._template_text(model)
    compared = 0
    for case in cases[model]:
        conv = case.conversation
        if any(m.get("content") is None for m in conv.messages):
            continue
        tools = conv.tools if conv.tools_sent else None
        text = hf.apply_chat_template(conv.messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                      **conv.kwargs)  # fmt: skip
        assert text == case.prompt_text, conv.name
        assert hf(text, add_special_tokens=False)["input_ids"] == case.prompt_ids, conv.name
        if case.finished:
            assert hf(case.raw_output, add_special_tokens=False)["input_ids"] == case.output_ids, conv.name
        compared += 1
    assert compared >= 24


def test_unknown_server_is_rejected(cases) -> None:
    with pytest.raises(ValueError, match="unknown server"):
        T.emulate(cases["qwen3"][0], "tgi")
