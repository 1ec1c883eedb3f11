"""By which route a row's tools reach the model, and whether the calls that come back can be proven.

A row's tools are part of its prompt whatever the mode, and reach the model exactly once:

- ``own_text``: the row's own system text carries the functions (Glaive style, flagged at
  publish): nothing is added, no ``tools`` parameter;
- ``rendered``: completions mode (and the sglang provider's ``input_ids``): the prompt is rendered
  by us with the model's template, tools in its native format; the answer is the raw text;
- ``prompt_text``: chat mode, ``tool_route = "prompt"``: the tools are written into the system
  text as the template writes them (:mod:`services.profiles.tooltext`), with no ``tools``
  parameter, so no tool parser runs (raw tool text);
- ``parameter``: chat mode, ``tool_route = "parameter"``, or a template that cannot say its tool
  block in system text: the server's ``tools`` parameter and its tool parser. The parser keeps
  the arguments, not their spelling or the whitespace around the block: those calls cannot be
  proven and are refused.

The two raw routes of a chat server (``own_text``, ``prompt_text``: no ``tools`` parameter) are
provable where the server leaves the block in the content. A convention says where it does not
(``Convention.drops_block_without_tools``: vLLM 0.33's deepseek_v4 pair takes a DSML block out
even with no ``tools`` parameter): for that profile there, the lines say the calls cannot be proven
through this server.
"""

from __future__ import annotations

from typing import Any, Literal

from schemas import Message, PromptPublished
from services.common.config import DatasetSettings, Settings
from services.profiles.conventions import convention_for
from services.profiles.tooltext import Render, tools_in_system_text

Route = Literal["none", "own_text", "rendered", "prompt_text", "parameter"]

SOUND: frozenset[Route] = frozenset({"none", "own_text", "rendered", "prompt_text"})
"""The routes whose tool calls come back as the model wrote them (provable), where the server keeps raw
tool text (:func:`dropped_format`)."""
RAW: frozenset[Route] = frozenset({"own_text", "prompt_text"})
"""The routes that send no ``tools`` parameter to a chat server, relying on it to leave the block in the content."""

_CANNOT = 'the calls cannot be proven, expect them refused, use mode = "completions"'
_CANNOT_HERE = 'the calls cannot be proven through this server, expect them refused, use mode = "completions"'
PARSED_ADVICE = f'{_CANNOT} (or raw tool text: tool_route = "prompt")'

_RAW_WHERE: dict[Route, str] = {
    "own_text": "in the row's own system text (Glaive style), no tools parameter",
    "prompt_text": "written into the system text as the template writes them, no tools parameter",
}
_SAYS: dict[Route, str] = {
    "none": "no tools",
    "own_text": f"{_RAW_WHERE['own_text']}: provable",
    "rendered": "rendered by us with the model's template (raw text back): provable",
    "prompt_text": f"{_RAW_WHERE['prompt_text']} (raw tool text back): provable",
    "parameter": f"the server's tools parameter and its tool parser: {PARSED_ADVICE}",
}

# A tool and two prompts (with and without a system message) to ask a template whether it can
# say its tool block in system text, before any row is read.
_PROBE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
_PROBE_PROMPTS = (
    [Message(role="user", content="Weather in Paris?")],
    [Message(role="system", content="You are terse."), Message(role="user", content="Weather in Paris?")],
)


def renders_tools(prompt: PromptPublished) -> bool:
    """Whether the template renders the row's tools (it offers some, and its own text does not carry them)."""
    return bool(prompt.tools) and not prompt.tools_in_text


def template_route(settings: Settings, dataset: DatasetSettings) -> bool:
    """Whether the prompt is rendered by us (completions mode, or the sglang provider's ``input_ids``)."""
    return settings.mode_of(dataset) == "completions" or settings.provider.kind == "sglang"


def dataset_route(settings: Settings, dataset: DatasetSettings, *, in_text: bool) -> Route:
    """The route of a row whose tools the template renders; ``in_text``: the profile can say them in system text."""
    if template_route(settings, dataset):
        return "rendered"
    if dataset.tool_route == "prompt" and in_text:
        return "prompt_text"
    return "parameter"


def prompt_route(settings: Settings, dataset: DatasetSettings, prompt: PromptPublished) -> Route:
    """The route of one prompt's tools (``prompt_text`` where the dataset asks for it; the provider renders)."""
    if not prompt.tools:
        return "none"
    if prompt.tools_in_text:
        return "own_text"
    return dataset_route(settings, dataset, in_text=True)


def dropped_format(settings: Settings, dataset: DatasetSettings) -> str | None:
    """The profile's tool format where this server's parsers take its block out of the content even with no
    ``tools`` parameter (its convention's ``drops_block_without_tools``); None where raw tool text comes back.

    Said of a chat server only: a prompt rendered by us (completions mode, sglang's ``input_ids``) is
    answered as raw text, whatever the parsers would do.
    """
    from services.profiles import ProfileError, profile_spec

    if template_route(settings, dataset):
        return None
    try:
        convention = convention_for(settings.provider.kind, settings.provider.convention)
        fmt = profile_spec(dataset.profile, settings).tool_format
    except (ProfileError, ValueError):  # an unknown profile or convention is refused where it is loaded
        return None
    return fmt if fmt in convention.drops_block_without_tools else None


def provable(settings: Settings, dataset: DatasetSettings, route: Route) -> bool:
    """Whether the calls that come back by ``route`` can be proven through this server."""
    return route in SOUND and not (route in RAW and dropped_format(settings, dataset))


def _says_here(settings: Settings, dataset: DatasetSettings, route: Route) -> str:
    """What ``route`` means through this server: a raw route whose block the server drops says why not provable."""
    fmt = dropped_format(settings, dataset) if route in RAW else None
    if fmt is None:
        return route_says(route)
    convention = convention_for(settings.provider.kind, settings.provider.convention)
    return (f"{_RAW_WHERE[route]}: {_CANNOT_HERE} (profile {dataset.profile}: {convention.name} servers' parsers "
            f"take a {fmt} tool block out of the content even without a tools parameter)")  # fmt: skip


def can_write_in_text(render: Render) -> bool:
    """Whether a template says its tool block in system text (with and without a system message)."""
    try:
        return all(tools_in_system_text(render, m, _PROBE_TOOLS) is not None for m in _PROBE_PROMPTS)
    except Exception:  # noqa: BLE001 - a template that fails on the probe prompt cannot be relied on
        return False


def route_says(route: Route) -> str:
    """What a route means, in the words the pre-flight, ``estimate`` and ``probe`` print."""
    return _SAYS[route]


def route_line(settings: Settings, name: str, *, in_text: bool, ahead: bool = False) -> str:
    """``tools of dataset D: <route>`` for rows with a ``tools`` field, naming an old ``send_tools``.

    ``ahead``: said before any row is read (the worker's pre-flight), so for the rows that offer tools.
    """
    dataset = settings.dataset(name)
    route = dataset_route(settings, dataset, in_text=in_text)
    said = _says_here(settings, dataset, route)
    if route == "parameter" and not in_text:
        said = said.replace(PARSED_ADVICE, f"{_CANNOT} (profile {dataset.profile} cannot write its tool block "
                                           "in system text: no raw tool text)")  # fmt: skip
    if route == "parameter" and (settings.provider.request_logprobs or settings.provider.kind == "openai"):
        asked = "logprobs" if settings.provider.request_logprobs else "token ids (return_token_ids)"
        said += f"; provable only where the answers carry the {asked} asked for"
    if dataset.send_tools is True and dataset.tool_route == "parameter":
        said += ' [send_tools = true: read as tool_route = "parameter"]'
    elif dataset.send_tools is True:
        said += " [send_tools = true is not read where tool_route is written]"
    elif dataset.send_tools is False:
        said += " [send_tools = false no longer leaves a row's tools out]"
    where = ", where a row offers them" if ahead else ""
    return f"tools of dataset {name or '(defaults)'}{where}: {said}"


def rows_lines(settings: Settings, name: str, *, in_text: bool, fielded: int, own_text: int) -> list[tuple[str, bool]]:
    """The route lines of a dataset's rows (a tools field; tools in their own text), each with its soundness."""
    lines: list[tuple[str, bool]] = []
    dataset = settings.dataset(name)
    if fielded:
        route = dataset_route(settings, dataset, in_text=in_text)
        lines.append((f"{route_line(settings, name, in_text=in_text)} ({fielded:,} request(s) with a tools field)",
                      provable(settings, dataset, route)))  # fmt: skip
    if own_text:
        lines.append((f"tools of dataset {name}: {_says_here(settings, dataset, 'own_text')} ({own_text:,} request(s))",
                      provable(settings, dataset, "own_text")))  # fmt: skip
    return lines


__all__ = [
    "PARSED_ADVICE",
    "RAW",
    "SOUND",
    "Route",
    "can_write_in_text",
    "dataset_route",
    "dropped_format",
    "prompt_route",
    "provable",
    "renders_tools",
    "route_line",
    "route_says",
    "rows_lines",
    "template_route",
]
