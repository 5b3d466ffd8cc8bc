"""Component state: batch-row operations and (de)serialisation for ``cache.state``.

A component's state (from its ``init_state`` hook) is an attrs instance whose fields are
annotated arrays, scalars or nested attrs classes. Fields declared with :func:`rows_field` hold
one entry per batch row along axis 0; the cache indexes and concatenates them when rows are
extracted, filtered or merged. Fields declared with :func:`derived_field` hold what a component
worked out from the stored slots (e.g. key norms): they are neither saved nor carried through
batch edits (reset to None), and the component recomputes them. Everything else is shared by
all rows. cattrs turns a state into JSON-able metadata plus a list of arrays (the arrays go
into ``cache.state``), and back.
"""

from __future__ import annotations

import contextvars
import copy
import importlib
from typing import Any, Callable, Optional

import attrs
import cattrs
import mlx.core as mx

from .errors import ConfigError

__all__ = ["rows_field", "derived_field", "take_rows", "stack_rows", "flatten_state", "restore_state", "snapshot"]

_ROWS = "kvcompress_rows"
_DERIVED = "kvcompress_derived"


def rows_field(fill: float = 0, **kwargs) -> Any:
    """An attrs field holding one entry per batch row along axis 0 (default ``None``).

    When rows are merged and some have no value yet, theirs is ``fill`` (e.g. 0 for a counter,
    -1 for a position that marks an empty entry).
    """
    kwargs.setdefault("default", None)
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata[_ROWS] = fill
    return attrs.field(metadata=metadata, **kwargs)


def derived_field(**kwargs) -> Any:
    """An attrs field (default ``None``) holding data derived from the stored slots, kept only
    to save recomputing it: not saved with the cache and reset to None by batch-row edits."""
    kwargs.setdefault("default", None)
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata[_DERIVED] = True
    return attrs.field(metadata=metadata, **kwargs)


def derived_arrays(state) -> list:
    """The arrays a state holds in derived fields (held memory that is not saved)."""
    return _field_arrays(state, lambda f: _DERIVED in f.metadata)


def held_arrays(state) -> list:
    """The arrays a state holds in its fields (directly or in a list/tuple), without unstructuring
    it: cheap enough for every step."""
    return _field_arrays(state, lambda f: True)


def _field_arrays(state, which) -> list:
    if state is None or not attrs.has(type(state)):
        return []
    out = []
    for f in attrs.fields(type(state)):
        x = getattr(state, f.name) if which(f) else None
        if isinstance(x, mx.array):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(a for a in x if isinstance(a, mx.array))
    return out


def _without_derived(state):
    names = [f.name for f in attrs.fields(type(state)) if _DERIVED in f.metadata]
    return attrs.evolve(state, **{n: None for n in names}) if names else state


def _rows_fields(state) -> list:
    return [f for f in attrs.fields(type(state)) if _ROWS in f.metadata]


def snapshot(state):
    """A shallow copy: arrays are immutable, so this protects against in-place field updates."""
    return None if state is None else copy.copy(state)


def take_rows(component, hook: Optional[Callable], state, rows: list):
    """The state of batch ``rows`` (the component's ``take_rows`` hook, or index rows fields)."""
    if state is None:
        return None
    if hook is not None:
        return hook(state, rows)
    idx = mx.array(rows, dtype=mx.int32)
    changes = {f.name: getattr(state, f.name)[idx] for f in _rows_fields(state) if getattr(state, f.name) is not None}
    return _without_derived(attrs.evolve(state, **changes) if changes else copy.copy(state))


def stack_rows(component, hook: Optional[Callable], states: list, rows: list):
    """One state holding the rows of ``states`` in order (``rows[i]`` rows each): the component's
    ``stack_rows`` hook, or every rows field concatenated (a row without a value gets its
    field's ``fill``)."""
    if all(s is None for s in states):
        return None
    if hook is not None:
        return hook(states, list(rows))
    first = next(s for s in states if s is not None)
    changes = {}
    for f in _rows_fields(first):
        parts = [None if s is None else getattr(s, f.name) for s in states]
        like = next((p for p in parts if p is not None), None)
        if like is None:
            continue
        if any(p is not None and p.shape[1:] != like.shape[1:] for p in parts):
            raise ConfigError(
                f"{type(component).__name__}.{f.name}: batch rows of different shapes "
                f"{[None if p is None else p.shape for p in parts]}; define a stack_rows hook"
            )
        fill = f.metadata[_ROWS]
        parts = [p if p is not None else mx.full((n,) + like.shape[1:], fill, like.dtype) for p, n in zip(parts, rows)]
        changes[f.name] = mx.concatenate(parts, axis=0)
    return _without_derived(attrs.evolve(first, **changes))


# ------------------------------------------------------------------------------------------
# (De)serialisation through cattrs: arrays leave as placeholders into a side list
# ------------------------------------------------------------------------------------------

_ARRAYS: contextvars.ContextVar = contextvars.ContextVar("kvcompress_state_arrays")
_conv = cattrs.Converter()


def _unstructure_array(a: mx.array) -> dict:
    out = _ARRAYS.get()
    out.append(a)
    return {"__array__": len(out) - 1}


def _structure_array(value, _type) -> mx.array:
    return _ARRAYS.get()[int(value["__array__"])]


_conv.register_unstructure_hook(mx.array, _unstructure_array)
_conv.register_structure_hook(mx.array, _structure_array)


def flatten_state(state) -> tuple[Optional[dict], list]:
    """``(meta, arrays)``: JSON-able metadata (with the class) and the state's arrays."""
    if state is None:
        return None, []
    arrays: list = []
    token = _ARRAYS.set(arrays)
    try:
        body = _conv.unstructure(_without_derived(state) if attrs.has(type(state)) else state)
    finally:
        _ARRAYS.reset(token)
    cls = type(state)
    return {"cls": f"{cls.__module__}:{cls.__qualname__}", "body": body}, arrays


def restore_state(component, meta: Optional[dict], arrays: list):
    """Rebuild a state written by :func:`flatten_state` for ``component``."""
    if meta is None:
        return None
    module, _, qualname = str(meta["cls"]).partition(":")
    home = type(component).__module__.split(".")[0]
    if module.split(".")[0] not in (home, "kvcompress"):
        raise ConfigError(f"saved state class {meta['cls']!r} does not belong to {type(component).__name__}")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not attrs.has(obj):
        raise ConfigError(f"saved state class {meta['cls']!r} is not an attrs class")
    token = _ARRAYS.set(list(arrays))
    try:
        return _conv.structure(meta["body"], obj)
    finally:
        _ARRAYS.reset(token)
