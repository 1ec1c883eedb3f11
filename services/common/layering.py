"""How a dataset's settings inherit from ``[defaults]``, and where each effective value came from.

``[defaults]`` (and each of its sub-tables, ``[defaults.audit]``) is the base of every
dataset: a ``[datasets.NAME]`` section overrides only the keys it names, table by table, and
a key set in neither keeps its built-in default. Sources are layered first (constructor
overrides over the environment over the TOML file), then the dataset over the defaults: a
dataset's own key in the file wins over a ``DRAFTSTREAM_DEFAULTS__...`` variable.

Pure functions over plain data (no environment, no files): ``services.common.config`` calls
them with the layers it read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal

from pydantic import BaseModel

Origin = Literal["dataset", "defaults", "built-in", "env", "override", "provider"]

# The layers of raw data a value can come from, highest first, with the origin name a value
# found there gets (the file's layer is named by the section that sets it).
LAYER_NAMES = ("override", "env", "file")


def raw(value: Any) -> Any:
    """A section as plain data: a model built in code counts only the fields it was given."""
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True)
    return value


def _model_field(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The model class of ``model.key`` when that field is itself a table (a sub-model), else None."""
    annotation = model.model_fields[key].annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def inherit(base: Any, over: Any, model: type[BaseModel]) -> Any:
    """``over`` with every key of ``base`` it does not set, sub-tables merged key by key.

    Only keys ``model`` knows are taken from ``base``: an unknown key is reported once, in
    its own section, not again in every dataset that inherits from it.
    """
    base, over = raw(base), raw(over)
    if not isinstance(base, Mapping) or not isinstance(over, Mapping):
        return over
    merged = dict(over)
    for key, value in base.items():
        if key not in model.model_fields:
            continue
        sub = _model_field(model, key)
        if key not in merged:
            merged[key] = raw(value)
        elif sub is not None:
            merged[key] = inherit(value, merged[key], sub)
    return merged


def _has(layer: Any, path: tuple[str, ...]) -> bool:
    for part in path:
        layer = raw(layer)
        if not isinstance(layer, Mapping) or part not in layer:
            return False
        layer = layer[part]
    return True


def leaf_keys(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every settable key of ``model`` as a path, sub-tables expanded (``("audit", "usage_offset")``)."""
    for key in model.model_fields:
        sub = _model_field(model, key)
        if sub is None:
            yield (*prefix, key)
        else:
            yield from leaf_keys(sub, (*prefix, key))


def origin_of(dataset: str, path: tuple[str, ...], layers: Mapping[str, Any]) -> Origin:
    """Where dataset ``dataset``'s value at ``path`` came from.

    Args:
        dataset: the dataset's name.
        path: the key, sub-tables included (``("audit", "require_reasoning")``).
        layers: raw settings by layer name (see :data:`LAYER_NAMES`), each shaped like the file.
    """
    for section, file_origin in ((("datasets", dataset), "dataset"), (("defaults",), "defaults")):
        for name in LAYER_NAMES:
            if _has(layers.get(name), (*section, *path)):
                return file_origin if name == "file" else name  # type: ignore[return-value]
    return "built-in"


__all__ = ["LAYER_NAMES", "Origin", "inherit", "leaf_keys", "origin_of", "raw"]
