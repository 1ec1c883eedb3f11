"""The prompt an answer follows: its text under the profile or a chat template, and its think block.

A chat template given to the simulator is rendered the way Hugging Face does (jinja2's
sandbox with ``trim_blocks``/``lstrip_blocks``), without a clock unless one is handed in.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from schemas import Message
from services.profiles import ProfileLike
from services.simulator.request import ChatRequest, RequestError

# Where the think block of an answer opens: the model writes the think-start itself
# ("model"), the prompt already opened it ("prompt"), or the answer has none ("none":
# the model does not think, or the prompt closed the block to switch thinking off).
ThinkBlock = Literal["model", "prompt", "none"]


def prompt_text_fallback(request: ChatRequest) -> str:
    """A plain rendering of the prompt, for token counting when a profile has no chat template."""
    return "".join(f"{m.get('role', '')}: {m.get('content', '')}\n" for m in request.messages)


def request_messages(request: ChatRequest) -> list[Message]:
    """The request's messages as schema Messages (what the profile's template renders)."""
    out = []
    for m in request.messages:
        try:
            out.append(msgspec.convert(m, Message))
        except msgspec.ValidationError:  # an odd role or field: keep what a template needs
            role = m.get("role")
            if role in ("system", "user", "assistant", "tool"):
                out.append(Message(role=role, content=m.get("content") or ""))
    return out


def profile_prompt_text(profile: ProfileLike, request: ChatRequest) -> str:
    """The prompt rendered by the profile's own template, else as plain text (no template)."""
    try:
        return profile.render_prompt(request_messages(request), request.tools, reasoning=True)
    except Exception:  # no chat template, or an unusual prompt: count plain text instead
        return prompt_text_fallback(request)


def _tojson(
    value: Any, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False
) -> str:
    """``tojson`` as Hugging Face gives it to chat templates: no HTML escaping, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise RequestError(f"chat template error: {message}")


def _no_clock(fmt: str) -> str:
    raise RequestError("chat template error: strftime_now is not available (no clock given)")


def compile_chat_template(source: str, *, strftime_now: Callable[[str], str] | None = None) -> Any:
    """A chat template compiled the way Hugging Face renders one (``apply_chat_template``).

    jinja2's immutable sandbox with ``trim_blocks``/``lstrip_blocks`` and loop controls,
    ``tojson`` without ASCII escaping, ``raise_exception`` and ``strftime_now``: the same
    environment transformers builds, so an official template file renders here as a server
    renders it (CONVENTIONS.md: render templates the way Hugging Face does). The core has no
    clock: the shell passes ``strftime_now`` for templates that print today's date.
    """
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = strftime_now or _no_clock
    return env.from_string(source)


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's messages as vLLM hands them to a chat template.

    Plain dicts as the request carried them, with vLLM's one change (``_postprocess_messages``
    in ``vllm/entrypoints/chat_utils``): an assistant turn's tool-call ``arguments`` become a
    JSON object (not JSON, or not an object: ``{}``), and an empty ``tool_calls`` list is dropped.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not isinstance(calls, list):
            out.append(message)
            continue
        copy = {k: v for k, v in message.items() if k != "tool_calls"}
        if calls:
            copy["tool_calls"] = [_template_tool_call(call) for call in calls]
        out.append(copy)
    return out


def _template_tool_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    parsed: Any = arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError:
            parsed = {}
    if not isinstance(parsed, dict):
        parsed = {}
    return {**call, "function": {**function, "arguments": parsed}}


def render_chat_template(template: Any, request: ChatRequest, *, bos_token: str, eos_token: str) -> str:
    """The prompt text a server renders from ``template`` for this request.

    The messages are the dicts the request carried (tool-call arguments as objects, see
    :func:`_template_messages`), the generation prompt is on and the request's
    ``chat_template_kwargs`` are passed through, as vLLM does. Raises :class:`RequestError`
    (400) when the template refuses the prompt.
    """
    kwargs = {
        k: v
        for k, v in (request.chat_template_kwargs or {}).items()
        if k not in ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
    }
    try:
        rendered: str = template.render(
            messages=_template_messages(request.messages),
            tools=request.tools,
            add_generation_prompt=True,
            bos_token=bos_token,
            eos_token=eos_token,
            **kwargs,
        )
    except RequestError:
        raise
    except Exception as exc:  # jinja2's errors: the request's fault, as a server reports it
        raise RequestError(f"chat template error: {type(exc).__name__}: {exc}") from None
    return rendered


def think_block_of(profile: ProfileLike, prompt_text: str) -> ThinkBlock:
    """Where the answer's think block opens, given the rendered prompt it follows."""
    state = profile.prompt_state(prompt_text)
    if state == "open":
        return "prompt"
    if state == "none" and profile.thinks():
        return "model"
    return "none"
