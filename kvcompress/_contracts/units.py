"""Contracts a component must meet on its own, checked on seeded synthetic contexts.

Every check raises :class:`~kvcompress.testing.ContractFailure` naming the contract it broke.

* all kinds -- the record is a :class:`~kvcompress.ComponentSpec` of that kind; ``cls()`` is the
  component with its defaults, a frozen attrs instance implementing the kind's protocol, with
  ``requires``/``provides`` frozensets of strings; its parameters are JSON-serialisable (a cache
  saves its method config as JSON) and structure back to the same component from a config.
* scorer -- ``observe`` returns ``[B, H_kv, T]`` float32 for float32/float16/bfloat16 inputs,
  real queries and key-as-query proxies, single- and multi-token steps; finite; deterministic;
  each batch row depends only on that row; a scorer that does not require ``"queries"`` ignores
  them.
* selector -- ``reserved(budget)`` leaves room below some budget; ``protected`` is a bool
  ``[B, H_kv, T]`` mask of at most ``reserved(budget)`` slots; ``select`` returns ``n_evict``
  (or ``evict_count(n_evict)``) distinct, in-range, unprotected slot indices per row,
  deterministically.
* disposition -- ``dispose`` keeps shapes and dtypes, returns float32 scores, a merge count that
  is ``None`` or an integer scalar in ``[0, evicted]``, never modifies protected slots (sinks),
  stays finite in float16, is deterministic for a given ``draw_id``, and its optional state
  survives ``state_arrays`` -> ``restore_state``.
* budget -- ``layer_budgets`` returns one positive int per layer, deterministically.
"""

from __future__ import annotations

import json
import numbers

import attrs
import mlx.core as mx
import numpy as np

from ..components import KINDS, Budget, ComponentSpec, Disposition, ModelInfo, Scorer, Selector
from . import ContractReport, ensure, fail
from . import synthetic as syn

__all__ = ["check_spec", "check_scorer_unit", "check_selector_unit", "check_disposition_unit",
           "check_budget_unit", "UNIT_CHECKS", "unit_budget"]

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
# Scorer
# ------------------------------------------------------------------------------------------------


def check_scorer_unit(scorer, report: ContractReport, seed: int = 0) -> None:
    s = report.subject
    for dtype in _FLOATS:
        for n_new, proxy in ((1, False), (5, False), (1, True), (5, True)):
            rng = np.random.default_rng(seed)
            where = f"(dtype {dtype}, {n_new} new token(s){', proxy queries' if proxy else ''})"
            scores, obs = syn.observation(rng, 11, n_new, dtype, proxy)
            out = scorer.observe(scores, obs)
            ensure(isinstance(out, mx.array) and out.shape == scores.shape, s, "observe shape",
                   f"observe returned {getattr(out, 'shape', out)!r}, expected {scores.shape} {where}")
            ensure(out.dtype == mx.float32, s, "float32 scores",
                   f"observe returned {out.dtype} {where}; scores must be float32 "
                   "(accumulate in float32: .astype(mx.float32) before summing)")
            ensure(_finite(out), s, "finite scores", f"observe returned NaN or inf {where}")
            again = scorer.observe(scores, syn.replace(obs))
            ensure(_same(out, again), s, "deterministic", f"two identical observe calls differ {where}")
            for b in range(syn.B):
                ob = syn.batch_row(obs, b)
                rb = scorer.observe(scores[b : b + 1], ob)
                ensure(np.allclose(_np(rb), _np(out[b : b + 1]), rtol=1e-4, atol=1e-5), s,
                       "batch rows independent",
                       f"row {b} scored alone differs from row {b} of the batch {where}")
            if "queries" not in scorer.requires:
                other = syn.replace(obs, queries=syn.normal(rng, obs.queries.shape, dtype))
                ensure(_same(out, scorer.observe(scores, other)), s, "declared requirements",
                       f"the scores depend on the queries but 'queries' is not in requires {where}")
    for c in ("observe shape", "float32 scores", "finite scores", "deterministic", "batch rows independent"):
        report.ok(c)
    if "queries" not in scorer.requires:
        report.ok("declared requirements")
    else:
        report.skip("declared requirements", "the scorer reads queries")


# ------------------------------------------------------------------------------------------------
# Selector
# ------------------------------------------------------------------------------------------------


def unit_budget(selector, subject: str, least: int = 16, margin: int = 4) -> int:
    """The smallest budget >= ``least`` whose reserved slots leave ``margin`` evictable ones."""
    for b in range(least, 8193):
        r = selector.reserved(b)
        ensure(isinstance(r, numbers.Integral) and not isinstance(r, bool) and r >= 0, subject,
               "reserved", f"reserved({b}) returned {r!r}; expected an int >= 0")
        if r + margin <= b:
            return b
    raise fail(subject, "reserved", "no budget up to 8192 leaves room to evict: reserved(b) >= b - 4")


def check_selector_unit(selector, report: ContractReport, seed: int = 0) -> None:
    s = report.subject
    budget = unit_budget(selector, s)
    reserved = selector.reserved(budget)
    count = getattr(selector, "evict_count", None)
    for t in (budget, budget + 5):
        n_evict = t - (budget - 1)
        sel = syn.selection(np.random.default_rng(seed + t), selector, t, n_evict, budget)
        where = f"(budget {budget}, {t} stored, n_evict {n_evict})"
        prot = sel.protected
        ensure(isinstance(prot, mx.array) and prot.dtype == mx.bool_ and prot.shape == sel.scores.shape,
               s, "protected mask", f"protected() returned {getattr(prot, 'dtype', prot)!r} "
               f"{getattr(prot, 'shape', '')}, expected bool {sel.scores.shape} {where}")
        n_prot = int(prot.astype(mx.int32).sum(-1).max())
        ensure(n_prot <= reserved, s, "protected mask",
               f"{n_prot} slots protected but reserved({budget}) = {reserved} {where}")
        out = selector.select(sel)
        want = int(count(n_evict)) if count is not None else n_evict
        ensure(isinstance(out, mx.array) and mx.issubdtype(out.dtype, mx.integer), s, "select output",
               f"select returned {getattr(out, 'dtype', out)!r}; expected integer slot indices {where}")
        ensure(out.shape == (syn.B, syn.H_KV, want), s, "select output",
               f"select returned shape {out.shape}, expected {(syn.B, syn.H_KV, want)} "
               f"({'evict_count' if count is not None else 'n_evict'} = {want}) {where}")
        idx = np.array(out)
        ensure(idx.min() >= 0 and idx.max() < t, s, "select output", f"slot index out of [0, {t}) {where}")
        ensure(all(len(set(r.tolist())) == want for r in idx.reshape(-1, want)), s, "select output",
               f"a row evicts the same slot twice {where}")
        hit = np.take_along_axis(np.array(prot), idx, axis=-1)
        ensure(not hit.any(), s, "protected never evicted", f"select chose a protected slot {where}")
        ensure(_same(out, selector.select(syn.selection(np.random.default_rng(seed + t), selector, t,
                                                         n_evict, budget))),
               s, "deterministic", f"two identical select calls differ {where}")
    for c in ("reserved", "protected mask", "select output", "protected never evicted", "deterministic"):
        report.ok(c)
    report.details["unit_budget"] = budget


# ------------------------------------------------------------------------------------------------
# Disposition
# ------------------------------------------------------------------------------------------------


def _fresh_state(disp):
    init = getattr(disp, "init_state", None)
    return init() if init is not None else None


def check_disposition_unit(disp, report: ContractReport, seed: int = 0) -> None:
    s = report.subject
    n_protected = 2
    for dtype in (mx.float32, mx.float16):
        for t, e in ((16, 1), (16, 3), (48, 36)):
            where = f"(dtype {dtype}, {t} slots, {e} evicted)"
            ev = syn.eviction(np.random.default_rng(seed + t + e), t, e, n_protected, dtype, _fresh_state(disp))
            out = disp.dispose(ev)
            ensure(isinstance(out, tuple) and len(out) == 4, s, "dispose output",
                   f"dispose must return (keys, values, scores, n_merged), got {type(out).__name__} {where}")
            k, v, sc, n = out
            for name, got, ref in (("keys", k, ev.keys), ("values", v, ev.values)):
                ensure(isinstance(got, mx.array) and got.shape == ref.shape and got.dtype == ref.dtype, s,
                       "dispose output", f"{name} came back as {getattr(got, 'dtype', got)!r} "
                       f"{getattr(got, 'shape', '')}, expected {ref.dtype} {ref.shape} {where}")
                ensure(_finite(got), s, "finite", f"{name} contain NaN or inf {where}")
            ensure(isinstance(sc, mx.array) and sc.shape == ev.scores.shape and sc.dtype == mx.float32, s,
                   "float32 scores", f"scores came back as {getattr(sc, 'dtype', sc)!r} "
                   f"{getattr(sc, 'shape', '')}, expected float32 {ev.scores.shape} {where}")
            ensure(_finite(sc), s, "finite", f"scores contain NaN or inf {where}")
            if n is not None:
                ensure(isinstance(n, mx.array) and n.ndim == 0 and mx.issubdtype(n.dtype, mx.integer), s,
                       "merge count", f"n_merged must be None or an integer scalar array, got {n!r} {where}")
                ensure(0 <= int(n.item()) <= ev.evict.size, s, "merge count",
                       f"n_merged = {int(n.item())} outside [0, {ev.evict.size}] evicted tokens {where}")
            keep = np.array(ev.protected)[..., None]
            for name, got, ref in (("keys", k, ev.keys), ("values", v, ev.values)):
                changed = (_np(got) != _np(ref)) & keep
                ensure(not changed.any(), s, "protected slots untouched",
                       f"{name} of protected slots (sinks) changed; they must not be merge targets {where}")
            ev2 = syn.eviction(np.random.default_rng(seed + t + e), t, e, n_protected, dtype, _fresh_state(disp))
            out2 = disp.dispose(ev2)
            ensure(all(_same(a, b) for a, b in zip(out, out2)), s, "deterministic",
                   f"two dispose calls with the same draw_id differ {where}")
            _check_state_round_trip(disp, ev.state, report, where)
    for c in ("dispose output", "float32 scores", "finite", "merge count", "protected slots untouched",
              "deterministic"):
        report.ok(c)


def _check_state_round_trip(disp, state, report, where) -> None:
    to, back = getattr(disp, "state_arrays", None), getattr(disp, "restore_state", None)
    s = report.subject
    if to is None and back is None:
        report.skip("state round trip", "no state_arrays/restore_state")
        return
    ensure(to is not None and back is not None, s, "state round trip",
           "define both state_arrays(state) and restore_state(arrays), or neither")
    arrays = list(to(state))
    ensure(all(isinstance(a, mx.array) for a in arrays), s, "state round trip",
           f"state_arrays must return mx.arrays {where}")
    again = list(to(back(arrays)))
    ensure(len(again) == len(arrays) and all(_same(a, b) for a, b in zip(arrays, again)), s,
           "state round trip", f"state_arrays(restore_state(state_arrays(s))) differs {where}")
    report.ok("state round trip")


# ------------------------------------------------------------------------------------------------
# Budget
# ------------------------------------------------------------------------------------------------


def check_budget_unit(budget, report: ContractReport, seed: int = 0) -> None:
    s = report.subject
    for n_layers in (1, 2, 3, 8, 32):
        info = ModelInfo(n_layers=n_layers, n_kv_heads=syn.H_KV, head_dim=syn.D, model_type="llama")
        out = budget.layer_budgets(info)
        ensure(isinstance(out, (list, tuple)) and len(out) == n_layers, s, "one budget per layer",
               f"layer_budgets({n_layers} layers) returned {out!r}")
        ensure(all(isinstance(b, numbers.Integral) and not isinstance(b, bool) and b >= 1 for b in out), s,
               "positive int budgets", f"layer_budgets({n_layers} layers) returned {out!r}")
        ensure(list(out) == list(budget.layer_budgets(info)), s, "deterministic",
               f"two layer_budgets calls for {n_layers} layers differ")
    for c in ("one budget per layer", "positive int budgets", "deterministic"):
        report.ok(c)


UNIT_CHECKS = {
    "scorer": check_scorer_unit,
    "selector": check_selector_unit,
    "disposition": check_disposition_unit,
    "budget": check_budget_unit,
}
