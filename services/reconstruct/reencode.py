"""Planning a chat response's output ids: native, from logprobs, or re-encoded from its text.

A re-encoding plan lays the answer out as the model wrote it (think block, content, the
native text of structured tool calls, end-of-turn) and marks the places where the provider's
convention says text may be missing; ``proof`` refuses the answer where nothing proves them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from schemas import (
    LogprobToken,
    ResponseReceived,
    ToolCall,
)
from services.common.records import DeadLetter
from services.profiles import GAP_ARGUMENTS, ProfileError, ProfileLike
from services.profiles.conventions import Convention
from services.profiles.tooltext import server_tools as server_tools  # re-exported: reconstruct.core
from services.reconstruct.plan import (
    EMPTY_RESPONSE,
    INVALID_TOOL_ARGUMENTS,
    LOGPROBS_UNMAPPABLE,
    LOSS_UNVERIFIABLE,
    SPECIAL_TOKEN_IN_TEXT,
    TEMPLATE_ERROR,
    THINK_LAYOUT_AMBIGUOUS,
    UNEXPECTED_REASONING,
    WHERE_ARGS,
    WHERE_STRIP,
    WHERE_TOOL,
    Layout,
    output_layout,
)
from services.reconstruct.plan import Plan as _Plan
from services.reconstruct.plan import check_ids as _check_ids
from services.reconstruct.restore import ARBITRARY, CHOICE, WHITESPACE, Slot

_TOKEN_ID_FORM = re.compile(r"^token_id:(\d+)$")


def _logprob_id(token: LogprobToken, profile: ProfileLike) -> int | None:
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


def _ids_from_logprobs(response: ResponseReceived, profile: ProfileLike) -> list[int] | DeadLetter:
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


def _check_text(response: ResponseReceived, profile: ProfileLike) -> DeadLetter | None:
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
        self.gaps.append(Slot(self.length, self.length + len(text), CHOICE, alternatives, where=WHERE_ARGS))
        self.add(text)

    def text(self) -> str:
        return "".join(self.parts)


def _edges(text: str) -> tuple[bool, bool]:
    """Whether ``text`` begins / ends with whitespace (what ``str.strip()`` would remove)."""
    return bool(text) and text[0].isspace(), bool(text) and text[-1].isspace()


def _reencode_plan(
    response: ResponseReceived, profile: ProfileLike, convention: Convention, prompt_text: str
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


def _think_start_in_prompt(profile: ProfileLike) -> bool:
    """Whether the profile's think-start lives in the generation prompt (R1, Qwen3-2507, V3.1)."""
    return getattr(profile, "think_location", None) == "prompt"


def _unopened_block_plan(
    response: ResponseReceived, profile: ProfileLike, convention: Convention, prompt_text: str, *, closed: bool
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
    profile: ProfileLike,
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

    # The tool parser's own strip of the content before the block (SGLang's detectors), whatever the
    # reasoning parser kept: both ends of that content.
    detector_strips = bool(calls) and profile.tool_format in convention.strips_before_tool
    declared_places = {"content_start", "text_start", "before_tool"} if detector_strips else set()
    # The reasoning parser's own .rstrip() of the reasoning (vLLM's deepseek_v4 and kimi_k2), wherever it ends.
    if profile.tool_format in convention.strips_reasoning_end:
        declared_places |= {"reasoning_end", "reasoning_cut", "answer_end"}

    def edge(units: set[str], place: str, shows: bool) -> None:
        if shows:
            shown.add(place)
        elif not open_units.isdisjoint(units) or place in declared_places:
            out.gap(WHERE_STRIP, place=place)

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
        # The slots below are what the count-trusting rule searched (proof.TOOLS_COUNTED, for the fuzzer);
        # under the rule the places alone decide: the answer is refused naming them (proof.prove).
        choices = iter(_argument_choices(profile.tool_format, calls) if reserialized else [])
        wanted = next(choices, None)
        for piece in pieces:
            if not isinstance(piece, str):
                if piece[0] != GAP_ARGUMENTS or profile.tool_format in convention.trimmed_argument_formats:
                    out.gap(WHERE_TOOL)
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
        out.gap(WHERE_TOOL, ARBITRARY)  # tool parsers drop whatever followed the block
    if layout.end_of_turn:
        out.add(profile.end_of_turn)
    plan = _Plan(response, prompt_text, out.text(), None, "reencode", layout, out.gaps)
    plan.think_end_at = think_end_at
    plan.shown = frozenset(shown)
    if calls:
        plan.tool_places = _tool_places(profile, convention, response, detector_strips, reserialized)
    return plan


def _tool_places(profile: ProfileLike, convention: Convention, response: ResponseReceived, detector_strips: bool,
                 reserialized: bool) -> tuple[str, ...]:  # fmt: skip
    """The places (plan.TOOL_PLACES) a tool parser may have changed in this answer, in text order."""
    fmt = profile.tool_format
    places = []
    if detector_strips or not response.content.strip():
        places.append("before_tool")
    if reserialized and fmt == "qwen":  # hermes / Qwen25Detector json.loads the whole {"name", "arguments"}
        places.append("tool_wrapper")
    if reserialized:
        places.append("tool_arguments")
    if fmt in convention.trimmed_argument_formats:
        places.append("around_arguments")
    if len(response.tool_calls) > 1:
        places.append("between_calls")
    places.append("after_block")
    return tuple(places)


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
    """Per call: the text our native rendering holds and the canonical texts the model may have written there.

    Only the count-trusting rule (``proof.TOOLS_COUNTED``, the fuzzer's view of the old behaviour)
    searches these; they are not every spelling (``5e0``, ``1e3``, key order), which is why a count
    among them proves nothing. A re-serialising parser kept only the parsed value. Qwen3's hermes
    parsers parse the whole ``{"name": ..., "arguments": ...}`` object, so its separators are candidates too;
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


def prompt_ids_of(
    responses: Sequence[ResponseReceived], profile: ProfileLike, convention: Convention
) -> list[list[int] | None]:
    """The prompt ids each response's request was rendered to (``None`` where the prompt cannot be rendered).

    Independent of the output's verdict: an answer refused for its output still says, through
    ``usage.prompt_tokens``, whether the profile renders and encodes prompts as the model does.
    """
    plans = [plan_chat(r, profile, convention) for r in responses]
    ids = iter(profile.encode_prompt_batch([p.prompt_text for p in plans if isinstance(p, _Plan)]))
    return [next(ids) if isinstance(p, _Plan) else None for p in plans]


def plan_chat(response: ResponseReceived, profile: ProfileLike, convention: Convention) -> _Plan | DeadLetter:
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
