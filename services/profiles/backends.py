"""Tokenizer backends behind a profile: HF ``tokenizers`` JSON, tiktoken ranks, HF folders.

Each backend answers the same small set of questions (encode with special tokens parsed
as specials, decode keeping them, exact bytes of one token and the inverse), so a
:class:`services.profiles.Profile` never cares which library tokenizes.

Two encodings: a prompt is tokenized as the server does it, with the tokenizer's Unicode
normaliser (Qwen's NFC); model output is never normalised, because the model emitted
tokens, not text (NFC would turn OHM SIGN U+2126 into U+03A9 and change the ids).
"""

from __future__ import annotations

import base64
import json
import os
import re
import threading
import unicodedata
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, TypeVar


class TokenizerBackend(Protocol):
    """What a profile needs from a tokenizer library."""

    vocab_size: int
    chat_template: str | None
    # Ids of the added tokens flagged special (control tokens); ordinary added tokens are text.
    control_ids: frozenset[int]

    def encode(self, text: str) -> list[int]:
        """Token ids of model text; added-token strings become their ids; no BOS, no normalising."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` over many texts in one call."""

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt, with the tokenizer's Unicode normaliser applied as a server does."""

    def encode_prompt_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode_prompt` over many texts."""

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens kept."""

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        """:meth:`decode` over many sequences."""

    def token_bytes(self, id_: int) -> bytes:
        """The exact bytes one token stands for."""

    def all_token_bytes(self) -> list[bytes]:
        """The bytes of every ordinary (non-added) vocabulary entry."""

    def id_of_bytes(self, b: bytes) -> int | None:
        """The id whose bytes are exactly ``b`` (special tokens first), else None."""

    def token_string(self, id_: int) -> str:
        """The raw vocabulary string of one id (GPT-2 byte-level form)."""

    def id_of_token_string(self, s: str) -> int | None:
        """The id of a raw vocabulary string, else None."""


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """Inverse of :func:`bytes_to_unicode`."""
    return {c: b for b, c in bytes_to_unicode().items()}


def byte_level_to_bytes(token: str) -> bytes | None:
    """Bytes of a byte-level BPE vocabulary string, or None when it is not byte-level."""
    table = unicode_to_bytes()
    try:
        return bytes(table[c] for c in token)
    except KeyError:
        return None


def bytes_to_byte_level(b: bytes) -> str:
    """The byte-level BPE vocabulary string of some bytes."""
    table = bytes_to_unicode()
    return "".join(table[x] for x in b)


class TokenizersBackend:
    """A Hugging Face ``tokenizers`` tokenizer (tokenizer.json), byte-level BPE aware."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        # The file the vocabulary was read from, when there is one (services/profiles/provenance.py).
        self.source: Path | None = None
        self._prompt_tok = tokenizer
        self._tok = _without_unicode_normaliser(tokenizer)
        self.chat_template = chat_template
        vocab: dict[str, int] = tokenizer.get_vocab(with_added_tokens=True)
        decoder = tokenizer.get_added_tokens_decoder()
        added = {t.content: i for i, t in decoder.items()}
        self._id_to_str: dict[int, str] = {i: s for s, i in vocab.items()}
        self._str_to_id = vocab
        self._added_ids = set(added.values())
        self.control_ids = frozenset(i for i, t in decoder.items() if t.special)
        self.vocab_size = max(self._id_to_str) + 1
        self._bytes: dict[int, bytes] = {}
        self._by_bytes: dict[bytes, int] = {}
        for s, i in vocab.items():
            if i in self._added_ids:
                continue
            b = byte_level_to_bytes(s)
            if b is None:  # not byte-level (e.g. a sentencepiece-style piece)
                b = s.replace("\u2581", " ").encode("utf-8")
            self._bytes[i] = b
            self._by_bytes.setdefault(b, i)
        # Added (special) tokens win over a regular token spelling the same bytes.
        for content, i in added.items():
            b = content.encode("utf-8")
            self._bytes[i] = b
            self._by_bytes[b] = i

    @classmethod
    def from_file(cls, path: str | Path, chat_template: str | None = None) -> TokenizersBackend:
        """Load a tokenizer.json file (read once per process while it is unchanged: profiles of
        one vocabulary, DeepSeek R1, V3 and V3.1, share it; a backend is never changed after)."""
        resolved = Path(path).resolve()
        stat = resolved.stat()
        return _tokenizer_file(str(resolved), stat.st_mtime_ns, stat.st_size, chat_template)

    def encode(self, text: str) -> list[int]:
        """Token ids of model text (added tokens parsed, no BOS, no Unicode normalising)."""
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts in one (parallel) call."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt through the full tokenizer (its normaliser included)."""
        ids: list[int] = self._prompt_tok.encode(text, add_special_tokens=False).ids
        return ids

    def encode_prompt_batch(self, texts: list[str]) -> list[list[int]]:
        """Prompt ids of many texts."""
        return [e.ids for e in self._prompt_tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens kept."""
        text: str = self._tok.decode(ids, skip_special_tokens=False)
        return text

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        """Texts of many sequences."""
        out: list[str] = self._tok.decode_batch(batch, skip_special_tokens=False)
        return out

    def token_bytes(self, id_: int) -> bytes:
        """Exact bytes of one id; KeyError when the id is not in the vocabulary."""
        return self._bytes[id_]

    def all_token_bytes(self) -> list[bytes]:
        """The bytes of every ordinary vocabulary entry."""
        return [b for i, b in self._bytes.items() if i not in self._added_ids]

    def id_of_bytes(self, b: bytes) -> int | None:
        """The id whose bytes are exactly ``b``."""
        return self._by_bytes.get(b)

    def token_string(self, id_: int) -> str:
        """Raw vocabulary string of one id."""
        return self._id_to_str[id_]

    def id_of_token_string(self, s: str) -> int | None:
        """Id of a raw vocabulary string."""
        return self._str_to_id.get(s)


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Read a ``*.tiktoken`` / ``tiktoken.model`` ranks file (base64 token, rank per line)."""
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_bytes().splitlines():
        if not line.strip():
            continue
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


_In = TypeVar("_In")
_Out = TypeVar("_Out")

# Below this much work (characters to encode, ids to decode) one thread does a batch:
# tiktoken's own ``encode_batch``/``decode_batch`` start a pool of 8 threads per call,
# which for a stage's batch of short answers cost 3x (encode) to 13x (decode) the CPU
# of doing the same texts one after another.
PARALLEL_MIN_WORK = 256 * 1024
_POOL_WORKERS = max(1, min(4, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _shared_pool() -> ThreadPoolExecutor:
    """One process-wide pool for large batches (started on first use, reused)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_POOL_WORKERS, thread_name_prefix="tokenize")
        return _pool


def _balanced_slices(weights: Sequence[int], parts: int) -> list[slice]:
    """Consecutive slices of ``weights`` with roughly equal sums (at most ``parts`` of them)."""
    total = sum(weights)
    out: list[slice] = []
    start, acc = 0, 0
    for i, w in enumerate(weights):
        acc += w
        if acc * parts >= total * (len(out) + 1) and len(out) < parts - 1:
            out.append(slice(start, i + 1))
            start = i + 1
    if start < len(weights):
        out.append(slice(start, len(weights)))
    return out


def map_batch(fn: Callable[[_In], _Out], items: Sequence[_In], weights: Sequence[int]) -> list[_Out]:
    """``[fn(x) for x in items]``, split over a few threads when the batch is large.

    ``weights`` estimates each item's work; small batches stay on the calling thread. A
    large one goes to a shared pool in as many consecutive chunks as it has threads (the
    tokenizers release the GIL while they work), so a call costs a handful of hand-offs
    rather than one thread per item.
    """
    if _POOL_WORKERS == 1 or len(items) < 2 or sum(weights) < PARALLEL_MIN_WORK:
        return [fn(x) for x in items]

    def run(part: slice) -> list[_Out]:
        return [fn(x) for x in items[part]]

    chunks = _shared_pool().map(run, _balanced_slices(weights, _POOL_WORKERS))
    return [out for chunk in chunks for out in chunk]


class TiktokenBackend:
    """A tiktoken ``Encoding`` (Qwen's and Kimi's tokenizers), with optional NFC normalising."""

    def __init__(
        self,
        encoding: Any,
        *,
        nfc: bool = False,
        chat_template: str | None = None,
        control_ids: frozenset[int] | None = None,
    ) -> None:
        # The ranks file the vocabulary was read from, when there is one.
        self.source: Path | None = None
        self._enc = encoding
        self._nfc = nfc
        self.chat_template = chat_template
        self.vocab_size = int(encoding.n_vocab)
        # tiktoken calls every added token "special"; which of them are control tokens is
        # the tokenizer config's word (default: all of them).
        self._specials: dict[str, int] = dict(encoding._special_tokens)
        self._special_ids = {i: s for s, i in self._specials.items()}
        self.control_ids = frozenset(self._special_ids) if control_ids is None else control_ids
        ordered = sorted(self._specials, key=len, reverse=True)
        self._special_split = re.compile("(" + "|".join(re.escape(s) for s in ordered) + ")") if ordered else None

    @classmethod
    def from_ranks(
        cls,
        name: str,
        ranks_path: str | Path,
        pat_str: str,
        special_tokens: dict[str, int],
        *,
        nfc: bool = False,
        chat_template: str | None = None,
        control_ids: frozenset[int] | None = None,
    ) -> TiktokenBackend:
        """Build an Encoding from a ranks file, a pre-tokenizer regex and special tokens."""
        import tiktoken

        enc = tiktoken.Encoding(
            name,
            pat_str=pat_str,
            mergeable_ranks=load_tiktoken_ranks(ranks_path),
            special_tokens=special_tokens,
        )
        backend = cls(enc, nfc=nfc, chat_template=chat_template, control_ids=control_ids)
        backend.source = Path(ranks_path)
        return backend

    def _norm(self, text: str) -> str:
        # Like HF's added-token handling: special tokens are split out first and only the
        # text between them is normalised (NFC of a whole text could fuse a combining mark
        # onto the ">" closing a special token and destroy it).
        if not self._nfc:
            return text
        if self._special_split is None:
            return unicodedata.normalize("NFC", text)
        parts = self._special_split.split(text)
        return "".join(p if i % 2 else unicodedata.normalize("NFC", p) for i, p in enumerate(parts))

    def encode(self, text: str) -> list[int]:
        """Token ids of model text (every added token allowed, no BOS, no normalising)."""
        ids: list[int] = self._enc.encode(text, allowed_special="all")
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts (threaded only when the batch is large: :func:`map_batch`)."""
        return map_batch(self.encode, texts, [len(t) for t in texts])

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt, NFC-normalised between added tokens when the model's tokenizer does."""
        ids: list[int] = self._enc.encode(self._norm(text), allowed_special="all")
        return ids

    def encode_prompt_batch(self, texts: list[str]) -> list[list[int]]:
        """Prompt ids of many texts."""
        return map_batch(self.encode_prompt, texts, [len(t) for t in texts])

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens kept (invalid UTF-8 as U+FFFD)."""
        text: str = self._enc.decode(ids, errors="replace")
        return text

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        """Texts of many sequences (threaded only when the batch is large: :func:`map_batch`)."""
        return map_batch(self.decode, batch, [len(ids) for ids in batch])

    def all_token_bytes(self) -> list[bytes]:
        """The bytes of every ordinary vocabulary entry (tiktoken's mergeable ranks)."""
        return list(self._enc._mergeable_ranks)

    def token_bytes(self, id_: int) -> bytes:
        """Exact bytes of one id; KeyError when the id is not in the vocabulary."""
        try:
            b: bytes = self._enc.decode_single_token_bytes(id_)
        except Exception as exc:  # tiktoken raises KeyError or a pyo3 error for unknown ids
            raise KeyError(id_) from exc
        return b

    def id_of_bytes(self, b: bytes) -> int | None:
        """The id whose bytes are exactly ``b`` (special tokens included)."""
        special = self._specials.get(b.decode("utf-8", "replace"))
        if special is not None:
            return special
        try:
            return int(self._enc.encode_single_token(b))
        except KeyError:
            return None

    def token_string(self, id_: int) -> str:
        """Raw vocabulary string of one id, in GPT-2 byte-level form (specials as they are)."""
        if id_ in self._special_ids:
            return self._special_ids[id_]
        return bytes_to_byte_level(self.token_bytes(id_))

    def id_of_token_string(self, s: str) -> int | None:
        """Id of a byte-level vocabulary string or a special token."""
        if s in self._specials:
            return self._specials[s]
        b = byte_level_to_bytes(s)
        return None if b is None else self.id_of_bytes(b)


def read_added_tokens(folder: Path) -> dict[str, tuple[int, bool]]:
    """Added tokens of a model folder's tokenizer_config.json: content -> (id, special flag)."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return {}
    data = json.loads(config.read_text(encoding="utf-8"))
    decoder = data.get("added_tokens_decoder") or {}
    return {str(v["content"]): (int(k), bool(v.get("special", True))) for k, v in decoder.items()}


@lru_cache(maxsize=4)
def _tokenizer_file(path: str, _mtime_ns: int, _size: int, chat_template: str | None) -> TokenizersBackend:
    from tokenizers import Tokenizer

    backend = TokenizersBackend(Tokenizer.from_file(path), chat_template)
    backend.source = Path(path)
    return backend


_UNICODE_NORMALISERS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})


def _strip_unicode(node: Any) -> Any:
    """A normaliser JSON with the Unicode normal forms taken out (None when nothing is left)."""
    if not isinstance(node, dict):
        return node
    if node.get("type") in _UNICODE_NORMALISERS:
        return None
    if node.get("type") == "Sequence":
        inner = node.get("normalizers", [])
        kept = [n for n in (_strip_unicode(c) for c in inner) if n is not None]
        if kept == inner:
            return node  # nothing taken out (an empty sequence stays as it is: it changes nothing)
        return {**node, "normalizers": kept} if kept else None
    return node


def _without_unicode_normaliser(tokenizer: Any) -> Any:
    """The same tokenizer minus NFC/NFKC/…: model output must keep the bytes the model chose.

    Structural normalisers (SentencePiece's space replacement, prepend) stay: they are part
    of how the vocabulary spells text.
    """
    if tokenizer.normalizer is None:
        return tokenizer
    normaliser = json.loads(tokenizer.normalizer.__getstate__())  # its own JSON, not the whole tokenizer's
    stripped = _strip_unicode(normaliser)
    if stripped == normaliser:
        return tokenizer
    from tokenizers import Tokenizer

    data = json.loads(tokenizer.to_str())
    data["normalizer"] = stripped
    return Tokenizer.from_str(json.dumps(data))


def read_chat_template(folder: Path) -> str | None:
    """A model folder's own chat template (chat_template.jinja or tokenizer_config.json)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            return template
    return None


def from_hf_folder(folder: Path, *, trust_remote_code: bool) -> TokenizerBackend:
    """A backend for a local Hugging Face model folder, via ``AutoTokenizer``.

    Fast tokenizers are driven through their ``tokenizers`` object; remote-code tiktoken
    tokenizers (Kimi's ``TikTokenTokenizer``) through their ``tiktoken.Encoding``.
    """
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)  # noqa: S615 - local folder
    template = getattr(hf, "chat_template", None) or read_chat_template(folder)
    backend_tok = getattr(hf, "backend_tokenizer", None)
    if backend_tok is not None:
        fast = TokenizersBackend(backend_tok, template)
        fast.source = folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else None
        return fast
    encoding = getattr(hf, "model", None)
    if encoding is not None and hasattr(encoding, "encode_single_token"):
        flags = read_added_tokens(folder)
        control = frozenset(i for i, special in flags.values() if special) if flags else None
        ranks = TiktokenBackend(encoding, chat_template=template, control_ids=control)
        ranks.source = folder / "tiktoken.model" if (folder / "tiktoken.model").is_file() else None
        return ranks
    raise TypeError(f"unsupported tokenizer class {type(hf).__name__} in {folder}")
