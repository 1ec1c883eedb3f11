"""Answers for the fuzzer: the model's text with random whitespace at every edge, and what servers make of it.

The truth is outside the code under test: prompts are the official chat templates rendered
by ``tests/conformance/truth.py`` over its conversations, output ids are the real tokenizers'
encoding of the text the model wrote (``truth.truth_tokenizer``), and each server's loss is
``truth.emulate`` (vLLM, SGLang before 2026, logprobs) or a plain string operation on a vLLM
answer (a field ``.strip()``, an ``.lstrip()``, whitespace-only content next to tool calls
returned as ``null``). Only the generation is fuzzed: reasoning and content with runs of
spaces, newlines, tabs, CRLF and U+00A0 (lengths 0-6, one kind or mixed) at every edge,
first words that merge with a leading space, tool calls in the forms the conversations write.
"""

from __future__ import annotations

import copy
import random
from dataclasses import replace
from functools import cache
from typing import Any

from schemas import ResponseReceived
from tests.conformance import truth as T
from tests.conformance.test_matrix import response_of

# The built-in profiles with an official template in the reference, and the Gemma-style user profile.
MODELS = ("qwen3", "qwen3-thinking-2507", "deepseek-r1", "deepseek-v3.1", "user-addedtok")
WHITESPACE = (" ", "\n", "\t", "\r\n", "\u00a0")
# Words whose tokens merge with a leading space (" trailing", " Then"), so a lost "\n\n " may cost nothing.
MERGING = ("trailing", "Then", "The", "So", "Consequently", "Therefore", "In", "We", "Answer", "it")
# What the server does to the model's text (LOSSES) and whether that strips field edges.
LOSSES = ("vllm", "null-ws", "sglang-strip", "strip-fields", "lstrip")
STRIPS = frozenset({"sglang-strip", "strip-fields", "lstrip"})


def whitespace_run(rng: random.Random) -> str:
    """An edge: nothing (often), or 1-6 whitespace units of one kind or mixed."""
    if rng.random() < 0.35:
        return ""
    n = rng.randint(1, 6)
    if rng.random() < 0.5:
        return rng.choice(WHITESPACE) * n
    return "".join(rng.choice(WHITESPACE) for _ in range(n))


def _prose(rng: random.Random) -> str:
    words = [rng.choice(T._WORDS) for _ in range(rng.randint(2, 9))]
    first = rng.choice(MERGING) if rng.random() < 0.6 else words.pop(0)
    lead = " " if rng.random() < 0.3 else ""
    return lead + " ".join([first, *words]) + rng.choice((".", "", ":", "?"))


@cache
def bases(model: str, seed: int) -> list[tuple[T.Conversation, str, tuple[int, ...]]]:
    """The conversations answers are generated for: request shapes that stop by themselves, prompts rendered once."""
    tok = T.truth_tokenizer(model)
    out = []
    for conv in T.conversations(model, 16, seed):
        if "truncated" in conv.features or "after_tool_result" in conv.features:
            continue
        prompt = T.render_prompt(model, conv)
        out.append((conv, prompt, tuple(tok.encode_prompt(prompt))))
    return out


def fuzzed_case(model: str, seed: int, rng: random.Random) -> T.Case:
    """One answer: a base conversation's request with a fuzzed generation, and its true ids."""
    spec = T._SPECS[model]
    base = rng.randrange(len(bases(model, seed)))
    conv = bases(model, seed)[base][0]
    reasoning = None
    if spec.thinks and conv.thinking:
        reasoning = whitespace_run(rng) + _prose(rng) + whitespace_run(rng)
    words = "" if conv.generation.calls and rng.random() < 0.3 else _prose(rng)
    content = whitespace_run(rng) + words + whitespace_run(rng)
    if not reasoning and not content.strip() and not conv.generation.calls:
        content = _prose(rng)
    return case_of(model, seed, base, reasoning, content)


def case_of(model: str, seed: int, base: int, reasoning: str | None, content: str) -> T.Case:
    """The case of a generation: base conversation ``base``'s request, the model writing these fields."""
    spec, tok = T._SPECS[model], T.truth_tokenizer(model)
    conv, prompt_text, prompt_ids = bases(model, seed)[base]
    calls = conv.generation.calls
    raw = T._assemble(spec, reasoning, True, content, calls) + tok.eot
    generation = T.Generation(raw, reasoning, content, calls)
    fuzzed = replace(copy.copy(conv), generation=generation, max_tokens=10**6, name=f"{conv.name}/{base}")
    output_ids = tok.encode_output(raw)
    ids = list(prompt_ids)
    return T.Case(model, fuzzed, raw, prompt_text, ids, output_ids, ids + output_ids,
                  [0] * len(ids) + [1] * len(output_ids), True)  # fmt: skip


def edge_lost(case: T.Case, got: dict[str, Any]) -> bool:
    """Whether the server lost whitespace at an edge of the model's reasoning or content."""
    generation = case.conversation.generation
    pairs = ((generation.reasoning or "", got["reasoning"] or ""), (generation.content, got["content"] or ""))
    return any(served != written and served in (written.strip(), written.lstrip()) for written, served in pairs)


def served(case: T.Case, loss: str, logprobs: bool) -> dict[str, Any]:
    """What a server with ``loss`` returns for the case (``truth.emulate`` plus a string operation)."""
    base = "sglang-strip" if loss == "sglang-strip" else "openrouter" if logprobs else "vllm"
    got = T.emulate(case, base)
    if not logprobs:
        got["logprobs"] = None
    if loss == "strip-fields":
        got["reasoning"], got["content"] = (got["reasoning"] or "").strip(), (got["content"] or "").strip()
    elif loss == "lstrip":
        got["reasoning"], got["content"] = (got["reasoning"] or "").lstrip(), (got["content"] or "").lstrip()
    elif loss == "null-ws" and got["tool_calls"] and not (got["content"] or "").strip():
        got["content"] = None  # vLLM's serving layer: whitespace-only content beside tool calls
    if logprobs and loss == "sglang-strip":  # the stripping server's text with the ids it generated
        got["logprobs"] = T.emulate(case, "openrouter")["logprobs"]
    return got


def response(
    case: T.Case, got: dict[str, Any], sample_id: str, provider: str, upstream: str | None
) -> ResponseReceived:
    """The ``ResponseReceived`` the inference stage would publish for a served answer."""
    return response_of(case, got, sample_id, provider, upstream, dataset="fuzz")
