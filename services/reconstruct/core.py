"""Rebuild the token ids of a response: pure functions over schema objects and a profile.

Output ids come, in order of trust, from the provider's native ids (``native``), from its
logprob tokens mapped to vocabulary ids (``logprobs``), else from re-encoding the text
(``reencode``). Re-encoding puts back only what every provider of the kind removes by
definition (a think-start the prompt did not open, the think-end, the native text of
structured tool calls, the end-of-turn) and never guesses what a lossy provider may have
dropped: where the provider's :class:`~services.profiles.conventions.Convention` says text
may be missing (stripped whitespace, the space around re-parsed arguments, the text
between tool calls), the ids are accepted only when ``usage.completion_tokens`` proves
nothing is missing — the count matches and no whitespace at any such place could have
hidden inside the count — else the sample is a dead letter naming what was lost. What one
answer proves about its upstream (a field edge showing whitespace, arguments in the model's
own form) closes those places in the upstream's other answers: ``reconstruct_with_facts``
and ``services/reconstruct/facts.py``.

Prompt ids are the encoded chat template over the messages as sent; the loss mask is 0
over them and 1 over the output. Bad input is a :class:`DeadLetter` with a stable reason
code, never an exception.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from schemas import (
    LogprobToken,
    ProviderFactRecorded,
    ResponseReceived,
    SampleReconstructed,
    ToolCall,
    sample_key,
)
from services.common.records import DeadLetter
from services.profiles import GAP_ARGUMENTS, ProfileError
from services.profiles.conventions import Convention
from services.reconstruct.facts import ARGUMENTS_PLACE, FACT_CONTRADICTED, PLACES, FactBook, fact_key, upstream_of
from services.reconstruct.plan import (
    EMPTY_RESPONSE,
    ID_OUT_OF_VOCAB,
    TEMPLATE_ERROR,
    Layout,
    ReconstructProfile,
    output_layout,
)
from services.reconstruct.plan import Plan as _Plan
from services.reconstruct.plan import check_ids as _check_ids
from services.reconstruct.restore import ARBITRARY, CHOICE, WHITESPACE, Slot, restore

__all__ = [
    "EMPTY_RESPONSE",
    "ID_OUT_OF_VOCAB",
    "INVALID_TOOL_ARGUMENTS",
    "LOGPROBS_UNMAPPABLE",
    "SPECIAL_TOKEN_IN_TEXT",
    "COUNT_TRUSTED",
    "SOUND",
    "ReconstructProfile",
    "Rule",
    "judge",
    "output_layout",
    "reconstruct",
    "reconstruct_batch",
    "server_tools",
]

INVALID_TOOL_ARGUMENTS = "invalid_tool_arguments"
SPECIAL_TOKEN_IN_TEXT = "special_token_in_text"  # noqa: S105 - a reason code
LOGPROBS_UNMAPPABLE = "logprobs_unmappable"
UNEXPECTED_REASONING = "unexpected_reasoning"
TOOL_ARGUMENTS_RESERIALIZED = "tool_arguments_reserialized"
WHITESPACE_STRIPPED = "whitespace_stripped"
WHITESPACE_AMBIGUOUS = "whitespace_ambiguous"
TOOL_TEXT_LOST = "tool_call_text_lost"
LOSS_UNVERIFIABLE = "lossy_text_unverifiable"
TRUNCATED_TAIL_LOST = "truncated_tail_lost"
TRUNCATED_TAIL_AMBIGUOUS = "truncated_tail_ambiguous"
THINK_LAYOUT_AMBIGUOUS = "think_layout_ambiguous"

# Where a provider can lose text (for messages): stripped field edges, around tool blocks,
# re-serialised tool arguments.
_STRIP = "strip"
_TOOL = "tool"
_ARGS = "arguments"


_TOKEN_ID_FORM = re.compile(r"^token_id:(\d+)$")


def _logprob_id(token: LogprobToken, profile: ReconstructProfile) -> int | None:
    """Vocabulary id of one logprob token: explicit id, exact bytes, "token_id:N", or its text."""
    if token.id is not None:
        return token.id
    if token.bytes is not None:
        return profile.id_of_bytes(bytes(token.bytes))
    match = _TOKEN_ID_FORM.match(token.token)
    if match:
        return int(match.group(1))
    found = profile.id_of_bytes(token.token.encode("utf-8"))
    if found is None:
        found = profile.id_of_token_string(token.token)
    return found


def _ids_from_logprobs(response: ResponseReceived, profile: ReconstructProfile) -> list[int] | DeadLetter:
    tokens = response.logprobs or []
    ids: list[int] = []
    for position, token in enumerate(tokens):
        found = _logprob_id(token, profile)
        if found is None:
            return DeadLetter(
                LOGPROBS_UNMAPPABLE,
                f"logprob token {position} ({token.token!r}) matches no {profile.name} vocabulary entry",
            )
        ids.append(found)
    # Providers differ on whether the final end-of-turn is listed: a finished answer has it.
    if response.finish_reason != "length" and (not ids or ids[-1] != profile.end_of_turn_id):
        ids.append(profile.end_of_turn_id)
    return ids


def _check_text(response: ResponseReceived, profile: ReconstructProfile) -> DeadLetter | None:
    """Control strings that cannot stand in provider text (they would encode as control ids)."""
    tool_strings = set(profile.tool_tokens)
    for where, text in (("reasoning", response.reasoning), ("content", response.content)):
        for special in profile.special_strings:
            # Raw tool-call text in content is how a model answers without a tools parameter.
            if where == "content" and special in tool_strings and not response.tool_calls:
                continue
            if special in text:
                return DeadLetter(SPECIAL_TOKEN_IN_TEXT, f"{where} contains the special token {special!r}")
    for index, call in enumerate(response.tool_calls):
        for special in profile.special_strings:
            if special in call.function.name or special in call.function.arguments or special in call.id:
                return DeadLetter(SPECIAL_TOKEN_IN_TEXT, f"tool call {index} contains the special token {special!r}")
    return None


def _check_tool_calls(calls: Sequence[ToolCall]) -> DeadLetter | None:
    for index, call in enumerate(calls):
        if not call.function.name:
            return DeadLetter(INVALID_TOOL_ARGUMENTS, f"tool call {index} has no function name")
        try:
            json.loads(call.function.arguments)
        except ValueError as exc:
            return DeadLetter(
                INVALID_TOOL_ARGUMENTS,
                f"tool call {index} ({call.function.name}): arguments are not JSON: {exc}",
            )
    return None


class _Text:
    """The output text being assembled, with its slots (places the provider may have lost text)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.length = 0
        self.gaps: list[Slot] = []

    def add(self, text: str) -> None:
        self.parts.append(text)
        self.length += len(text)

    def gap(self, where: str, kind: str = WHITESPACE, place: str = "") -> None:
        last = self.gaps[-1] if self.gaps else None
        places = frozenset({place} if place else ())
        if last is not None and last.kind != CHOICE and last.start == self.length:
            if kind == ARBITRARY:  # the wider loss wins where two meet
                self.gaps[-1] = Slot(self.length, self.length, kind, where=where)
            elif last.kind == WHITESPACE:
                self.gaps[-1] = Slot(self.length, self.length, last.kind, where=last.where,
                                     places=last.places | places)  # fmt: skip
            return
        self.gaps.append(Slot(self.length, self.length, kind, where=where, places=places))

    def choice(self, text: str, alternatives: tuple[str, ...]) -> None:
        self.gaps.append(Slot(self.length, self.length + len(text), CHOICE, alternatives, where=_ARGS,
                              places=frozenset({ARGUMENTS_PLACE})))  # fmt: skip
        self.add(text)

    def text(self) -> str:
        return "".join(self.parts)


def _edges(text: str) -> tuple[bool, bool]:
    """Whether ``text`` begins / ends with whitespace (what ``str.strip()`` would remove)."""
    return bool(text) and text[0].isspace(), bool(text) and text[-1].isspace()


def _reencode_plan(
    response: ResponseReceived, profile: ReconstructProfile, convention: Convention, prompt_text: str
) -> _Plan | DeadLetter:
    if not response.reasoning and not response.content and not response.tool_calls:
        return DeadLetter(EMPTY_RESPONSE, "the response has no reasoning, no content and no tool calls")
    bad = _check_tool_calls(response.tool_calls) or _check_text(response, profile)
    if bad is not None:
        return bad
    truncated = response.finish_reason == "length"
    # A truncated answer with nothing after the reasoning stopped inside the think block.
    closed = not truncated or bool(response.content or response.tool_calls)
    state = profile.prompt_state(prompt_text)
    if response.reasoning and state == "none" and profile.thinks() and _think_start_in_prompt(profile):
        return _unopened_block_plan(response, profile, convention, prompt_text, closed=closed)
    layout = output_layout(profile, prompt_text, reasoning=response.reasoning, closed=closed, finished=not truncated)
    thinking = layout.think_start or layout.think_end or state == "open"
    if response.reasoning and not thinking:
        return DeadLetter(
            UNEXPECTED_REASONING,
            f"the response carries reasoning but under {profile.name} this prompt leaves no think block "
            f"open for the model (prompt state {state!r})",
        )
    return _assemble(response, profile, convention, prompt_text, layout, thinking=thinking)


def _think_start_in_prompt(profile: ReconstructProfile) -> bool:
    """Whether the profile's think-start lives in the generation prompt (R1, Qwen3-2507, V3.1)."""
    return getattr(profile, "think_location", None) == "prompt"


def _unopened_block_plan(
    response: ResponseReceived, profile: ReconstructProfile, convention: Convention, prompt_text: str, *, closed: bool
) -> _Plan | DeadLetter:
    """A model whose think-start lives in the prompt, under a prompt that opened no block.

    R1's official template opens none after a tool result; the model then writes no think
    token, or it may write them itself. A parser that sees no think-end puts the whole
    answer into ``reasoning`` (vLLM, SGLang's forced reasoning), so the fields cannot say
    which: each layout the fields allow is rebuilt, and the usage count must single one out.
    """
    finished = response.finish_reason != "length"
    split = bool(response.content or response.tool_calls)  # the parser found a think-end
    ends = (True,) if split else (False, True) if closed else (False,)
    layouts = [Layout(start, end, finished) for end in ends for start in (False, True)]
    plans = [_assemble(response, profile, convention, prompt_text, layout, thinking=True, raw=not layout.think_end
                       and not layout.think_start) for layout in layouts]
    live = [plan for plan in plans if isinstance(plan, _Plan) and plan.output_text is not None]
    if not live:
        return plans[0]
    completion = response.usage.completion_tokens
    if completion is None:
        return DeadLetter(
            LOSS_UNVERIFIABLE,
            f"under {profile.name} this prompt opens no think block, so which think tokens the model wrote is "
            "pinned only by usage.completion_tokens, which the provider did not report",
        )
    expected = completion - convention.completion_offset
    texts = [plan.output_text or "" for plan in live]
    fitting = [plan for plan, ids in zip(live, profile.encode_batch(texts), strict=True) if len(ids) == expected]
    if len(fitting) != 1:
        return DeadLetter(
            THINK_LAYOUT_AMBIGUOUS,
            f"under {profile.name} this prompt opens no think block; {len(fitting)} of {len(live)} ways the model "
            f"may have written its think tokens give usage.completion_tokens ({expected})",
        )
    return fitting[0]


def _assemble(
    response: ResponseReceived,
    profile: ReconstructProfile,
    convention: Convention,
    prompt_text: str,
    layout: Layout,
    *,
    thinking: bool,
    raw: bool = False,
) -> _Plan | DeadLetter:
    """The output text of a response under one layout, with its slots.

    ``raw``: no think token at all, the ``reasoning`` field is the model's plain answer text.
    """
    calls = response.tool_calls
    # The text's own evidence is per edge: whitespace shown at an edge proves nothing was stripped
    # there, and nothing about the span's other end (a server may strip one end: .lstrip(), SGLang's
    # streaming .rstrip() of the reasoning).
    open_units = convention.open_strip_units(frozenset())
    reasoning_units = {"reasoning", "text"} if thinking else set()
    content_units = {"content"} if thinking else {"content", "text"}
    out = _Text()
    think_end_at: int | None = None
    r_start, r_end = _edges(response.reasoning)
    c_start, c_end = _edges(response.content)
    # The places whose field edge shows whitespace here: evidence about the upstream (facts.py).
    shown: set[str] = set()

    def edge(units: set[str], place: str, shows: bool) -> None:
        if shows:
            shown.add(place)
        elif not open_units.isdisjoint(units):
            out.gap(_STRIP, place=place)

    if layout.think_start and profile.think_start:
        out.add(profile.think_start)
    if raw:  # which field edge this is depends on a layout the fields cannot show: no evidence
        edge({"reasoning", "text"}, "answer_start", False)
        out.add(response.reasoning)
        edge({"reasoning", "text"}, "answer_end", False)
    elif thinking:
        edge(reasoning_units, "reasoning_start", r_start)
        out.add(response.reasoning)
        if not layout.think_end:
            edge({"reasoning", "text"}, "reasoning_cut", r_end)
            if layout.end_of_turn:  # a block the model opened and never closed
                out.add(profile.end_of_turn)
            plan = _Plan(response, prompt_text, out.text(), None, "reencode", layout, out.gaps)
            plan.shown = frozenset(shown)
            return plan
        edge({"reasoning"}, "reasoning_end", r_end)
        think_end_at = out.length
        out.add(profile.think_end or "")
    edge(content_units, "content_start" if thinking else "text_start", c_start)
    out.add(response.content)
    end_place = "before_tool" if calls else "content_end" if thinking else "text_end"
    edge(content_units if not calls else {"content"}, end_place, c_end)
    if calls:
        try:
            pieces = profile.tool_call_pieces(calls)
        except ProfileError as exc:  # e.g. structured tool calls for a profile without a format
            return DeadLetter(exc.reason, exc.message)
        reserialized = profile.tool_format in convention.reserialized_tool_formats
        # Each call's re-serialised part, in call order, becomes a choice slot.
        choices = iter(_argument_choices(profile.tool_format, calls) if reserialized else [])
        if reserialized and any(not _dumps_form(call.function.arguments) for call in calls):
            shown.add(ARGUMENTS_PLACE)  # a re-serialising parser returns json.dumps' own form only
        wanted = next(choices, None)
        for piece in pieces:
            if not isinstance(piece, str):
                if piece[0] != GAP_ARGUMENTS or profile.tool_format in convention.trimmed_argument_formats:
                    out.gap(_TOOL)
                continue
            while wanted is not None and wanted[0] in piece:
                at = piece.index(wanted[0]) + (0 if wanted[1] else len(wanted[0]))
                out.add(piece[:at])
                if wanted[1]:
                    out.choice(*wanted)
                    at += len(wanted[0])
                piece = piece[at:]
                wanted = next(choices, None)
            out.add(piece)
        out.gap(_TOOL, ARBITRARY)  # tool parsers drop whatever followed the block
    if layout.end_of_turn:
        out.add(profile.end_of_turn)
    plan = _Plan(response, prompt_text, out.text(), None, "reencode", layout, out.gaps)
    plan.think_end_at = think_end_at
    plan.shown = frozenset(shown)
    return plan


def _json_forms(value: object) -> list[str]:
    """The canonical serialisations a model may have written for a parsed JSON value."""
    return [
        json.dumps(value, ensure_ascii=ascii_only, separators=separators)
        for separators in ((", ", ": "), (",", ":"))
        for ascii_only in (False, True)
    ]


def _dumps_form(arguments: str) -> bool:
    """Whether tool arguments are in ``json.dumps(value, ensure_ascii=False)``'s own form (valid JSON)."""
    return arguments == json.dumps(json.loads(arguments), ensure_ascii=False)


def _argument_choices(tool_format: str, calls: Sequence[ToolCall]) -> list[tuple[str, tuple[str, ...]]]:
    """Per call: the text our native rendering holds and every text the model may have written there.

    A re-serialising parser kept only the parsed value. Qwen3's hermes parsers parse the
    whole ``{"name": ..., "arguments": ...}`` object, so its separators are candidates too;
    the DeepSeek detectors parse the arguments alone. No alternatives (``()``): the text is
    the model's own.
    """
    out: list[tuple[str, tuple[str, ...]]] = []
    for call in calls:
        raw, name = call.function.arguments, call.function.name
        current = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {raw}}}' if tool_format == "qwen" \
            else raw
        args = json.loads(raw)
        # The text's own evidence: a re-serialising parser returns exactly json.dumps(value,
        # ensure_ascii=False) (vLLM hermes, SGLang's detectors: PARSERS.md); arguments in any
        # other form are the model's own text.
        if not _dumps_form(raw):
            out.append((current, ()))
            continue
        forms = list(dict.fromkeys([raw, *_json_forms(args)]))
        if tool_format != "qwen":
            out.append((current, tuple(forms)))
            continue
        bodies = [current]
        for item, key in ((", ", ": "), (",", ":")):
            for name_text in dict.fromkeys(json.dumps(name, ensure_ascii=a) for a in (False, True)):
                bodies += [f'{{"name"{key}{name_text}{item}"arguments"{key}{form}}}' for form in forms]
        out.append((current, tuple(dict.fromkeys(bodies))))
    return out


# vLLM's FunctionDefinition field order: its request model dumps a function's keys in this order.
_FUNCTION_ORDER = ("name", "description", "parameters")


def server_tools(tools: Sequence[dict[str, object]], null_fields: Sequence[str]) -> list[dict[str, object]]:
    """The tools as the server's request model hands them to the template: absent fields rendered null.

    ``description`` (vLLM): a function without one gets ``"description": null``, its keys in
    the request model's order (name, description, parameters, then the rest).
    ``defer_loading`` (SGLang 0.5.23): every tool gets ``"defer_loading": null`` after its
    own keys. Facts of PARSERS.md "Corrections"; the key placement is the models' field order.
    """
    out: list[dict[str, object]] = []
    for tool in tools:
        served = dict(tool)
        function = served.get("function")
        if "description" in null_fields and isinstance(function, dict):
            named = {key: function.get(key) for key in _FUNCTION_ORDER if key in function or key == "description"}
            served["function"] = {**named, **{k: v for k, v in function.items() if k not in named}}
        if "defer_loading" in null_fields:
            served.setdefault("defer_loading", None)
        out.append(served)
    return out


def prompt_ids_of(
    responses: Sequence[ResponseReceived], profile: ReconstructProfile, convention: Convention
) -> list[list[int] | None]:
    """The prompt ids each response's request was rendered to (``None`` where the prompt cannot be rendered).

    Independent of the output's verdict: an answer refused for its output still says, through
    ``usage.prompt_tokens``, whether the profile renders and encodes prompts as the model does.
    """
    plans = [_plan(r, profile, convention) for r in responses]
    ids = iter(profile.encode_prompt_batch([p.prompt_text for p in plans if isinstance(p, _Plan)]))
    return [next(ids) if isinstance(p, _Plan) else None for p in plans]


def _plan(response: ResponseReceived, profile: ReconstructProfile, convention: Convention) -> _Plan | DeadLetter:
    """Decide the method and the texts to encode for one response."""
    if response.mode == "completions":  # the model's raw text: services/reconstruct/raw.py
        from services.reconstruct.raw import plan_raw

        return plan_raw(response, profile)
    # The prompt ids must be what the model saw: tool definitions reach the template only
    # when the request carried them as `tools`; otherwise they are in the message text or
    # the model never saw them.
    tools = response.prompt.tools if response.tools_sent else None
    if tools and convention.tool_null_fields:
        tools = server_tools(tools, convention.tool_null_fields)
    try:
        prompt_text = profile.render_prompt(
            response.prompt.messages, tools, reasoning=response.prompt.conversation is not None
        )
    except Exception as exc:  # a template error is this record's fault, not the stage's
        return DeadLetter(TEMPLATE_ERROR, f"chat template of {profile.name} failed: {type(exc).__name__}: {exc}")
    if response.native_output_ids:
        bad = _check_ids(response.native_output_ids, profile, "native output")
        if bad is not None:
            return bad
        return _Plan(response, prompt_text, None, list(response.native_output_ids), "native")
    if response.logprobs:
        ids = _ids_from_logprobs(response, profile)
        if isinstance(ids, DeadLetter):
            return ids
        bad = _check_ids(ids, profile, "logprob")
        if bad is not None:
            return bad
        return _Plan(response, prompt_text, None, ids, "logprobs")
    plan = _reencode_plan(response, profile, convention, prompt_text)
    if isinstance(plan, _Plan) and plan.gaps and response.usage.completion_tokens is not None:
        plan.expected_count = response.usage.completion_tokens - convention.completion_offset
        # Only a reasoning count whose convention is established (none is, built in: conventions.py).
        if convention.reasoning_count == "before_think_end" and response.usage.reasoning_tokens is not None:
            plan.expected_reasoning = response.usage.reasoning_tokens
    return plan


def _check_output_ids(plan: _Plan, ids: list[int], profile: ReconstructProfile) -> DeadLetter | None:
    """After re-encoding: no control id the text should not hold, and each special as laid out.

    Catches every control token of the vocabulary (special-flagged added tokens, declared
    and template markers), which a substring scan for the declared ones cannot; ordinary
    added tokens are text and pass.
    """
    layout = plan.layout or Layout(False, False, True)
    allowed = {profile.end_of_turn_id, *profile.tool_tokens.values()}
    if profile.think_end_id is not None and layout.think_end:
        allowed.add(profile.think_end_id)
    if profile.think_start_id is not None and layout.think_start:
        allowed.add(profile.think_start_id)
    # Set operations in C first; the first offending id in order only when there is one.
    if not profile.special_ids.isdisjoint(ids) and not (profile.special_ids.intersection(ids) <= allowed):
        for i in ids:
            if i in profile.special_ids and i not in allowed:
                (text,) = profile.token_strings([i])
                return DeadLetter(SPECIAL_TOKEN_IN_TEXT, f"the text contains the special token {text!r} (id {i})")
    expected = (
        (profile.think_start_id, int(layout.think_start), "think-start"),
        (profile.think_end_id, int(layout.think_end), "think-end"),
        (profile.end_of_turn_id, int(layout.end_of_turn), "end-of-turn"),
    )
    for token_id, count, what in expected:
        if token_id is not None and ids.count(token_id) != count:
            return DeadLetter(SPECIAL_TOKEN_IN_TEXT, f"the output holds {ids.count(token_id)} {what} tokens")
    return None


def _check_truncated_tail(plan: _Plan, ids: list[int], profile: ReconstructProfile) -> DeadLetter | None:
    """A truncated output's end: a server holds back a trailing incomplete character.

    The model's last token may then be visible bytes plus part of a character. Either that
    shows in the count (a token of its own), or the visible bytes are one of the profile's
    partial-character prefixes and a re-encoding can match the count with another last id.
    """
    completion = plan.response.usage.completion_tokens
    if completion is None:
        return DeadLetter(
            LOSS_UNVERIFIABLE, "a truncated answer without a usage count: its last token cannot be checked"
        )
    if len(ids) != completion:
        return DeadLetter(
            TRUNCATED_TAIL_LOST,
            f"{len(ids)} ids rebuilt, usage.completion_tokens says {completion}: "
            "the cut answer's tail is not in the text",
        )
    data = (plan.output_text or "").encode("utf-8")
    tail = data[-16:]
    prefixes = profile.partial_char_prefixes()
    suffixes = [tail[start:] for start in range(len(tail)) if tail[start:] in prefixes]
    if not suffixes:
        return None
    # The other reading of such an end: the last token is the suffix plus a withheld partial character,
    # after the rest of the text's own ids. It fits the count only when the rest encodes to one id fewer
    # than the count (the rest re-encoded as everywhere here: a same-length non-canonical split stays
    # invisible). A suffix that does not end a whole character's text cannot be told apart: refused.
    rests: list[str] = []
    for suffix in suffixes:
        try:
            rests.append(data[: -len(suffix)].decode("utf-8"))
        except UnicodeDecodeError:
            return _tail_ambiguous(suffix)
    for suffix, rest_ids in zip(suffixes, profile.encode_batch(rests), strict=True):
        if len(rest_ids) + 1 == completion:
            return _tail_ambiguous(suffix)
    return None


def _tail_ambiguous(suffix: bytes) -> DeadLetter:
    return DeadLetter(
        TRUNCATED_TAIL_AMBIGUOUS,
        f"the cut answer ends with {suffix!r}, which a token can extend with part of a character the "
        "server would not show, and the count fits that reading too: the last id is not pinned",
    )


def _refusal(plan: _Plan, ids: list[int], matches: int, why: str = "", code: str | None = None) -> DeadLetter:
    """The dead letter of a lossy output the counts cannot pin to exactly one candidate."""
    kinds = {gap.where for gap in plan.gaps}
    args = _ARGS in kinds
    lost = "whitespace" if kinds == {_STRIP} else "text around structured tool calls"
    if args:
        lost += " and the model's exact tool-argument JSON (re-serialised)" if kinds - {_ARGS} else ""
        lost = lost if kinds - {_ARGS} else "the model's exact tool-argument JSON (re-serialised)"
    if code is None:
        if args:
            code = TOOL_ARGUMENTS_RESERIALIZED
        elif matches == 0 or len(ids) != plan.expected_count:
            code = WHITESPACE_STRIPPED if kinds == {_STRIP} else TOOL_TEXT_LOST
        else:
            code = WHITESPACE_AMBIGUOUS
    counted = f"{len(ids)} ids rebuilt, usage.completion_tokens says {plan.expected_count}"
    return DeadLetter(
        code,
        f"the provider may have lost {lost} at {len(plan.gaps)} place(s); {counted} (under the provider's "
        f"counting convention): {why or f'{matches} candidate(s) reproduce the count(s): the ids are not pinned'}",
    )


@dataclass(frozen=True)
class Rule:
    """What may accept a lossy answer (docs/fidelity.md, "The rule").

    ``count_restores_edges``: a usage count that singles out one whitespace candidate at an
    open field edge restores it. ``verify_conventions``: an upstream declared lossless is
    watched for answers that show it strips (verify.py). ``SOUND`` is the rule;
    ``COUNT_TRUSTED`` trusts a unique count and a declared convention, and exists so the
    fuzzer (tests/fuzz) can show that rule accepting wrong ids.
    """

    count_restores_edges: bool = False
    verify_conventions: bool = True


SOUND = Rule()
COUNT_TRUSTED = Rule(count_restores_edges=True, verify_conventions=False)


def _prove(
    plans: list[tuple[int, _Plan, list[int]]], profile: ReconstructProfile, rule: Rule = SOUND
) -> dict[int, DeadLetter | list[int]]:
    """For lossy outputs: the restored ids when exactly one candidate fits and no open edge remains."""
    verdicts: dict[int, DeadLetter | list[int]] = {}
    for index, plan, ids in plans:
        if plan.expected_count is None:
            kinds = {gap.where for gap in plan.gaps}
            lost = "whitespace" if kinds == {_STRIP} else "text around structured tool calls"
            verdicts[index] = DeadLetter(
                LOSS_UNVERIFIABLE,
                f"the provider may have lost {lost} at {len(plan.gaps)} place(s) and reported no usage count",
            )
            continue
        assert plan.output_text is not None  # noqa: S101 - reencode plans carry text
        if not rule.count_restores_edges and _open_edges(plan):
            verdicts[index] = _unproven(plan, ids)
            continue
        reasoning_target = None
        if plan.expected_reasoning is not None and plan.think_end_at is not None and profile.think_end_id in ids:
            reasoning_target = plan.expected_reasoning - ids.index(profile.think_end_id or 0)
        outcome = restore(
            plan.output_text,
            plan.gaps,
            specials=profile.special_strings,
            encode_batch=profile.encode_batch,
            base_count=len(ids),
            target=plan.expected_count,
            reasoning_end=plan.think_end_at,
            reasoning_target=reasoning_target,
        )
        if outcome.not_additive:
            why = "the tokenizer does not split at its control tokens, so candidates cannot be counted"
            verdicts[index] = _refusal(plan, ids, 0, why, WHITESPACE_AMBIGUOUS)
        elif outcome.capped:
            why = f"the candidate search passed its cap ({outcome.searched} encodings) without deciding"
            verdicts[index] = _refusal(plan, ids, 0, why, WHITESPACE_AMBIGUOUS)
        elif outcome.arbitrary_room:
            why = (f"{outcome.matches} candidate(s) reproduce the count, and it leaves room for text after the tool "
                   "block, which the parser drops")
            # With argument forms in play, a shorter form plus a dropped tail fits too: the
            # re-serialisation is why the ids are not pinned; without a fitting form, text was lost.
            args = outcome.matches and any(gap.where == _ARGS for gap in plan.gaps)
            verdicts[index] = _refusal(plan, ids, outcome.matches, why,
                                       TOOL_ARGUMENTS_RESERIALIZED if args else TOOL_TEXT_LOST)
        elif outcome.text is None:
            verdicts[index] = _refusal(plan, ids, outcome.matches, "")
        else:
            (restored,) = profile.encode_batch([outcome.text])
            if len(restored) != plan.expected_count:  # the pieces did not add up for this candidate
                why = "the restored text does not encode to the counted length"
                verdicts[index] = _refusal(plan, ids, 1, why, WHITESPACE_AMBIGUOUS)
                continue
            plan.output_text = outcome.text
            verdicts[index] = restored
    return verdicts


def _open_edges(plan: _Plan) -> list[str]:
    """The field edges a strip may have touched that nothing proves kept (the plan's open strip gaps)."""
    return sorted({p or "a field edge" for gap in plan.gaps if gap.where == _STRIP for p in gap.places or {""}})


def _unproven(plan: _Plan, ids: list[int]) -> DeadLetter:
    """The dead letter of an answer with an open edge, whatever its count says (docs/fidelity.md, "The rule").

    The whitespace a strip takes is unbounded (any run, U+00A0, ...) and may merge into the next
    word at no cost in ids, so no candidate that fits the count is proof, and none is searched.
    """
    counted = len(ids) == plan.expected_count
    code = WHITESPACE_AMBIGUOUS if counted else WHITESPACE_STRIPPED
    why = (f"nothing proves {', '.join(_open_edges(plan))} kept (no native ids, logprobs, provider fact or "
           "whitespace shown there), and a count never accepts alone")
    return _refusal(plan, ids, int(counted), why, code)


def _sample(
    plan: _Plan, profile: ReconstructProfile, prompt_ids: list[int], output_ids: list[int]
) -> SampleReconstructed:
    response = plan.response
    return SampleReconstructed(
        dataset=response.dataset,
        sample_id=response.sample_id,
        profile=profile.name,
        response=response,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        loss_mask=[0] * len(prompt_ids) + [1] * len(output_ids),
        method=plan.method,  # type: ignore[arg-type]  # one of the three literals above
        prompt_text=plan.prompt_text,
    )


def reconstruct_batch(
    responses: Sequence[ResponseReceived], profile: ReconstructProfile, convention: Convention, *,
    rule: Rule = SOUND,
) -> list[SampleReconstructed | DeadLetter]:
    """Rebuild many responses of one profile and provider convention, batching the tokenizer (no facts)."""
    return judge(responses, profile, convention, None, rule=rule)[0]


def _close_gaps(plan: _Plan, kept: frozenset[str]) -> None:
    """Move the strip gaps at places the upstream is proven to keep out of the search."""
    closed = [g for g in plan.gaps if g.where in (_STRIP, _ARGS) and g.places and g.places <= kept]
    if closed:
        plan.closed = closed
        plan.gaps = [g for g in plan.gaps if g not in closed]


def _establish(
    plans: Sequence[_Plan | DeadLetter], book: FactBook, convention: Convention, at: float
) -> list[ProviderFactRecorded]:
    """Facts from the whole batch first: each place an answer's field edge shows whitespace at."""
    if not convention.strips_whitespace:
        return []
    changes = []
    for plan in plans:
        if not isinstance(plan, _Plan) or not plan.shown:
            continue
        upstream = upstream_of(plan.response)
        if upstream is None or book.contradicted(upstream) is not None:
            continue
        for place in sorted(plan.shown & set(PLACES)):
            record = book.establish(upstream, place, sample_key(plan.response.dataset, plan.response.sample_id), at)
            if record is not None:
                changes.append(record)
    return changes


def _contradiction(
    plan: _Plan, ids: list[int], profile: ReconstructProfile, verdict: DeadLetter | list[int]
) -> bool:
    """Whether the count shows whitespace missing at a place the facts closed (with them open, a candidate fits)."""
    if not plan.closed or plan.expected_count is None or plan.output_text is None:
        return False
    if isinstance(verdict, DeadLetter) and _open_edges(plan):
        # Refused for its open edges without a search: what the search makes of the count decides.
        verdict = _prove([(0, replace(plan), ids)], profile, COUNT_TRUSTED)[0]
    if isinstance(verdict, DeadLetter):
        if verdict.reason not in (WHITESPACE_STRIPPED, TOOL_TEXT_LOST):
            return False
    elif len(verdict) == plan.expected_count:
        return False
    outcome = restore(plan.output_text, [*plan.gaps, *plan.closed], specials=profile.special_strings,
                      encode_batch=profile.encode_batch, base_count=len(ids), target=plan.expected_count)  # fmt: skip
    return outcome.matches >= 1 and not outcome.arbitrary_room


def _withdrawn_places(plan: _Plan, book: FactBook, upstream: str | None) -> list[ProviderFactRecorded]:
    """The withdrawn facts of ``upstream`` at places this answer may have lost whitespace."""
    if upstream is None or book.contradicted(upstream) is None:
        return []
    places = {p for g in (*plan.gaps, *plan.closed) for p in g.places}
    return [f for f in book.withdrawn(upstream) if f.place in places]



def judge(
    responses: Sequence[ResponseReceived],
    profile: ReconstructProfile,
    convention: Convention,
    book: FactBook | None,
    *,
    at: float = 0.0,
    rule: Rule = SOUND,
    suspects: list[tuple[_Plan, list[int]]] | None = None,
) -> tuple[list[SampleReconstructed | DeadLetter], list[ProviderFactRecorded]]:
    """:func:`reconstruct_with_facts` under one convention; ``suspects`` collects re-encoded answers off their count."""
    plans: list[_Plan | DeadLetter] = [_plan(r, profile, convention) for r in responses]
    changes = _establish(plans, book, convention, at) if book is not None else []
    if book is not None:
        for plan in plans:
            upstream = upstream_of(plan.response) if isinstance(plan, _Plan) else None
            if isinstance(plan, _Plan) and plan.gaps and book.contradicted(upstream) is None:
                _close_gaps(plan, book.kept(upstream))
    live = [p for p in plans if isinstance(p, _Plan)]
    prompt_ids = iter(profile.encode_prompt_batch([p.prompt_text for p in live]))
    output_ids = iter(profile.encode_batch([p.output_text for p in live if p.output_text is not None]))
    out: list[SampleReconstructed | DeadLetter] = []
    lossy: list[tuple[int, _Plan, list[int]]] = []
    for plan in plans:
        if isinstance(plan, DeadLetter):
            out.append(plan)
            continue
        prompt = next(prompt_ids)
        ids = next(output_ids) if plan.output_text is not None else plan.output_ids or []
        if not ids:
            out.append(DeadLetter(EMPTY_RESPONSE, "the rebuilt output has no tokens"))
            continue
        if plan.output_text is not None:
            bad = _check_output_ids(plan, ids, profile)
            if bad is None and plan.response.finish_reason == "length":
                bad = _check_truncated_tail(plan, ids, profile)
            if bad is not None:
                out.append(bad)
                continue
            if suspects is not None and _off_count(plan, ids, convention):
                suspects.append((plan, ids))
            if plan.gaps or plan.closed:
                lossy.append((len(out), plan, ids))
        out.append(_sample(plan, profile, prompt, ids))
    for index, plan, ids in lossy:  # in batch order: a contradiction bears on the answers after it
        upstream = upstream_of(plan.response)
        key = sample_key(plan.response.dataset, plan.response.sample_id)
        withdrawn = _withdrawn_places(plan, book, upstream) if book is not None else []
        if withdrawn:
            out[index] = _contradicted(withdrawn, key)
            continue
        verdict = _prove([(index, plan, ids)], profile, rule)[index] if plan.gaps else ids
        if book is not None and upstream is not None and _contradiction(plan, ids, profile, verdict):
            places = sorted({p for g in plan.closed for p in g.places})
            why = f"{key}'s usage count shows whitespace missing at {', '.join(places)}"
            withdrawals = [book.withdraw(upstream, p, key, why, at) for p in places]
            changes += withdrawals
            out[index] = _contradicted(withdrawals, key)
            continue
        if isinstance(verdict, DeadLetter):
            out[index] = verdict
            continue
        previous = out[index]
        assert isinstance(previous, SampleReconstructed)  # noqa: S101 - lossy entries are samples
        out[index] = _sample(plan, profile, list(previous.prompt_ids), verdict)
    return out, changes


def _off_count(plan: _Plan, ids: list[int], convention: Convention) -> bool:
    """A re-encoded answer that stopped by itself and whose ids miss its usage count."""
    count = plan.response.usage.completion_tokens
    return (plan.method == "reencode" and plan.response.finish_reason != "length" and count is not None
            and len(ids) != count - convention.completion_offset)  # fmt: skip


def _contradicted(facts: Sequence[ProviderFactRecorded], key: str) -> DeadLetter:
    """The dead letter of an answer whose upstream's fact (at a place it may have lost text) was contradicted."""
    named = "; ".join(
        f"fact {fact_key(f.upstream, f.place)} (whitespace kept, established by {f.evidence}) "
        f"contradicted by {f.contradicted_by}" for f in facts
    )
    return DeadLetter(
        FACT_CONTRADICTED,
        f"{key}: {named}: the upstream shows both habits under one name, so its facts no longer stand; "
        "replay after pinning one upstream",
    )


def reconstruct(
    response: ResponseReceived, profile: ReconstructProfile, convention: Convention, *, rule: Rule = SOUND
) -> SampleReconstructed | DeadLetter:
    """Rebuild one response: prompt ids, output ids, loss mask, or a dead-letter verdict."""
    return reconstruct_batch([response], profile, convention, rule=rule)[0]
