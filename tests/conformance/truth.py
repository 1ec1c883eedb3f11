"""Independent ground truth for token-exact reconstruction: conversations, model output, server replies, ids.

This is a second, separate source of truth that draftstream's reconstruction is checked against. It and the
``truth_*`` modules it gathers never import ``services/`` or ``schemas/``. Every fact comes from outside the
project, and each module says where its facts come from:

* ``truth_reference``: the shared reference dir, the models and servers covered, chat-template rendering;
* ``truth_tokenizers``: ids from real tokenizer files;
* ``truth_formats``: how each model writes reasoning and tool calls;
* ``truth_conversations``: what we send and what the model generates now;
* ``truth_cases``: the rendered prompt and the true ids of each conversation;
* ``truth_servers``: what a given server returns (vLLM, SGLang, OpenRouter-like).

Imports point one way: reference, tokenizers, formats, conversations, cases, servers; each imports only
modules before it.

Pipeline per case: ``conversations()`` plans what we send and what the model generates now,
``build_cases()`` renders the prompt and computes the true ids, ``emulate()`` turns the raw generation into
what a given server returns.
"""

from __future__ import annotations

from tests.conformance.truth_cases import Case, build_cases, render_prompt, server_messages, with_server_tools
from tests.conformance.truth_conversations import _TOOLS, _UNI, _WORDS, _WS, Conversation, Generation, conversations
from tests.conformance.truth_formats import _SPECS, DS_BOS, DS_EOS, ToolCall, _assemble, _template_text
from tests.conformance.truth_reference import (
    MODELS,
    NOLP_UPSTREAM,
    REPO_ROOT,
    SERVERS,
    reference_dir,
    render_template,
    template_source,
)
from tests.conformance.truth_servers import _utf8_prefix, emulate, reassemble
from tests.conformance.truth_tokenizers import (
    TruthTokenizer,
    _HFTruth,
    _package_dir,
    build_user_addedtok_folder,
    deepseek_v3_tokenizer_path,
    truth_tokenizer,
    user_addedtok_folder,
)

__all__ = [
    "DS_BOS",
    "DS_EOS",
    "MODELS",
    "NOLP_UPSTREAM",
    "REPO_ROOT",
    "SERVERS",
    "_SPECS",
    "_TOOLS",
    "_UNI",
    "_WORDS",
    "_WS",
    "Case",
    "Conversation",
    "Generation",
    "ToolCall",
    "TruthTokenizer",
    "_HFTruth",
    "_assemble",
    "_package_dir",
    "_template_text",
    "_utf8_prefix",
    "build_cases",
    "build_user_addedtok_folder",
    "conversations",
    "deepseek_v3_tokenizer_path",
    "emulate",
    "reassemble",
    "reference_dir",
    "render_prompt",
    "render_template",
    "server_messages",
    "template_source",
    "truth_tokenizer",
    "user_addedtok_folder",
    "with_server_tools",
]
