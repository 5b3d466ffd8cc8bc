"""Contracts a method must meet inside real mlx-lm generation, on a tiny random Llama.

``check_method_runs`` drives :func:`mlx_lm.generate.generate_step` (chunked prefill, then greedy
decode) with caches from :func:`kvcompress.make_prompt_cache` and checks:

* **budget held** -- every ``update_and_fetch`` of ``S`` tokens leaves at most ``budget - 1 + S``
  tokens held (exactly ``n + S`` while under budget), returns exactly the stored slots (held
  and empty), and advances ``offset`` by ``S``; after the final decode step at most ``budget``
  are held, exactly ``budget`` for selectors that evict exactly ``n_evict`` slots;
* **positions** -- each row holds distinct positions below ``offset``, including the newest;
  every other slot is empty (position ``-1``);
* **protected kept** -- every position the selector protects at the end (sinks, recent window)
  is still stored; in particular the first ``n_sink`` tokens;
* **real queries** -- scores came from the model's queries (``score_source == "queries"``),
  float32 and finite; ``nbytes`` covers at least the arrays of ``state``;
* **exact without eviction** -- with a budget >= the sequence length, the same tokens and
  log-probabilities (to ``atol``) as mlx-lm's ``KVCache``;
* **deterministic** -- a second run gives identical tokens, log-probabilities and cache state;
* **float16** -- a float16 model gives no NaN in log-probabilities, stored keys/values or scores;
* **save/load** -- :func:`kvcompress.save_prompt_cache` / :func:`kvcompress.load_prompt_cache`
  restore every layer's state exactly, and decoding continues with the same logits;
* **batched** -- prompts of different lengths batched by mlx-lm's ``BatchGenerator`` (the
  per-sequence caches merged with :meth:`BatchCompressedKVCache.merge`, right-padded prompt
  chunks) generate the greedy tokens each prompt generates alone, with the same
  log-probabilities (to ``1e-4``);
* **config round trip** -- the resolved config, through JSON, builds the same components.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import attrs
import mlx.core as mx
import numpy as np

from ..components import KINDS
from ..errors import ConfigError
from ..factory import make_prompt_cache
from ..method import Method, build_method
from ..storage import as_float
from . import ContractReport, ensure, fail
from .generation import (
    _check_batched, _check_exact, _check_save_load, _compressed, _generate, _state_arrays, _states_equal,
    model_for,
)

__all__ = ["check_method_runs", "RunSettings"]

@attrs.frozen
class RunSettings:
    """Sizes of a contract run; ``budget=None`` picks the smallest workable budget."""

    budget: Optional[int] = None
    decode: int = 8
    atol: float = 1e-6
    seed: int = 0
    vocab: int = 97


class _StepLog:
    """Wraps each cache's ``update_and_fetch`` to check the per-step budget rule as it happens."""

    def __init__(self, caches, subject: str):
        self.subject = subject
        self.errors: list[str] = []
        for c in caches:
            orig = c.update_and_fetch

            def wrapped(keys, values, _c=c, _orig=orig):
                n0, off0, S = _c.tokens_kept, _c.offset, keys.shape[2]
                k, v = _orig(keys, values)
                n1, b = _c.tokens_kept, _c.budget
                bound = n0 + S if n0 + S <= b else b - 1 + S
                if not self.errors:
                    if n1 > bound:
                        self.errors.append(f"layer {_c.layer}: a {S}-token step left {n1} tokens held; at most "
                                           f"{bound} allowed (budget {b}, {n0} held before)")
                    elif n0 + S <= b and n1 != n0 + S:
                        self.errors.append(f"layer {_c.layer}: under budget but {n0} + {S} held became {n1}")
                    elif k.shape[2] != _c.size() * _c.heads_per_row or v.shape[2] != k.shape[2] or _c.size() < n1:
                        self.errors.append(f"layer {_c.layer}: returned {k.shape[2]} keys for {_c.size()} stored "
                                           f"slots holding {n1} tokens")
                    elif _c.offset != off0 + S:
                        self.errors.append(f"layer {_c.layer}: offset {off0} + {S} became {_c.offset}")
                return k, v

            c.update_and_fetch = wrapped

    def check(self):
        ensure(not self.errors, self.subject, "budget held", "; ".join(self.errors))


def _unpin_budget(config):
    """``config`` without ``budget`` in its component tables, so the flat ``budget`` the
    contract runs choose reaches the budget component (component tables win over flat params)."""
    from ..config import ComponentConfig, MethodConfig

    if isinstance(config, dict):
        config = MethodConfig.from_dict(config)
    if not isinstance(config, MethodConfig):
        return config
    changes = {}
    for kind in KINDS:
        c = config.component(kind)
        if c is not None and "budget" in c.params:
            changes[kind] = ComponentConfig(c.name, {k: v for k, v in c.params.items() if k != "budget"})
    return attrs.evolve(config, **changes) if changes else config


def _positions_scores(c):
    """Held positions and scores per (row, KV head); head-wise budgets gather each head's slots."""
    _, _, pos, scores = c.head_view()
    return np.array(pos), scores


class _Harness:
    """Builds caches from the *unresolved* config, so a flat ``budget`` reaches the components
    (a resolved config pins every component parameter, and component tables win over flat ones)."""

    def __init__(self, config, method: Method, subject: str, settings: RunSettings, registry, params: dict):
        self.config, self.method, self.subject, self.s = _unpin_budget(config), method, subject, settings
        self.registry, self.params = registry, params

    def caches(self, model, float_storage: bool = False, **extra):
        """The method's caches for ``model`` (``float_storage``: the same method without kv_bits)."""
        params = {**self.params, **extra, **({"kv_bits": None} if float_storage else {})}
        return make_prompt_cache(model, self.config, registry=self.registry, **params)

    # -- sizes ---------------------------------------------------------------------------------

    def pick_budget(self) -> tuple[dict, list]:
        """Flat budget params and the layer budgets of the smallest budget >= 16 the method accepts
        (the cache refuses a layer budget that leaves no slot to evict)."""
        if self.s.budget is not None:
            cands = [self.s.budget]
        else:
            cands = list(range(16, 1025, 4))
        takes_budget = any("budget" in attrs.fields_dict(type(self.method.component(k))) for k in KINDS)
        if not takes_budget:
            cands = [None]
        last = None
        for b in cands:
            extra = {} if b is None else {"budget": b}
            try:
                caches = _compressed(self.caches(model_for(self.method, vocab=self.s.vocab), **extra))
            except ConfigError as exc:
                last = exc
                continue
            return extra, [c.budget for c in caches]
        raise fail(self.subject, "budget", f"no budget in {cands[0]}..{cands[-1]} is accepted: {last}")

    # -- runs ----------------------------------------------------------------------------------

    def run(self, prompt, step, dtype=mx.float32, log=True, **extra):
        model = model_for(self.method, vocab=self.s.vocab, dtype=dtype)
        caches = self.caches(model, **extra)
        steplog = _StepLog(_compressed(caches), self.subject) if log else None
        toks, lps = _generate(model, prompt, caches, step, self.s.decode)
        if steplog is not None:
            steplog.check()
        return model, caches, toks, lps


def check_method_runs(config, method: Method, report: ContractReport, settings: RunSettings, registry,
                      params: dict) -> None:
    """Run every generation contract; ``config`` is what ``method`` was built from (+ ``params``)."""
    s = report.subject
    h = _Harness(config, method, s, settings, registry, params)
    extra, layer_budgets = h.pick_budget()
    b_max = max(layer_budgets)
    n_prompt = max(2 * b_max, b_max + 70)
    step = b_max // 2 + 1  # chunked prefill: evictions happen between multi-token steps
    rng = np.random.default_rng(settings.seed)
    prompt = mx.array(rng.integers(1, settings.vocab, n_prompt), dtype=mx.int32)
    report.details.update(budget=extra.get("budget"), layer_budgets=layer_budgets, prompt=n_prompt,
                          prefill_step=step, decode=settings.decode)

    # 1. a compressed run: per-step budget rule (checked inside), final layout
    model, caches, toks, lps = h.run(prompt, step, **extra)
    report.ok("budget held")
    comp = _compressed(caches)
    ensure(comp, s, "budget held", "make_prompt_cache made no CompressedKVCache layer")
    ensure(any(c.evictions for c in comp), s, "budget held",
           f"nothing was evicted from {n_prompt + settings.decode} tokens with budgets {layer_budgets}")
    for c in comp:
        ensure(c.tokens_kept <= c.size() <= c.budget, s, "budget held",
               f"layer {c.layer} holds {c.tokens_kept} tokens in {c.size()} slots after a decode step; "
               f"budget {c.budget}")
        if "evict_count" not in c.method.hooks()["selector"]:
            ensure(c.tokens_kept == min(c.budget, c.offset), s, "budget held",
                   f"layer {c.layer} holds {c.tokens_kept} tokens after a decode step, expected "
                   f"min(budget {c.budget}, offset {c.offset}) (the selector evicts exactly n_evict)")
        pos, scores = _positions_scores(c)
        g = c.heads_per_row  # head-wise budgets: the heads of a row hold g x tokens_kept together
        per_row = (pos >= 0).reshape(pos.shape[0], -1, g, pos.shape[-1]).sum(axis=(-1, -2))
        ensure((per_row == g * c.tokens_kept).all(), s, "positions",
               f"layer {c.layer}: the {g} heads of a row hold {per_row.tolist()} tokens, expected {g} x {c.tokens_kept}")
        for row in pos.reshape(-1, pos.shape[-1]):
            held = row[row >= 0]
            ensure(len(set(held.tolist())) == held.size and (g > 1 or held.size == c.tokens_kept)
                   and held.max() < c.offset
                   and c.offset - 1 in held and (row[row < 0] == -1).all(), s,
                   "positions", f"layer {c.layer}: held positions must be distinct, < offset {c.offset}, "
                   f"{c.tokens_kept} of them, include the newest token, and every other slot be empty (-1); "
                   f"got {sorted(row.tolist())}")
        sel = c.method.selector
        seen = mx.broadcast_to(mx.arange(c.offset, dtype=mx.int32), pos.shape[:2] + (c.offset,))
        must = np.array(sel.protected(seen, mx.full((1, 1, 1), c.offset, mx.int32), c.budget))
        for bh in np.ndindex(*pos.shape[:2]):
            missing = sorted(set(np.flatnonzero(must[bh]).tolist()) - set(pos[bh].tolist()))
            ensure(not missing, s, "protected kept",
                   f"layer {c.layer} head {bh[1]}: protected positions {missing[:10]} were evicted")
        ensure(scores.dtype == mx.float32 and bool(mx.all(mx.isfinite(scores))), s, "float32 scores",
               f"layer {c.layer}: scores are {scores.dtype} with NaN/inf: {scores}")
        ensure(c.score_source == "queries", s, "real queries",
               f"layer {c.layer}: score_source is {c.score_source!r}; the attention wrapper did not see queries")
        held = sum(a.nbytes for a in _state_arrays(c))
        ensure(c.nbytes >= held > 0, s, "honest nbytes", f"layer {c.layer}: nbytes {c.nbytes} < state {held}")
    n_sink = getattr(comp[0].method.selector, "n_sink", 0)
    for c in ("positions", "protected kept", "float32 scores", "real queries", "honest nbytes"):
        report.ok(c)
    if n_sink:
        for c in comp:
            pos = _positions_scores(c)[0]
            kept = all(set(range(n_sink)) <= set(row.tolist()) for row in pos.reshape(-1, pos.shape[-1]))
            ensure(kept, s, "sinks kept", f"layer {c.layer}: the first {n_sink} positions (the selector's "
                   f"n_sink) are not all stored after {c.offset} tokens")
        report.ok(f"sinks kept (n_sink={n_sink})")
    else:
        report.skip("sinks kept", "the selector protects no sinks (n_sink = 0)")

    # 2. determinism
    _, caches2, toks2, lps2 = h.run(prompt, step, log=False, **extra)
    ensure(toks2 == toks and all(bool(mx.array_equal(a, b)) for a, b in zip(lps, lps2)), s, "deterministic",
           "a second identical run produced different tokens or log-probabilities")
    ensure(all(_states_equal(a, b) for a, b in zip(_compressed(caches), _compressed(caches2))), s,
           "deterministic", "a second identical run left a different cache state")
    report.ok("deterministic")

    # 3. save / load / continue
    _check_save_load(model, caches, report, settings)

    # 4. float16
    _, caches16, _, lps16 = h.run(prompt, step, dtype=mx.float16, **extra)
    ensure(not any(bool(mx.any(mx.isnan(lp))) for lp in lps16), s, "float16",
           "a float16 model produced NaN log-probabilities")
    for c in _compressed(caches16):
        k, v = (as_float(a) for a in c.keys_and_values())
        ensure(k.dtype == mx.float16 and not bool(mx.any(mx.isnan(k))) and not bool(mx.any(mx.isnan(v))), s,
               "float16", f"layer {c.layer}: stored keys/values are {k.dtype} or contain NaN")
        ensure(bool(mx.all(mx.isfinite(_positions_scores(c)[1]))), s, "float16",
               f"layer {c.layer}: scores contain NaN/inf in float16")
    report.ok("float16")

    # 5. no eviction -> exactly KVCache
    _check_exact(h, prompt, step, report, settings)

    # 6. batched rows of different lengths -> each row as alone
    _check_batched(h, prompt, step, report, settings, extra)

    # 7. config round trip
    cfg = json.loads(json.dumps(method.config.to_dict()))
    again = build_method(cfg, registry=registry)
    for kind in KINDS:
        ensure(again.component(kind) == method.component(kind), s, "config round trip",
               f"{kind} rebuilt from {cfg} is {again.component(kind)!r}, not {method.component(kind)!r}")
    report.ok("config round trip")


def method_subject(method: Any) -> str:
    """``method 'cam'`` or, for a config, ``method {'scorer': ..., ...}``."""
    from ..config import MethodConfig

    if isinstance(method, str):
        return f"method {method!r}"
    if isinstance(method, MethodConfig):
        return f"method {method.to_dict()}"
    return f"method {getattr(method, 'name', method)!r}"
