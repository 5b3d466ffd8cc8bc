"""Per-kind unit contracts (scorer, selector, disposition, budget), checked on seeded synthetic
contexts; the contracts shared by every kind (spec, optional hooks, state) are in
:mod:`kvcompress._contracts.units`, whose docstring lists every contract.
"""

from __future__ import annotations

import copy
import numbers

import mlx.core as mx
import numpy as np

from .. import _state
from ..components import ModelInfo, component_hooks
from ..method import evict_count_problem
from . import ContractReport, ensure, fail
from . import synthetic as syn
from .units import _np, _same, _finite, check_state, _flat, _same_state, _init_state, _rows_of, _FLOATS

__all__ = ["check_scorer_unit", "check_selector_unit", "check_disposition_unit", "check_budget_unit",
           "UNIT_CHECKS", "unit_budget"]


def check_scorer_unit(scorer, report: ContractReport, seed: int = 0) -> None:
    s = report.subject
    fresh = _init_state("scorer", scorer)
    check_state("scorer", scorer, fresh, report, "(fresh from init_state)", fresh=True)
    cases = [(dtype, n_new, proxy, False) for dtype in _FLOATS for n_new in (1, 5) for proxy in (False, True)]
    cases += [(mx.float32, n_new, False, True) for n_new in (1, 5)]
    for dtype, n_new, proxy, ragged in cases:
        rng = np.random.default_rng(seed)
        where = (f"(dtype {dtype}, {n_new} new token(s){', proxy queries' if proxy else ''}"
                 f"{', rows of different lengths with empty slots' if ragged else ''})")
        scores, obs = syn.observation(rng, 11, n_new, dtype, proxy, state=_state.snapshot(fresh), ragged=ragged)
        before = _flat(obs.state) if obs.state is not None else None
        handed = obs.state
        out = scorer.observe(scores, obs)
        ensure(isinstance(out, mx.array) and out.shape == scores.shape, s, "observe shape",
               f"observe returned {getattr(out, 'shape', out)!r}, expected {scores.shape} {where}")
        ensure(out.dtype == mx.float32, s, "float32 scores",
               f"observe returned {out.dtype} {where}; scores must be float32 "
               "(accumulate in float32: .astype(mx.float32) before summing)")
        ensure(_finite(out), s, "finite scores", f"observe returned NaN or inf {where}")
        if handed is not None:
            ensure(_flat(handed)[0] == before[0] and all(_same(x, y) for x, y in zip(_flat(handed)[1], before[1])),
                   s, "state not mutated", "observe changed the state it was handed in place; assign a new "
                   f"one to obs.state (the cache keeps the old one to undo a step) {where}")
        new_state = obs.state
        again_obs = syn.replace(obs, state=_state.snapshot(fresh))
        again = scorer.observe(scores, again_obs)
        ensure(_same(out, again), s, "deterministic", f"two identical observe calls differ {where}")
        for b in range(syn.B):
            ob, t_row = syn.batch_row(obs, b, state=_rows_of("scorer", scorer, _state.snapshot(fresh), b))
            rb = scorer.observe(scores[b : b + 1, :, :t_row], ob)
            ensure(np.allclose(_np(rb), _np(out[b : b + 1, :, :t_row]), rtol=1e-4, atol=1e-5), s,
                   "batch rows independent", f"row {b} scored alone (its real tokens only) differs from row {b} "
                   f"of the batch {where}")
            if new_state is not None:
                ensure(_same_state(ob.state, _rows_of("scorer", scorer, new_state, b)), s, "batch rows independent",
                       f"row {b}'s state after observing alone differs from row {b} of the batch's state {where}")
        if "queries" not in scorer.requires:
            other = syn.replace(obs, queries=syn.normal(rng, obs.queries.shape, dtype), state=_state.snapshot(fresh))
            ensure(_same(out, scorer.observe(scores, other)), s, "declared requirements",
                   f"the scores depend on the queries but 'queries' is not in requires {where}")
        if new_state is not None and dtype == mx.float32:
            check_state("scorer", scorer, new_state, report, f"after observing {where}")
            # the next step is handed (a shallow copy of) this state; its arrays must not change
            kept = [np.array(a) for a in _state.flatten_state(new_state)[1]]
            _, nxt = syn.observation(np.random.default_rng(seed + 1), 11, n_new, dtype, proxy,
                                     state=_state.snapshot(new_state), ragged=ragged)
            scorer.observe(scores, nxt)
            now = [np.array(a) for a in _state.flatten_state(new_state)[1]]
            ensure(len(now) == len(kept) and all(np.array_equal(x, y) for x, y in zip(kept, now)), s,
                   "state not mutated", "observe changed the arrays of the state it was handed in place; "
                   f"assign a new state to obs.state (the cache keeps the old one to undo a step) {where}")
    for c in ("observe shape", "float32 scores", "finite scores", "deterministic", "batch rows independent",
              "empty slots"):
        report.ok(c)
    if fresh is not None:
        report.ok("state not mutated")
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


def _check_selected(out, sel, want: int, count, s: str, where: str) -> np.ndarray:
    t = sel.scores.shape[-1]
    ensure(isinstance(out, mx.array) and mx.issubdtype(out.dtype, mx.integer), s, "select output",
           f"select returned {getattr(out, 'dtype', out)!r}; expected integer slot indices {where}")
    ensure(out.shape == (sel.scores.shape[0], syn.H_KV, want), s, "select output",
           f"select returned shape {out.shape}, expected {(sel.scores.shape[0], syn.H_KV, want)} "
           f"({'evict_count' if count is not None else 'n_evict'} = {want}) {where}")
    idx = np.array(out)
    ensure(idx.min() >= 0 and idx.max() < t, s, "select output", f"slot index out of [0, {t}) {where}")
    ensure(all(len(set(r.tolist())) == want for r in idx.reshape(-1, want)), s, "select output",
           f"a row evicts the same slot twice {where}")
    return idx


def check_selector_unit(selector, report: ContractReport, seed: int = 0) -> None:
    s = report.subject
    fresh = _init_state("selector", selector)
    check_state("selector", selector, fresh, report, "(fresh from init_state)", fresh=True)
    budget = unit_budget(selector, s)
    reserved = selector.reserved(budget)
    problem = evict_count_problem(selector)
    if problem:
        raise fail(s, "select output", problem)
    count = component_hooks("selector", selector).get("evict_count")

    def n_out(n):
        return int(count(n, budget)) if count is not None else n

    for t in (budget, budget + 5):
        n_evict = t - (budget - 1)
        sel = syn.selection(np.random.default_rng(seed + t), selector, t, budget, state=fresh)
        where = f"(budget {budget}, {t} stored, n_evict {n_evict})"
        prot = sel.protected
        ensure(isinstance(prot, mx.array) and prot.dtype == mx.bool_ and prot.shape == sel.scores.shape,
               s, "protected mask", f"protected() returned {getattr(prot, 'dtype', prot)!r} "
               f"{getattr(prot, 'shape', '')}, expected bool {sel.scores.shape} {where}")
        n_prot = int(prot.astype(mx.int32).sum(-1).max())
        ensure(n_prot <= reserved, s, "protected mask",
               f"{n_prot} slots protected but reserved({budget}) = {reserved} {where}")
        # rows with different budgets: a [B, 1, 1] budget array protects per row what an int does
        budgets = [budget, budget + 8]
        per_row = selector.protected(sel.positions, sel.offset, syn.offsets(budgets))
        for b, bud in enumerate(budgets):
            alone = selector.protected(sel.positions[b : b + 1], sel.offset[b : b + 1], bud)
            ensure(isinstance(per_row, mx.array) and per_row.shape == prot.shape
                   and bool(mx.array_equal(per_row[b : b + 1], alone)), s, "protected mask",
                   f"row {b}: protected() with a [B, 1, 1] budget array differs from the same row with "
                   f"budget={bud} {where}")
        out = selector.select(sel)
        want = n_out(n_evict)
        idx = _check_selected(out, sel, want, count, s, where)
        hit = np.take_along_axis(np.array(prot), idx, axis=-1)
        ensure(not hit.any(), s, "protected never evicted", f"select chose a protected slot {where}")
        again = syn.selection(np.random.default_rng(seed + t), selector, t, budget, state=fresh)
        ensure(_same(out, selector.select(again)), s, "deterministic", f"two identical select calls differ {where}")

    # rows of different lengths: empty slots, per-row counts in priority order
    t = budget + 5
    sel = syn.selection(np.random.default_rng(seed + 99), selector, t, budget, ragged=True, state=fresh)
    where = f"(budget {budget}, rows holding {list(sel.offsets)} tokens in {t} slots, row counts " \
            f"{np.array(sel.row_counts).ravel().tolist()})"
    out = selector.select(sel)
    idx = _check_selected(out, sel, n_out(sel.n_evict), count, s, where)
    pos = np.array(sel.positions)
    counts = np.array(sel.row_counts).ravel().tolist()
    for b in range(syn.B):
        k = n_out(counts[b])
        chosen = idx[b, :, :k]
        ensure(not np.take_along_axis(pos[b], chosen, axis=-1).min() < 0, s, "empty slots",
               f"row {b} chose an empty slot (position -1) among its first {k} entries {where}")
        ensure(not np.take_along_axis(np.array(sel.protected)[b], chosen, axis=-1).any(), s,
               "protected never evicted", f"row {b} chose a protected slot {where}")
        solo = syn.replace(
            sel, scores=sel.scores[b : b + 1], positions=sel.positions[b : b + 1],
            protected=sel.protected[b : b + 1], n_evict=counts[b], offset=sel.offset[b : b + 1],
            offsets=(sel.offsets[b],), row_counts=None, state=_rows_of("selector", selector, fresh, b),
        )
        alone = np.array(selector.select(solo))
        for h in range(syn.H_KV):
            ensure(set(chosen[h].tolist()) == set(alone[0, h].tolist()), s, "row counts",
                   f"row {b} head {h}: the first evict_count({counts[b]}, {budget}) = {k} entries of the batched "
                   f"choice {sorted(chosen[h].tolist())} are not what the row chooses alone "
                   f"{sorted(alone[0, h].tolist())}; with row_counts, return each row's choice in "
                   f"priority order (e.g. lowest_k(..., ordered=True)) {where}")
    for c in ("reserved", "protected mask", "select output", "protected never evicted", "deterministic",
              "empty slots", "row counts"):
        report.ok(c)
    report.details["unit_budget"] = budget


# ------------------------------------------------------------------------------------------------
# Disposition
# ------------------------------------------------------------------------------------------------


def check_disposition_unit(disp, report: ContractReport, seed: int = 0) -> None:
    s = report.subject
    fresh = _init_state("disposition", disp)
    check_state("disposition", disp, fresh, report, "(fresh from init_state)", fresh=True)
    n_protected = 2
    cases = [(dtype, t, e, False) for dtype in (mx.float32, mx.float16) for t, e in ((16, 1), (16, 3), (48, 36))]
    cases += [(mx.float32, t, e, True) for t, e in ((16, 2), (24, 5))]
    for dtype, t, e, ragged in cases:
        where = (f"(dtype {dtype}, {t} slots, {e} evicted"
                 f"{', rows of different lengths with empty slots' if ragged else ''})")

        def ev_(state):
            return syn.eviction(np.random.default_rng(seed + t + e), t, e, n_protected, dtype, state, ragged=ragged)

        ev = ev_(copy.deepcopy(fresh))
        out = disp.dispose(ev)
        ensure(isinstance(out, tuple) and len(out) == 3, s, "dispose output",
               f"dispose must return (keys, values, scores), got {type(out).__name__}"
               f"{f' of {len(out)}' if isinstance(out, tuple) else ''} {where}; count merges in the "
               "disposition's state (init_state) and report them with diagnostics(state)")
        k, v, sc = out
        for name, got, ref in (("keys", k, ev.keys), ("values", v, ev.values)):
            ensure(isinstance(got, mx.array) and got.shape == ref.shape and got.dtype == ref.dtype, s,
                   "dispose output", f"{name} came back as {getattr(got, 'dtype', got)!r} "
                   f"{getattr(got, 'shape', '')}, expected {ref.dtype} {ref.shape} {where}")
            ensure(_finite(got), s, "finite", f"{name} contain NaN or inf {where}")
        ensure(isinstance(sc, mx.array) and sc.shape == ev.scores.shape and sc.dtype == mx.float32, s,
               "float32 scores", f"scores came back as {getattr(sc, 'dtype', sc)!r} "
               f"{getattr(sc, 'shape', '')}, expected float32 {ev.scores.shape} {where}")
        ensure(_finite(sc), s, "finite", f"scores contain NaN or inf {where}")
        pos = np.array(ev.positions)
        for name, got, ref in (("keys", k, ev.keys), ("values", v, ev.values)):
            changed = (_np(got) != _np(ref)).any(-1)
            ensure(not (changed & (pos >= 0) & np.array(ev.protected)).any(), s, "protected slots untouched",
                   f"{name} of protected slots (sinks) changed; they must not be merge targets {where}")
            ensure(not (changed & (pos < 0)).any(), s, "empty slots",
                   f"{name} of empty slots (position -1) changed; nothing may be merged into them {where}")
        out2 = disp.dispose(ev_(copy.deepcopy(fresh)))
        ensure(all(_same(a, b) for a, b in zip(out, out2)), s, "deterministic",
               f"two dispose calls with the same draw_id differ {where}")
        if dtype == mx.float32:
            for b in range(syn.B):
                n = ev.counts[b]
                sl = slice(b, b + 1)
                solo = syn.replace(
                    ev_(None), state=_rows_of("disposition", disp, copy.deepcopy(fresh), b),
                )
                solo = syn.replace(
                    solo, keys=solo.keys[sl], values=solo.values[sl], scores=solo.scores[sl],
                    positions=solo.positions[sl], evict=solo.evict[sl, :, :n], protected=solo.protected[sl],
                    offset=solo.offset[sl], offsets=(solo.offsets[b],), counts=(n,), real=None,
                )
                alone = disp.dispose(solo)
                for name, a, x in zip(("keys", "values", "scores"), alone, out):
                    ensure(np.allclose(_np(a), _np(x[sl]), rtol=1e-5, atol=1e-6), s, "batch rows independent",
                           f"row {b}: {name} disposed alone (its {n} real entries) differ from row {b} of the "
                           f"batch {where}")
                if ev.state is not None:
                    ensure(_same_state(solo.state, _rows_of("disposition", disp, ev.state, b)), s,
                           "batch rows independent", f"row {b}'s state after disposing alone differs from "
                           f"row {b} of the batch's state {where}")
            check_state("disposition", disp, ev.state, report, f"after disposing {where}")
    for c in ("dispose output", "float32 scores", "finite", "protected slots untouched", "empty slots",
              "deterministic", "batch rows independent"):
        report.ok(c)
    view = component_hooks("disposition", disp).get("view_keys")
    if view is not None:
        ev = syn.eviction(np.random.default_rng(seed), 16, 2, n_protected, state=copy.deepcopy(fresh))
        got = view(fresh, ev.keys, ev.positions, ev.offset)
        ensure(isinstance(got, mx.array) and got.shape == ev.keys.shape and got.dtype == ev.keys.dtype, s,
               "view_keys", f"view_keys returned {getattr(got, 'dtype', got)!r} {getattr(got, 'shape', '')}, "
               f"expected {ev.keys.dtype} {ev.keys.shape}")
        report.ok("view_keys")


# ------------------------------------------------------------------------------------------------
# Budget
# ------------------------------------------------------------------------------------------------


def check_budget_unit(budget, report: ContractReport, seed: int = 0) -> None:
    s = report.subject
    fresh = _init_state("budget", budget)
    check_state("budget", budget, fresh, report, "(fresh from init_state)", fresh=True)
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
    hooks = component_hooks("budget", budget)
    if "observe_layer" not in hooks:
        ensure("layer_io" not in budget.requires, s, "layer_io",
               "the budget requires 'layer_io' but defines no observe_layer hook to receive it")
        return
    ensure("layer_io" in budget.requires, s, "layer_io",
           "observe_layer is only called for budgets that require 'layer_io'")
    rng = np.random.default_rng(seed)
    n_layers, width = 3, 32
    layers = [budget.layer_budgets(ModelInfo(n_layers=n_layers, n_kv_heads=syn.H_KV, head_dim=syn.D))]
    states = []
    for layer in range(n_layers):
        x, out = syn.normal(rng, (syn.B, 7, width)), syn.normal(rng, (syn.B, 7, width))
        weight = (mx.arange(7).reshape(1, 7) < mx.array([[7], [4]])).astype(mx.float32)  # row 1 right-padded
        st = hooks["observe_layer"](_state.snapshot(fresh), x, out, weight)
        check_state("budget", budget, st, report, f"(after observe_layer of layer {layer})")
        states.append(st)
    rebudget = hooks.get("rebudget")
    if rebudget is not None:
        per_row = [[b] * syn.B for b in layers[0]]
        new = rebudget(states, per_row, 2)
        ensure(new is None or (len(new) == n_layers and all(
            len(r) == syn.B and all(isinstance(x, numbers.Integral) and x >= 2 for x in r) for r in new)), s,
            "layer_io", f"rebudget returned {new!r}; expected None or, per layer, one int >= min_budget per row")
    report.ok("layer_io")


UNIT_CHECKS = {
    "scorer": check_scorer_unit,
    "selector": check_selector_unit,
    "disposition": check_disposition_unit,
    "budget": check_budget_unit,
}
