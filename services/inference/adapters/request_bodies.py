"""The request bodies a provider sends: chat completions, and text completions of a rendered prompt.

Pure functions of the prompt, the dataset's settings and the provider's options.
"""

from __future__ import annotations

from typing import Any

from schemas import PromptPublished
from services.common.config import DatasetSettings
from services.inference.tool_route import renders_tools


def chat_request_body(
    prompt: PromptPublished,
    dataset: DatasetSettings,
    *,
    model: str,
    max_tokens: int,
    extra_body: dict[str, Any],
    logprobs: bool,
    native_ids: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    messages: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The chat-completions request body; ``extra_body`` (routing, reasoning...) is merged last.

    ``template_kwargs`` (the profile's thinking switch and kwargs) go out as
    ``chat_template_kwargs``, so the server renders the prompt the way reconstruction does.
    The row's tools reach the model once: ``messages`` with the tools written into the system
    text (raw tool text, services/inference/tool_route.py) replace the prompt's own, else the
    tools the template renders go as the ``tools`` parameter.
    """
    body: dict[str, Any] = {
        "model": model,
        "messages": prompt.wire if messages is None else messages,
        "max_tokens": max_tokens,
    }
    if messages is None and renders_tools(prompt):
        body["tools"] = prompt.tools
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    if logprobs:
        body["logprobs"] = True
    if native_ids:
        body["return_token_ids"] = True
    body.update(extra_body)
    return body


def completions_request_body(
    prompt_text: str,
    *,
    model: str,
    max_tokens: int,
    extra_body: dict[str, Any],
    vllm_style: bool,
    native_ids: bool = False,
) -> dict[str, Any]:
    """The text-completions request body for a prompt already rendered by the profile's template.

    ``skip_special_tokens: false`` keeps the think and tool tokens in the text (vLLM, SGLang
    and the simulator take it; OpenRouter passes it on where an upstream does). A vLLM-style
    server (``vllm_style``) also gets ``add_special_tokens: false``: the rendered template
    already carries the BOS where the model has one, and the server's tokenizer would add a
    second. ``extra_body`` is merged last.
    """
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt_text,
        "max_tokens": max_tokens,
        "skip_special_tokens": False,
    }
    if vllm_style:
        body["add_special_tokens"] = False
    if native_ids:
        body["return_token_ids"] = True
    body.update(extra_body)
    return body


COMPLETIONS_PATH = "/completions"
