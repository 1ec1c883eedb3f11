"""Import-time stand-ins for what vLLM's and SGLang's parser modules import but never use (torch, triton, ...).

The engines' reasoning parsers, tool parsers and serving helpers are plain string code, but their packages
import torch, triton, zmq, fastapi and friends at module level. A stand-in module answers every attribute
with a permissive class (usable as a base class, a decorator, a type annotation, a pydantic field type), so
those imports succeed. Nothing here may run while an answer is parsed: every call of a stand-in is counted
(``CALLS``) once ``arm()`` has been called, and the engine tests require the count to stay 0 — a parser that
touched a tensor, a socket or an image would show there instead of silently getting a fake.

Written here because no library fits: ``unittest.mock.MagicMock`` cannot be subclassed with ABCs or used as a
pydantic field type, and a stub package on disk would shadow a real install.
"""

from __future__ import annotations

import abc
import importlib.abc
import importlib.machinery
import inspect
import sys
import types
from typing import Any

# Top-level packages (or exact submodules) that are replaced. Everything else the parsers import is real
# (deploy/engines/requirements.txt, the project's venv).
STUBBED: tuple[str, ...] = (
    "torch", "triton", "compressed_tensors", "xgrammar", "openai_harmony", "cbor2", "psutil", "zmq", "fastapi",
    "starlette", "PIL", "pybase64", "cachetools", "cloudpickle", "uvloop", "cpuinfo", "ijson", "mistral_common",
    "IPython",
    # sglang/__init__ imports transformers' modeling_llama for a compat patch; with torch stood in it cannot.
    "transformers.models.llama.modeling_llama",
)  # fmt: skip
# Device probes answer "absent" (sglang asks hasattr(torch, "npu") and raises when the device is missing).
_ABSENT = frozenset({"npu", "xpu", "hpu", "musa", "mlu"})

CALLS: list[str] = []
_armed = False


def arm() -> None:
    """From now on every call of a stand-in is recorded in ``CALLS``."""
    global _armed
    _armed = True


def _called(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if len(args) == 1 and not kwargs and (inspect.isfunction(args[0]) or inspect.isclass(args[0])):
        return args[0]  # used as a decorator: keep the decorated object
    if _armed:
        caller = sys._getframe(2)
        CALLS.append(f"{name} from {caller.f_code.co_filename}:{caller.f_lineno}")
    return None


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


class _StubMeta(abc.ABCMeta):
    """Metaclass of the stand-in classes: attribute access, calls, unions and subscripts all work."""

    def __getattr__(cls, name: str) -> Any:
        if _is_dunder(name) or name in _ABSENT:
            raise AttributeError(name)
        return _new(f"{cls.__name__}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        kept = _called(cls.__name__, args, kwargs)
        return kept if kept is not None else super().__call__()

    def __or__(cls, other: Any) -> Any:
        return cls

    __ror__ = __or__

    def __getitem__(cls, item: Any) -> Any:
        return cls


class _Stub(metaclass=_StubMeta):
    """Base of every stand-in class; its instances are as permissive as the classes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        if _is_dunder(name) or name in _ABSENT:
            raise AttributeError(name)
        return _new(name)()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kept = _called(type(self).__name__ + "()", args, kwargs)
        return kept if kept is not None else _Stub()

    def __getitem__(self, key: Any) -> Any:
        return _Stub()

    def __int__(self) -> int:
        return 0

    __index__ = __int__

    def __float__(self) -> float:
        return 0.0

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False

    __hash__ = object.__hash__

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.any_schema()


def _operator(self: Any, *args: Any) -> Any:
    return _Stub()


# Empty-container behaviour, for the classes (via the metaclass) and their instances alike.
_EMPTY = {
    "__setitem__": lambda self, key, value: None,
    "__iter__": lambda self: iter(()),
    "__contains__": lambda self, item: False,
    "__len__": lambda self: 0,
    "__bool__": lambda self: False,
}
for _name, _method in _EMPTY.items():
    setattr(_Stub, _name, _method)
    setattr(_StubMeta, _name, _method)


for _op in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv", "mod", "pow",
            "and", "rand", "xor", "lt", "le", "gt", "ge", "neg", "matmul", "rmatmul", "or", "ror"):  # fmt: skip
    setattr(_Stub, f"__{_op}__", _operator)
    if _op not in ("or", "ror"):
        setattr(_StubMeta, f"__{_op}__", _operator)


def _new(name: str) -> type:
    return _StubMeta(name, (_Stub,), {})


class _StubModule(types.ModuleType):
    """A stand-in module: every attribute is a stand-in class."""

    def __getattr__(self, name: str) -> Any:
        if _is_dunder(name) or name in _ABSENT:
            raise AttributeError(name)
        value = _new(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a stand-in module for every name under ``STUBBED``."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if any(fullname == root or fullname.startswith(root + ".") for root in STUBBED):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "2.9.0"  # a version string for the version checks done at import time
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> None:
    """Put the stand-ins first on ``sys.meta_path`` (call before importing vllm / sglang; once per process)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
