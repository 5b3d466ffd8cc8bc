"""Where the decode and prefill time of compressed caches goes (the speed workload's profile).

:func:`profile_decode` measures, against ``rotating`` (all timings interleaved across variants):

(a) the per-step decode time of the model with eviction and/or scoring switched off
    (``no_evict``: the layer budgets are raised after prefill, so nothing is evicted and tokens
    are appended instead; ``no_score``: the scorer is replaced by one that leaves scores
    unchanged);
(b) a per-layer micro-benchmark of one decode step and of one prefill chunk of one cache
    (update + the model's SDPA + observe), and of each component call alone;
(c) the number of MLX primitives one decode step of the cache adds to a layer, counted on the
    lazy graph with ``mx.export_to_dot`` (:func:`count_ops`).

:mod:`kvcompress.bench._profile_report` presents it.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from typing import Any

import attrs
import mlx.core as mx

from ._caches import make_cache
from ._harness import interleave, median, prefill, release, sync_stepper
from ._model import build_model, random_tokens

__all__ = ["profile_decode", "count_ops"]


@attrs.frozen
class _KeepScores:
    """A scorer that leaves the scores unchanged (profiling: 'scoring disabled')."""

    requires = frozenset()
    provides = frozenset({"attention_mass"})

    def observe(self, scores, obs):
        return scores


def _split(variant: str) -> tuple[str, set]:
    """``"cam[no_evict,no_score]"`` -> ``("cam", {"no_evict", "no_score"})``."""
    name, _, flags = variant.partition("[")
    return name, set(flags.rstrip("]").split(",")) - {""}


def _switch_off(c, flags) -> None:
    """Apply a variant's flags to one layer's cache (after its prefill)."""
    if "no_evict" in flags:
        c.budget = 10**9
    if "no_score" in flags:
        c.replace_method(attrs.evolve(c.method, scorer=_KeepScores()))


def _model_profile(model, variants: list, s) -> dict:
    """Synchronous decode step time per variant after a ``2 * budget`` chunked prefill, the
    variants' steps interleaved in blocks of 4 (median over blocks)."""
    steppers = {}
    prompt = random_tokens(s, 2 * s.budget)
    for var in variants:
        name, flags = _split(var)
        cache = make_cache(model, name, s.budget, keep=s.keep)
        prefill(model, cache, prompt, 0, prompt.shape[0], s.prefill_step_size)
        for c in cache:
            _switch_off(c, flags)
        steppers[var] = sync_stepper(model, cache, prompt[None, -1:])
        steppers[var]()  # one untimed step
    k = 4
    times = interleave(steppers, max(1, s.profile_steps // k), k)
    del steppers
    release()
    return {v: {"step_ms_median": 1e3 * median(ts), "step_ms_min": 1e3 * min(ts)}
            for v, ts in times.items()}


def count_ops(*arrays: mx.array) -> dict:
    """Primitives in the unevaluated graph behind ``arrays`` (``mx.export_to_dot``)."""
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *arrays)
        text = open(path).read()
    finally:
        os.unlink(path)
    names = re.findall(r'label ="([^"]+)", shape=rectangle', text)
    hist: dict[str, int] = {}
    for n in names:
        hist[n] = hist.get(n, 0) + 1
    return {"n_ops": len(names), "by_op": dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0])))}


def _layer_inputs(s, n: int, key: int):
    dt = getattr(mx, s.dtype)
    k = mx.random.normal((1, s.n_kv_heads, n, s.head_dim), key=mx.random.key(key)).astype(dt)
    v = mx.random.normal((1, s.n_kv_heads, n, s.head_dim), key=mx.random.key(key + 1)).astype(dt)
    q = mx.random.normal((1, s.n_heads, n, s.head_dim), key=mx.random.key(key + 2)).astype(dt)
    mx.eval(k, v, q)
    return k, v, q


def _cache_arrays(c) -> list:
    """The arrays a cache step produces (storage, positions, scores, component states)."""
    from mlx.utils import tree_flatten

    if not hasattr(c, "slot_scores"):
        return [a for a in (c.keys, c.values) if a is not None]
    arrays = [a for a in (c.keys, c.values, c.slot_positions, c.slot_scores) if isinstance(a, mx.array)]
    # (and what the step tied to its output: a planned eviction's reads, evaluated with the step)
    return arrays + [a for _, a in tree_flatten(c.state[:-1]) if isinstance(a, mx.array)] + c.step_arrays()


def _filled_layer_cache(kind: str, s, flags=()):
    """One layer's cache after a prefill of 2 * budget synthetic tokens (observed)."""
    from mlx_lm.models.cache import RotatingKVCache

    from kvcompress import CompressedKVCache, build_method

    if kind == "rotating":
        c = RotatingKVCache(max_size=s.budget, keep=s.keep)
    else:
        c = CompressedKVCache(build_method(kind, budget=s.budget), s.budget, layer=0)
    k, v, q = _layer_inputs(s, 2 * s.budget, 10)
    for i in range(0, 2 * s.budget, s.budget):
        kk, vv = c.update_and_fetch(k[..., i: i + s.budget, :], v[..., i: i + s.budget, :])
        if kind != "rotating":
            c.observe(q[..., i: i + s.budget, :], s.head_dim**-0.5)
        mx.eval(kk, vv, _cache_arrays(c))
    # one decode step so the cache is in its steady decode state
    k1, v1, q1 = _layer_inputs(s, 1, 20)
    kk, vv = c.update_and_fetch(k1, v1)
    if kind != "rotating":
        c.observe(q1, s.head_dim**-0.5)
    mx.eval(kk, vv, _cache_arrays(c))
    _switch_off(c, flags)
    return c


def _model_sdpa():
    """mlx-lm's ``scaled_dot_product_attention`` behind kvcompress's wrapper: the exact call a
    model makes (attention through the cache, then ``observe``; a pass-through for others)."""
    from mlx_lm.models import base

    from kvcompress.mlxlm import attention

    attention.ensure_wrapped()
    return base.scaled_dot_product_attention


def _layer_steppers(variants: list, s, chunk: int) -> dict:
    """Per variant, a callable running one step of ``chunk`` tokens on one layer's cache:
    ``update_and_fetch`` + the model's (wrapped) SDPA, which observes for compressed caches."""
    scale = s.head_dim**-0.5
    sdpa = _model_sdpa()
    steppers = {}
    for var in variants:
        name, flags = _split(var)
        c = _filled_layer_cache(name, s, flags)
        inputs = [_layer_inputs(s, chunk, 100 + 3 * i) for i in range(4)]
        counter = {"i": 0}

        def step(c=c, name=name, inputs=inputs, counter=counter):
            k, v, q = inputs[counter["i"] % len(inputs)]
            counter["i"] += 1
            if chunk == 1:
                mask = None
            elif name == "rotating":
                mask = c.make_mask(chunk, window_size=None, return_array=False)
            else:
                mask = c.make_mask(chunk, return_array=False)
            kk, vv = c.update_and_fetch(k, v)
            out = sdpa(q, kk, vv, cache=c, scale=scale, mask=mask)
            mx.eval(out, _cache_arrays(c))

        step()  # untimed
        steppers[var] = step
    return steppers


def _layer_step_ms(variants: list, s, n: int, chunk: int = 1) -> dict:
    """Median ms of one step of one layer per variant (interleaved blocks of 4 steps)."""
    k = 4 if chunk == 1 else 1
    times = interleave(_layer_steppers(variants, s, chunk), max(1, n // k), k)
    return {v: {"ms": 1e3 * median(ts)} for v, ts in times.items()}


def _component_ms(kind: str, s, n: int) -> dict:
    """Median ms of each component call alone on a full decode-state cache of one layer."""
    from kvcompress import Eviction, Observation, Selection

    c = _filled_layer_cache(kind, s)
    m = c.method
    k, v = c.keys_and_values()
    pos, score = c.slot_positions, c.slot_scores
    _, _, q1 = _layer_inputs(s, 1, 7)
    scale = s.head_dim**-0.5
    off = mx.array(c.offset, mx.int32).reshape(1, 1, 1)
    ctx = dict(offset=off, offsets=(c.offset,), layer=c.info)

    def timed(fn):
        mx.eval(fn())
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            mx.eval(fn())
            ts.append(time.perf_counter() - t0)
        return 1e3 * median(ts)

    protected = m.selector.protected(pos, off, c.budget)
    qpos = off - 1

    def score_fn():
        obs = Observation(queries=q1, keys=k, values=v, positions=pos, query_positions=qpos, n_new=1,
                          scale=scale, n_valid=(1,), state=c.component_state("scorer"), **ctx)
        return m.scorer.observe(score, obs)

    def select_fn():
        return m.selector.select(Selection(scores=score, positions=pos, protected=protected, n_evict=1,
                                           budget=c.budget, **ctx))

    evict = select_fn().astype(mx.int32)
    mx.eval(evict)
    slot = evict[..., :1]  # the incoming token's slot (a selector may free more at once: evict_count)

    def dispose_fn():
        return m.disposition.dispose(Eviction(keys=k, values=v, scores=score, positions=pos, evict=evict,
                                              protected=protected, counts=(1,), draw_id=1,
                                              state=c.component_state("disposition"), **ctx))

    def write_fn():  # the slot write of the incoming token (4 put_along_axis)
        b, h = k.shape[:2]
        idx = mx.broadcast_to(slot[..., None], (b, h, 1, k.shape[-1]))
        return [
            mx.put_along_axis(k, idx, k[..., :1, :], axis=2),
            mx.put_along_axis(v, idx, v[..., :1, :], axis=2),
            mx.put_along_axis(pos, slot, pos[..., :1], axis=2),
            mx.put_along_axis(score, slot, mx.zeros(slot.shape, mx.float32), axis=2),
        ]

    return {
        "scorer.observe": timed(score_fn),
        "selector.select": timed(select_fn),
        "disposition.dispose": timed(dispose_fn),
        "slot_write": timed(write_fn),
        "sdpa (reference)": timed(lambda: mx.fast.scaled_dot_product_attention(q1, k, v, scale=scale, mask=None)),
    }


def _prefill_component_ms(s, n: int = 5) -> dict:
    """One prefill chunk on one layer (queries = chunk, keys = budget - 1 + chunk): the model's
    SDPA, the mass alone (:func:`kvcompress.ops.attention` without values: the same softmax again,
    in float32), the fused output-and-mass attention a compressing chunk runs, and a bare ``exp``
    over the logits' shape (the cost all of them are dominated by on CPU)."""
    from kvcompress import ops

    S, T = s.prefill_step_size, s.budget - 1 + s.prefill_step_size
    k, v, _ = _layer_inputs(s, T, 70)
    _, _, q = _layer_inputs(s, S, 80)
    scale = s.head_dim**-0.5
    logits = mx.random.normal((1, s.n_heads, S, T), key=mx.random.key(90))
    mx.eval(logits)
    fns = {
        "sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal"),
        "attention_mass": lambda: ops.attention(q, k, None, scale, mask="causal", mass="group")[1],
        "exp over [H_q, S, T]": lambda: mx.exp(logits),
        "attention_with_mass (fused)": lambda: ops.attention(q, k, v, scale, mask="causal", mass="group"),
    }
    for fn in fns.values():
        mx.eval(fn())  # untimed
    times = interleave({k_: (lambda f=f: mx.eval(f())) for k_, f in fns.items()}, n, 1)
    out: dict[str, Any] = {name: 1e3 * median(ts) for name, ts in times.items()}
    out["shape"] = f"H_q={s.n_heads}, S={S}, T={T}"
    return out


def _op_counts(kind: str, s, model) -> dict:
    """MLX primitives of one decode step: the cache update, then the attention through the
    model's (wrapped) SDPA with the scorer's observation, and a whole decoder layer."""
    from mlx_lm.models.cache import RotatingKVCache

    scale = s.head_dim**-0.5
    c = _filled_layer_cache(kind, s)
    k1, v1, q1 = _layer_inputs(s, 1, 30)
    kk, vv = c.update_and_fetch(k1, v1)
    upd = count_ops(kk, vv, *_cache_arrays(c))
    mx.eval(kk, vv, _cache_arrays(c))
    res = {"update_and_fetch": upd["n_ops"], "update_by_op": upd["by_op"]}
    # the step's attention as a model runs it (a compressing step: output and mass from one
    # softmax, then observe, then the reads of the next step's planned eviction, if any), after
    # the update was evaluated
    out = _model_sdpa()(q1, kk, vv, cache=c, scale=scale, mask=None)
    att = count_ops(out, *_cache_arrays(c))
    res["attend_observe"], res["attend_observe_by_op"] = att["n_ops"], att["by_op"]
    mx.eval(out, _cache_arrays(c))
    # a whole decoder layer (attention + MLP) with this cache, for scale
    layer = model.layers[0]
    c2 = _filled_layer_cache(kind, s) if kind != "rotating" else RotatingKVCache(s.budget, s.keep)
    if kind == "rotating":
        kf, vf, _ = _layer_inputs(s, s.budget + 8, 40)
        mx.eval(c2.update_and_fetch(kf, vf))
        k2, v2, _ = _layer_inputs(s, 1, 50)
        mx.eval(c2.update_and_fetch(k2, v2))
    x = mx.random.normal((1, 1, s.hidden), key=mx.random.key(60)).astype(getattr(mx, s.dtype))
    mx.eval(x)
    h = layer(x, mask=None, cache=c2)
    res["decoder_layer_total"] = count_ops(h, *_cache_arrays(c2))["n_ops"]
    mx.eval(h, _cache_arrays(c2))
    return res


def profile_decode(s, model=None) -> dict:
    """Where decode time goes for each method of the speed settings ``s``
    (:class:`~kvcompress.bench.speed.SpeedSettings`, whose workload calls this) vs ``rotating``
    (see module docstring)."""
    from kvcompress import install

    if model is None:
        model = build_model(s)
        install(model)
    n = s.profile_steps
    variants = ["rotating"]
    for m in s.methods:
        variants += [m, f"{m}[no_evict]", f"{m}[no_evict,no_score]"]
    model_level = _model_profile(model, variants, s)
    layer_level = _layer_step_ms(variants, s, max(n, 40))
    # prefill: one chunk of prefill_step_size tokens on one layer (cache in eviction steady state)
    pre_vars = ["rotating", *[v for m in s.methods for v in (m, f"{m}[no_score]")]]
    layer_prefill = _layer_step_ms(pre_vars, s, 6, chunk=s.prefill_step_size)
    components, ops = {}, {}
    for m in ["rotating", *s.methods]:
        ops[m] = _op_counts(m, s, model)
        if m != "rotating":
            components[m] = _component_ms(m, s, max(n, 20))
    prefill_parts = _prefill_component_ms(s)
    # the cache's extra time per layer (1-layer micro-benchmark) times the layer count, against
    # the rotating model's decode step: the decode ratio the cache overhead alone predicts
    base_layer = layer_level["rotating"]["ms"]
    base_step = model_level["rotating"]["step_ms_median"]
    predicted = {}
    for m in s.methods:
        extra = s.n_layers * (layer_level[m]["ms"] - base_layer)
        predicted[m] = {"extra_ms_per_token": extra, "decode_ratio": base_step / (base_step + extra)}
    return {
        "context": 2 * s.budget,
        "predicted_from_layer_overhead": predicted,
        "model_step_ms": model_level,
        "layer_step_ms": layer_level,
        "layer_prefill_chunk_ms": layer_prefill,
        "prefill_component_ms": prefill_parts,
        "component_ms": components,
        "ops_per_layer_step": ops,
    }
