"""Cases: each conversation's prompt rendered with the official template, and its true prompt and output ids."""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass

from tests.conformance.truth_conversations import Conversation, conversations
from tests.conformance.truth_formats import _SPECS, _template_text
from tests.conformance.truth_reference import render_template
from tests.conformance.truth_tokenizers import truth_tokenizer

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
