"""The simulator's pure core: an answer generated for a request, and the response bodies that carry it.

Nothing here, nor in the modules it draws on (:mod:`~services.simulator.request`,
:mod:`~services.simulator.faults`, :mod:`~services.simulator.prompts`,
:mod:`~services.simulator.text`, :mod:`~services.simulator.formats`,
:mod:`~services.simulator.noncanonical`), touches the network, the clock or the environment.
Generation is a function of the prompt (a hash of ``messages`` and ``tools``) and the seed, so
a retry of the same prompt sees the same answer and the same content faults, while transient
faults are drawn from an RNG the caller owns.

The ground truth is built the way a model produces it, independently of reconstruction:
the simulator writes the RAW text the model would generate, in the model's own format
(think block, native tool-call syntax, end-of-turn; see
:func:`~services.simulator.formats.write_raw_output`), and the true ids are the tokenizer's
encoding of that text. The response fields are then what an inference server makes of those
ids: it decodes them (the end-of-turn dropped, the think and tool tokens kept) and runs its
reasoning and tool parsers over the text (:func:`~services.simulator.formats.parse_raw_output`,
after ``../shared/reference/PARSERS.md``). Nothing here calls a profile's own rendering of an
answer, so a pipeline test comparing rebuilt ids with the true ids (which the HTTP shell serves
on its own endpoint, never in a response body) compares two independent things.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from schemas import ToolCall
from services.profiles import ProfileLike
from services.simulator.faults import CONTENT_FAULTS, prompt_digest
from services.simulator.formats import PARSERS, native_tool_calls, parse_raw_output, write_raw_output
from services.simulator.noncanonical import noncanonical_same_length, noncanonical_split
from services.simulator.prompts import ThinkBlock, profile_prompt_text, think_block_of
from services.simulator.request import ChatRequest, RequestError
from services.simulator.text import offered_tools, sized_text, tool_call_args

__all__ = [
    "BAD_USAGE_OFFSET",
    "Generation",
    "GenerationParams",
    "answer_cost",
    "build_completion_body",
    "build_response_body",
    "error_body",
    "generate",
    "raw_completion_text",
    "usage_counts",
]

# How far off a bad_usage response's completion_tokens is (at least).
BAD_USAGE_OFFSET: Final = 1000


@dataclass(frozen=True)
class GenerationParams:
    """Generation knobs (a subset of the simulator options)."""

    seed: int = 0
    reasoning_tokens: tuple[int, int] = (40, 200)
    content_tokens: tuple[int, int] = (20, 120)
    count_end_of_turn: bool = True
    count_think_end: bool = True
    price_per_token: float = 2e-6
    prompt_price_per_token: float = 0.0
    # A local server's answers: no ``usage.cost``, and nothing charged (the configured price counts).
    free: bool = False
    parser: str = "vllm"
    # When set, a thinking answer's length is drawn log-uniform in ``answer_tokens`` and a share in
    # ``reasoning_share`` of it is reasoning (overrides the two ranges).
    answer_tokens: tuple[int, int] | None = None
    reasoning_share: tuple[float, float] = (0.80, 0.95)
    # The model calls every offered tool once, in the order offered (a parallel-call answer whose
    # calls a trajectory can predict), instead of one tool drawn at random.
    parallel_tool_calls: bool = False


@dataclass
class Generation:
    """One generated answer: the model's raw text and true ids, and the parsed response fields."""

    reasoning: str
    content: str
    tool_calls: list[ToolCall]
    true_ids: list[int]
    canonical_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    faults: list[str] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    # What the model wrote, end-of-turn included, before any cut (true ids encode it).
    raw_text: str = ""
    # The prompt the answer follows, and its ids as a server tokenizes it.
    prompt_text: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    think_block: ThinkBlock = "none"


# ---------------------------------------------------------------- generation


def usage_counts(
    profile: ProfileLike, true_ids: Sequence[int], params: GenerationParams, *, thinking: bool = True
) -> tuple[int, int]:
    """(completion_tokens, reasoning_tokens) of true ids under the counting convention.

    Reasoning tokens are the ids before the think-end (all of them when the answer stopped
    inside the reasoning; none when ``thinking`` is off).
    """
    completion = len(true_ids)
    if not params.count_end_of_turn and true_ids and true_ids[-1] == profile.end_of_turn_id:
        completion -= 1
    think_end_id = profile.think_end_id
    if think_end_id is not None and think_end_id in true_ids:
        reasoning = list(true_ids).index(think_end_id)
        if not params.count_think_end:
            completion -= list(true_ids).count(think_end_id)
    else:
        reasoning = len(true_ids) if thinking else 0
    return completion, reasoning


def _truncation_cut(profile: ProfileLike, ids: list[int], rng: random.Random) -> int:
    """Where a ``truncate`` fault cuts: strictly inside the reasoning, else inside the answer."""
    think_end_id = profile.think_end_id
    if think_end_id is not None and think_end_id in ids:
        n_reasoning = ids.index(think_end_id)
        # Keep at least one id of reasoning after a think-start the model wrote.
        low = 2 if ids and ids[0] == profile.think_start_id else 1
        if n_reasoning - 1 >= low:
            return rng.randint(low, n_reasoning - 1)
        return max(1, n_reasoning)  # nothing to cut inside: stop right before the think-end
    n_answer = len(ids) - 1 if ids and ids[-1] == profile.end_of_turn_id else len(ids)
    return rng.randint(1, n_answer - 1) if n_answer >= 2 else max(1, n_answer)


def _answer_ranges(rng: random.Random, params: GenerationParams) -> tuple[tuple[int, int], tuple[int, int]]:
    """(reasoning, content) token ranges of one thinking answer: the options' ranges, or one
    log-uniform length split by the reasoning share when ``answer_tokens`` is set."""
    if params.answer_tokens is None:
        return params.reasoning_tokens, params.content_tokens
    low, high = params.answer_tokens
    total = int(math.exp(rng.uniform(math.log(low), math.log(high))))
    reasoning = max(1, int(total * rng.uniform(*params.reasoning_share)))
    content = max(10, total - reasoning)
    return (reasoning, reasoning), (content, content)


def generate(
    profile: ProfileLike,
    request: ChatRequest,
    params: GenerationParams,
    *,
    content_faults: Sequence[str] = (),
    prompt_text: str | None = None,
) -> Generation:
    """The deterministic answer to ``request``: raw text, true ids, parsed fields, faults.

    ``prompt_text`` is the rendered prompt the answer follows (the profile's own template
    when None); it decides whether the model opens a think block and gives prompt_tokens.
    """
    if params.parser not in PARSERS:
        raise RequestError(f"unknown parser {params.parser!r}; known: {', '.join(PARSERS)}", 500)
    if prompt_text is None:
        prompt_text = profile_prompt_text(profile, request)
    prompt_ids = profile.encode_prompt(prompt_text)
    think_block = think_block_of(profile, prompt_text)
    thinking = think_block != "none"
    digest = prompt_digest(request)
    rng = random.Random(int.from_bytes(digest, "little") ^ params.seed)  # noqa: S311 - not crypto
    faults = [f for f in CONTENT_FAULTS if f in content_faults]
    fallbacks: list[str] = []

    reasoning = ""
    reasoning_range, content_range = _answer_ranges(rng, params) if thinking else (None, params.content_tokens)
    if thinking and "empty_reasoning" not in faults:
        reasoning = sized_text(profile, rng, reasoning_range or params.reasoning_tokens, True)
    elif "empty_reasoning" in faults and not thinking:
        fallbacks.append("empty_reasoning")  # no think block to leave empty
    tools = offered_tools(request) if native_tool_calls(profile.tool_format, [("f", "{}")]) is not None else []
    if params.parallel_tool_calls and len(tools) > 1:
        calls = [tool_call_args(rng, [tool]) for tool in tools]
    else:
        calls = [tool_call_args(rng, tools)] if tools else []
    content_range = (3, 15) if calls else content_range
    content_text = sized_text(profile, rng, content_range, False)
    raw = write_raw_output(
        profile, think_block=think_block, reasoning=reasoning, content=content_text, tool_calls=calls
    )
    canonical = profile.encode(raw)
    true_ids = list(canonical)

    cut: int | None = None
    if "truncate" in faults:
        cut = _truncation_cut(profile, true_ids, rng)
    if request.max_tokens is not None and len(true_ids) > request.max_tokens:
        cut = request.max_tokens if cut is None else min(cut, request.max_tokens)
    if cut is not None:
        true_ids = true_ids[:cut]
        canonical = true_ids[:]

    # What the server detokenises (skip_special_tokens: the end-of-turn goes, the
    # special=false think and tool tokens stay) and parses into the response fields.
    decoded = profile.decode([i for i in true_ids if i != profile.end_of_turn_id])
    out_reasoning, out_content, out_calls = parse_raw_output(
        profile,
        decoded,
        think_block=think_block,
        tools_sent=bool(request.tools),
        parser=params.parser,
        call_id=f"call_{digest.hex()[:24]}",
    )
    finish = "length" if cut is not None else ("tool_calls" if out_calls else "stop")

    if "noncanonical_len" in faults:
        changed = noncanonical_split(profile, true_ids, rng)
        if changed is None:
            fallbacks.append("noncanonical_len")
        else:
            true_ids = changed
    if "noncanonical_same" in faults:
        changed = noncanonical_same_length(profile, true_ids, rng)
        if changed is None:
            fallbacks.append("noncanonical_same")
        else:
            true_ids = changed

    completion, reasoning_tokens = usage_counts(profile, true_ids, params, thinking=thinking)
    if "bad_usage" in faults:
        completion += max(BAD_USAGE_OFFSET, len(true_ids))
    return Generation(
        reasoning=out_reasoning,
        content=out_content,
        tool_calls=out_calls,
        true_ids=true_ids,
        canonical_ids=canonical,
        finish_reason=finish,
        prompt_tokens=len(prompt_ids),
        completion_tokens=completion,
        reasoning_tokens=reasoning_tokens,
        faults=faults,
        fallbacks=fallbacks,
        raw_text=raw,
        prompt_text=prompt_text,
        prompt_ids=prompt_ids,
        think_block=think_block,
    )


# ---------------------------------------------------------------- response bodies


def _logprobs(profile: ProfileLike, ids: list[int], digest: bytes, seed: int, top: int) -> dict[str, Any]:
    rng = random.Random(int.from_bytes(digest, "big") ^ (seed + 7919))  # noqa: S311 - not crypto
    content = []
    for token_id in ids:
        data = profile.token_bytes(token_id)
        logprob = -round(rng.expovariate(4.0), 5)
        entry: dict[str, Any] = {
            "token": data.decode("utf-8", errors="replace"),
            "bytes": list(data),
            "logprob": logprob,
        }
        entry["top_logprobs"] = [{"token": entry["token"], "bytes": entry["bytes"], "logprob": logprob}][:top]
        content.append(entry)
    return {"content": content, "refusal": None}


def build_response_body(
    profile: ProfileLike,
    generation: Generation,
    request: ChatRequest,
    params: GenerationParams,
    *,
    provider: str,
    response_id: str,
    created: int,
    logprobs: bool,
) -> dict[str, Any]:
    """The OpenRouter-shaped JSON body for one generation.

    With ``return_token_ids`` in the request the body carries the ids as vLLM returns
    them: ``choices[0].token_ids`` (the output ids) and a top-level ``prompt_token_ids``.
    """
    message: dict[str, Any] = {
        "role": "assistant",
        "content": generation.content,
        "refusal": None,
        "reasoning": generation.reasoning or None,
    }
    if generation.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "index": i,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for i, call in enumerate(generation.tool_calls)
        ]
    choice: dict[str, Any] = {
        "index": 0,
        "logprobs": None,
        "finish_reason": generation.finish_reason,
        "native_finish_reason": generation.finish_reason,
        "message": message,
    }
    if logprobs:
        choice["logprobs"] = _logprobs(
            profile, generation.true_ids, prompt_digest(request), params.seed, request.top_logprobs
        )
    if request.return_token_ids:
        choice["token_ids"] = generation.true_ids
    body = _envelope("chat.completion", choice, generation, request, params, provider, response_id, created)
    if request.return_token_ids:
        body["prompt_token_ids"] = generation.prompt_ids
    return body


def _envelope(
    kind: str,
    choice: dict[str, Any],
    generation: Generation,
    request: ChatRequest,
    params: GenerationParams,
    provider: str,
    response_id: str,
    created: int,
) -> dict[str, Any]:
    """The body around one choice, chat or text completion alike: ids, model, usage."""
    return {
        "id": response_id,
        "provider": provider,
        "model": request.model,
        "object": kind,
        "created": created,
        "choices": [choice],
        "usage": _usage_body(generation, params),
    }


def answer_cost(generation: Generation, params: GenerationParams) -> float:
    """What one answer costs, as its ``usage.cost`` says (and the key is charged); 0 on a free server."""
    if params.free:
        return 0.0
    cost = (
        generation.completion_tokens * params.price_per_token + generation.prompt_tokens * params.prompt_price_per_token
    )
    return round(cost, 12)


def _usage_body(generation: Generation, params: GenerationParams) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "total_tokens": generation.prompt_tokens + generation.completion_tokens,
        "completion_tokens_details": {"reasoning_tokens": generation.reasoning_tokens},
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    if not params.free:
        body["cost"] = answer_cost(generation, params)
    return body


def raw_completion_text(profile: ProfileLike, ids: Sequence[int]) -> str:
    """The text a completions server returns for ``ids`` with ``skip_special_tokens: false``.

    Every special is kept except the final end-of-turn (the stop token, which the
    detokenizer drops); a trailing incomplete UTF-8 character is held back, as an
    incremental detokenizer does.
    """
    shown = list(ids[:-1]) if ids and ids[-1] == profile.end_of_turn_id else list(ids)
    data = b"".join(profile.token_bytes(i) for i in shown)
    for drop in range(min(4, len(data)) + 1):
        try:
            return data[: len(data) - drop].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="replace")


def build_completion_body(
    profile: ProfileLike,
    generation: Generation,
    request: ChatRequest,
    params: GenerationParams,
    *,
    provider: str,
    response_id: str,
    created: int,
) -> dict[str, Any]:
    """The OpenAI text-completions body for one generation: the raw text, no reasoning or tool parser."""
    choice = {
        "index": 0,
        "text": raw_completion_text(profile, generation.true_ids),
        "logprobs": None,
        "finish_reason": "length" if generation.finish_reason == "length" else "stop",
    }
    return _envelope("text_completion", choice, generation, request, params, provider, response_id, created)


def error_body(code: int, message: str) -> dict[str, Any]:
    """An OpenRouter-style error object."""
    return {"error": {"code": code, "message": message}}
