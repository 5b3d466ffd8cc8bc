"""Contracts a component must meet on its own, checked on seeded synthetic contexts.

Every check raises :class:`~kvcompress.testing.ContractFailure` naming the contract it broke.

* all kinds -- the record is a :class:`~kvcompress.ComponentSpec` of that kind; ``cls()`` is the
  component with its defaults, a frozen attrs instance implementing the kind's protocol, with
  ``requires``/``provides`` frozensets of strings; its parameters are JSON-serialisable (a cache
  saves its method config as JSON) and structure back to the same component from a config.
* optional hooks (only those the component declares, see
  :data:`~kvcompress.components.OPTIONAL_HOOKS`) -- ``init_state(layer)`` returns None or an
  attrs instance whose state, fresh and after use, survives ``flatten_state`` ->
  ``restore_state`` (what ``cache.state`` and save/load do), ``copy.deepcopy`` and
  ``take_rows`` / ``stack_rows`` (what batching does); ``diagnostics(state)`` returns a dict
  of JSON values.
* scorer -- ``observe`` returns ``[B, H_kv, T]`` float32 for float32/float16/bfloat16 inputs,
  real queries and key-as-query proxies, single- and multi-token steps; finite; deterministic;
  each batch row depends only on that row (rows holding different numbers of tokens, with
  empty slots and right padding, included); a scorer that does not require ``"queries"``
  ignores them; it never mutates the state it is handed (the cache keeps it to undo a step).
* selector -- ``reserved(budget)`` leaves room below some budget; ``protected`` is a bool
  ``[B, H_kv, T]`` mask of at most ``reserved(budget)`` slots, per row the same for an int
  budget and a ``[B, 1, 1]`` budget array; ``select`` returns ``n_evict`` (or
  ``evict_count(n_evict, budget)``) distinct, in-range, unprotected (never empty) slot indices per row,
  deterministically; with ``row_counts`` the first ``evict_count(row_counts[b], budget)`` entries of
  row ``b`` are what the row chooses alone.
* disposition -- ``dispose`` returns ``(keys, values, scores)``: shapes and dtypes kept, float32
  scores, never modifies protected slots (sinks) or empty ones, stays finite in float16, is
  deterministic for a given ``draw_id``, and each row is disposed as it is alone (a row freeing
  fewer slots than others: only its ``real`` entries leave).
* budget -- ``layer_budgets`` returns one positive int per layer, deterministically; with
  ``observe_layer``/``rebudget`` (``layer_io``), per-row states and budgets of the right shape.
"""

from __future__ import annotations

import copy
import json

import attrs
import mlx.core as mx
import numpy as np

from .. import _state
from ..components import KINDS, Budget, ComponentSpec, Disposition, Scorer, Selector, component_hooks
from . import ContractReport, ensure, fail
from . import synthetic as syn

__all__ = ["check_spec", "check_state"]

_PROTOCOLS = {"scorer": Scorer, "selector": Selector, "disposition": Disposition, "budget": Budget}
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def _np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32)) if mx.issubdtype(x.dtype, mx.floating) else np.array(x)


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b, equal_nan=True))


def _finite(x: mx.array) -> bool:
    return bool(mx.all(mx.isfinite(x.astype(mx.float32))))


# ------------------------------------------------------------------------------------------------
# Every kind
# ------------------------------------------------------------------------------------------------


def check_spec(spec: ComponentSpec, report: ContractReport):
    """The record and the component class; returns the default instance."""
    s = report.subject
    ensure(isinstance(spec, ComponentSpec), s, "record", f"expected a ComponentSpec, got {spec!r}")
    ensure(spec.kind in KINDS, s, "record", f"kind {spec.kind!r} is not one of {KINDS}")
    ensure(spec.summary.strip(), s, "record", "the summary is empty (it is shown by `kvcompress components`)")
    try:
        comp = spec.cls()
    except Exception as exc:
        raise fail(s, "defaults", f"{spec.cls.__name__}() fails with its defaults: {exc!r}") from exc
    ensure(isinstance(comp, _PROTOCOLS[spec.kind]), s, "protocol",
           f"{spec.cls.__name__} does not implement the {spec.kind} protocol "
           f"({_PROTOCOLS[spec.kind].__name__}: see docs/hooks/kvcompress_{spec.kind}s.md)")
    report.ok("record and protocol")
    for attr in ("requires", "provides"):
        val = getattr(spec.cls, attr, None)
        ensure(isinstance(val, frozenset) and all(isinstance(x, str) for x in val), s, "capabilities",
               f"{spec.cls.__name__}.{attr} must be a class-level frozenset of strings, got {val!r}")
    report.ok("capabilities")
    try:
        name = attrs.fields(spec.cls)[0].name if attrs.fields(spec.cls) else "_kvcompress_probe"
        setattr(comp, name, getattr(comp, name, None))
    except (attrs.exceptions.FrozenInstanceError, AttributeError):
        report.ok("frozen")
    else:
        raise fail(s, "frozen", f"{spec.cls.__name__} instances can be mutated; use @attrs.frozen "
                   "(a component is its configuration and is shared by every layer's cache)")
    params = spec.params()
    try:
        json.loads(json.dumps(params))
    except (TypeError, ValueError) as exc:
        raise fail(s, "serialisable parameters",
                   f"defaults {params!r} are not JSON values; caches save their method config as JSON "
                   f"({exc})") from exc
    from ..config import structure_component

    again = structure_component(spec, json.loads(json.dumps(params)))
    ensure(again == comp, s, "config round trip",
           f"structuring the defaults {params!r} from a config gives {again!r}, not {comp!r}")
    report.ok("serialisable parameters")
    report.ok("config round trip")
    return comp


# ------------------------------------------------------------------------------------------------
# Component state (optional hooks common to every kind)
# ------------------------------------------------------------------------------------------------


def _flat(state):
    meta, arrays = _state.flatten_state(state)
    return json.loads(json.dumps(meta)), arrays


def _same_state(a, b) -> bool:
    (ma, xa), (mb, xb) = _flat(a), _flat(b)
    return ma == mb and len(xa) == len(xb) and all(_same(x, y) for x, y in zip(xa, xb))


def check_state(kind: str, comp, state, report: ContractReport, where: str = "", rows: int = syn.B,
                fresh: bool = False) -> None:
    """``state`` (from ``init_state``, possibly after use) survives what the cache does to it:
    ``cache.state`` (``flatten_state`` -> JSON -> ``restore_state``), deep copies, and batch rows
    (``take_rows`` of every row, then ``stack_rows``: the same state again, unless ``fresh`` -- a
    state no step has touched may not know its rows yet); ``diagnostics`` gives JSON values."""
    s = report.subject
    hooks = component_hooks(kind, comp)
    if "init_state" not in hooks:
        for h in ("take_rows", "stack_rows"):
            ensure(h not in hooks, s, "state round trip", f"{h} is defined but init_state is not")
        report.skip("state round trip", "no init_state hook: the component keeps no state")
        return
    if state is None:
        return
    ensure(attrs.has(type(state)), s, "state round trip",
           f"init_state must return None or an attrs instance, got {type(state).__name__} {where}")
    try:
        meta, arrays = _state.flatten_state(state)
        json.dumps(meta)
    except Exception as exc:
        raise fail(s, "state round trip", f"the state cannot be flattened into cache.state ({type(exc).__name__}: "
                   f"{exc}); annotate its fields (mx.array, int, float, str, attrs classes) {where}") from exc
    try:
        back = _state.restore_state(comp, json.loads(json.dumps(meta)), arrays)
    except Exception as exc:
        raise fail(s, "state round trip", f"restore_state(flatten_state(state)) fails: {type(exc).__name__}: "
                   f"{exc} {where}") from exc
    ensure(type(back) is type(state) and _same_state(back, state), s, "state round trip",
           f"restore_state(flatten_state(state)) differs from the state {where}")
    ensure(_same_state(copy.deepcopy(state), state), s, "state round trip",
           f"a deep copy of the state differs from it {where}")
    take, stack = hooks.get("take_rows"), hooks.get("stack_rows")
    parts = [_state.take_rows(comp, take, state, [r]) for r in range(rows)]
    again = _state.stack_rows(comp, stack, parts, [1] * rows)
    ensure(type(again) is type(state), s, "state round trip",
           f"stack_rows([take_rows(state, [r]) for each row]) is a {type(again).__name__} {where}")
    if fresh:
        # a fresh state may not know its rows yet; split and merged again it must still work
        ensure(_same_state(again, _state.stack_rows(comp, stack, parts, [1] * rows)), s, "state round trip",
               f"stack_rows of a fresh state's rows is not deterministic {where}")
    else:
        ensure(_same_state(again, state), s, "state round trip",
               f"stack_rows([take_rows(state, [r]) for each row]) differs from the state {where}")
        swapped = _state.stack_rows(comp, stack, parts[::-1], [1] * rows)
        ensure(_same_state(_state.take_rows(comp, take, swapped, [rows - 1]), parts[0]), s, "state round trip",
               f"row 0 moved to the last batch row is no longer row 0's state {where}")
    report.ok("state round trip")
    if "diagnostics" in hooks:
        d = hooks["diagnostics"](state)
        ensure(isinstance(d, dict) and all(isinstance(k, str) for k in d), s, "diagnostics",
               f"diagnostics(state) must return a dict with str keys, got {d!r} {where}")
        try:
            json.dumps(d)
        except (TypeError, ValueError) as exc:
            raise fail(s, "diagnostics", f"diagnostics(state) values are not JSON values: {d!r} {where}") from exc
        report.ok("diagnostics")


def _init_state(kind: str, comp):
    init = component_hooks(kind, comp).get("init_state")
    return init(syn.LAYER) if init is not None else None


def _rows_of(kind: str, comp, state, b: int):
    return _state.take_rows(comp, component_hooks(kind, comp).get("take_rows"), state, [b])


# ------------------------------------------------------------------------------------------------
# Scorer
# ------------------------------------------------------------------------------------------------
