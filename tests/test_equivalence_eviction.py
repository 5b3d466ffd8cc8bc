"""Exactness of the compressed cache around eviction, against explicit references and ``KVCache``.

* After eviction, a decode step equals attention over exactly the kept keys/values with RoPE at
  the true position ``offset`` (tokens seen), not at the stored length.
* After eviction, a multi-token step equals attention under the explicit mask "new tokens see
  every stored token, causal among themselves"; ``make_mask(N, return_array=True)``, asked
  before the step, is that mask for the layout the step attends; and a model that builds one
  array mask per forward (gemma2-style) gives the ``"causal"`` logits even when layers keep
  different numbers of tokens (per-layer budgets, whole-chunk eviction): the cache replaces
  the model's mask with its own exact one, built from the slot positions.
* Eviction is deferred: a chunk longer than the budget is attended in full by its own step.

The references are :class:`PinnedCache` (holds exactly the K/V it is given, RoPE offset set by the
test, explicit boolean mask) and a hand-written single-layer forward pass.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, _BaseCache

import kvcompress
from _equivalence_helpers import ATOL_FUSED, METHODS, fresh_tiny, maxdiff, prefill_chunks, token_ids
from conftest import assert_step_accounting, held_tokens, make_caches, tiny_llama
from kvcompress import CompressedKVCache

# Methods whose attention is exactly over the stored slots as stored: evicted tokens are gone
# (dropped or merged into survivors). A disposition with ``attend`` (e.g. a quantized store of
# evicted tokens) attends more than the slots, one with ``view_keys`` (e.g. a position shift)
# attends re-rotated keys, so the slot-only references below do not apply to them.
SLOT_ONLY = [
    m for m in METHODS
    if not any(hasattr(kvcompress.build_method(m).disposition, h) for h in ("attend", "view_keys"))
    # head-wise budgets (heads sharing a row of slots) attend under an owner mask
    and "head_wise_budgets" not in kvcompress.build_method(m).selector.provides
]


# ------------------------------------------------------------------------------------------------
# References
# ------------------------------------------------------------------------------------------------


def explicit_mask(n_new: int, n_old: int) -> mx.array:
    """``[n_new, n_old + n_new]`` bool: every new token sees all ``n_old`` stored tokens and the
    new tokens up to itself (built with numpy, independently of any mlx-lm/kvcompress helper)."""
    m = np.concatenate([np.ones((n_new, n_old), bool), np.tril(np.ones((n_new, n_new), bool))], 1)
    return mx.array(m)


class PinnedCache(_BaseCache):
    """Reference cache: exactly the given (post-RoPE) keys/values, RoPE offset chosen by the test.

    New tokens are appended after the stored ones. Under :func:`explicit_masks` every layer
    attends with its own :meth:`mask` array (new tokens see all stored tokens, causal among
    themselves), never the ``"causal"`` string.
    """

    def __init__(self, keys: mx.array, values: mx.array, offset: int):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys, values):
        self.keys = mx.concatenate([self.keys, keys], axis=2)
        self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        return self.keys, self.values

    def mask(self, n_new: int) -> mx.array:
        """This layer's mask for the step just appended (``n_new`` tokens)."""
        return explicit_mask(n_new, self.keys.shape[2] - n_new)

    def make_mask(self, N, window_size=None, return_array=False):
        return explicit_mask(N, self.keys.shape[2])

    def empty(self):
        return False

    @property
    def nbytes(self):
        return self.keys.nbytes + self.values.nbytes


@pytest.fixture
def explicit_masks(monkeypatch):
    """Call to make Llama attention with a :class:`PinnedCache` use that layer's own explicit
    mask (layers may keep different numbers of tokens, and mlx-lm builds one mask per forward).
    Call it *after* building compressed caches, so kvcompress wraps the unpatched function."""
    from mlx_lm.models import llama

    def apply():
        inner = llama.scaled_dot_product_attention

        def sdpa(queries, keys, values, cache, scale, mask, sinks=None, **kw):
            if isinstance(cache, PinnedCache):
                mask = cache.mask(queries.shape[2])
            return inner(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks, **kw)

        monkeypatch.setattr(llama, "scaled_dot_product_attention", sdpa)

    return apply


def kept_by_position(cache):
    """The stored keys/values/positions of a compressed cache, each head sorted by position."""
    k, v, pos, _ = cache.head_view()
    order = mx.argsort(pos, axis=-1)
    pos = mx.take_along_axis(pos, order, axis=-1)
    k = mx.take_along_axis(k, order[..., None], axis=2)
    v = mx.take_along_axis(v, order[..., None], axis=2)
    return k, v, pos


def manual_one_layer_logits(model, tokens: mx.array, k_old, v_old, position: int) -> mx.array:
    """A single-layer Llama forward for ``tokens`` [B, N] at RoPE position ``position`` attending
    ``k_old``/``v_old`` plus the new tokens (causal among themselves), with a hand-written float32
    softmax attention instead of ``mx.fast.scaled_dot_product_attention``."""
    inner = model.model
    assert len(inner.layers) == 1
    layer = inner.layers[0]
    attn = layer.self_attn
    b, n = tokens.shape
    h = inner.embed_tokens(tokens)
    x = layer.input_layernorm(h)

    def heads(t, nh):
        return t.reshape(b, n, nh, -1).transpose(0, 2, 1, 3)

    q = attn.rope(heads(attn.q_proj(x), attn.n_heads), offset=position)
    k = attn.rope(heads(attn.k_proj(x), attn.n_kv_heads), offset=position)
    v = heads(attn.v_proj(x), attn.n_kv_heads)
    K = mx.concatenate([k_old, k], axis=2).astype(mx.float32)
    V = mx.concatenate([v_old, v], axis=2).astype(mx.float32)
    group = attn.n_heads // attn.n_kv_heads
    K, V = mx.repeat(K, group, axis=1), mx.repeat(V, group, axis=1)
    logits = (q.astype(mx.float32) * attn.scale) @ K.swapaxes(-1, -2)
    logits = mx.where(explicit_mask(n, k_old.shape[2]), logits, -mx.inf)
    o = mx.softmax(logits, axis=-1) @ V
    o = o.transpose(0, 2, 1, 3).reshape(b, n, -1)
    h = h + attn.o_proj(o)
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return inner.embed_tokens.as_linear(inner.norm(h))


# ------------------------------------------------------------------------------------------------
# 1. RoPE offset after eviction
# ------------------------------------------------------------------------------------------------


def _prefill(model, cache, tokens, step):
    for i, j in prefill_chunks(tokens.shape[1], step):
        model(tokens[:, i:j], cache=cache)


@pytest.mark.parametrize("method", SLOT_ONLY)
def test_decode_after_eviction_uses_true_position(method, explicit_masks):
    model = tiny_llama(n_layers=1, seed=5)
    cache = make_caches(model, method, 10)
    (c,) = cache
    n_prompt, n_decode = int(2.5 * c.budget), 5
    tokens = token_ids(n_prompt + n_decode, 97, seed=6)[None]
    explicit_masks()
    _prefill(model, cache, tokens[:, :n_prompt], step=5)
    assert c.evictions > 0
    for i in range(n_prompt, n_prompt + n_decode):
        tok = tokens[:, i : i + 1]
        n_before, ev_before = held_tokens(c), c.evictions
        logits = model(tok, cache=cache)
        # offset counts tokens seen; the stored length is at most the budget
        assert c.offset == i + 1 and c.offset > c.budget >= c.size()
        assert_step_accounting(c, n_before, ev_before, 1)
        k, v, pos = kept_by_position(c)  # what this step attended, the new token last
        assert (np.array(pos[..., -1]) == i).all()
        k_old, v_old = k[:, :, :-1], v[:, :, :-1]

        pinned = model(tok, cache=[PinnedCache(k_old, v_old, offset=i)])
        manual = manual_one_layer_logits(model, tok, k_old, v_old, position=i)
        assert maxdiff(logits, pinned) <= 1e-5
        assert maxdiff(logits, manual) <= 1e-4

        # sanity: the same kept K/V with RoPE at the stored length (a cache that reset offset
        # to size()) gives different logits, so the comparison above can fail
        wrong = model(tok, cache=[PinnedCache(k_old, v_old, offset=k_old.shape[2])])
        assert maxdiff(logits, wrong) > 1e-3


# ------------------------------------------------------------------------------------------------
# 2. Mask of a multi-token step after eviction
# ------------------------------------------------------------------------------------------------


def _evicted_two_layer(method, n_new, seed=7):
    """A 2-layer model whose caches have all evicted, the next ``n_new`` tokens, the offset."""
    model = tiny_llama(n_layers=2, seed=seed)
    cache = make_caches(model, method, 10)
    n_prompt = 3 * max(c.budget for c in cache)
    tokens = token_ids(n_prompt + n_new, 97, seed=seed + 1)[None]
    _prefill(model, cache, tokens[:, :n_prompt], step=6)
    assert all(c.evictions > 0 and c.offset == n_prompt for c in cache)
    return model, cache, tokens[:, n_prompt:], n_prompt


@pytest.mark.parametrize("n_new", [3, 13])
@pytest.mark.parametrize("method", SLOT_ONLY)
def test_chunk_after_eviction_matches_explicit_mask(method, n_new, explicit_masks):
    model, cache, chunk, off = _evicted_two_layer(method, n_new)
    explicit_masks()
    assert cache[0].make_mask(n_new) == "causal"
    assert cache[0].make_mask(1) is None
    before = [(held_tokens(c), c.evictions) for c in cache]
    logits = model(chunk, cache=cache)
    pinned = []
    for c, (n_before, ev_before) in zip(cache, before):
        assert c.offset == off + n_new
        assert_step_accounting(c, n_before, ev_before, n_new)
        k, v = c.keys_and_values()
        # new tokens sit after every stored one, so bottom-right "causal" is the explicit mask
        assert (np.array(c.slot_positions[..., -n_new:]) == np.arange(off, off + n_new)).all()
        assert (np.array(c.slot_positions[..., :-n_new]) < off).all()
        pinned.append((k[:, :, :-n_new], v[:, :, :-n_new]))

    ref = model(chunk, cache=[PinnedCache(k, v, off) for k, v in pinned])
    assert maxdiff(logits, ref) <= 1e-5

    # sanity: without causality among the new tokens the outputs change
    class NoCausal(PinnedCache):
        def mask(self, n_new):
            return mx.ones((n_new, self.keys.shape[2]), mx.bool_)

    loose = model(chunk, cache=[NoCausal(k, v, off) for k, v in pinned])
    assert maxdiff(logits[:, :-1], loose[:, :-1]) > 1e-3


CHUNK_SIZES = [3, 5, 13, 2, 7, 11]  # varied, so an eviction count that rounds up shows


@pytest.mark.parametrize("method", SLOT_ONLY)
def test_make_mask_array_is_the_layout_after_the_step(method):
    """``make_mask(N, return_array=True)``, asked *before* the step (as mlx-lm models do), is
    the explicit mask of the layout the step then attends, in every layer."""
    model, cache, _, off = _evicted_two_layer(method, 1)
    tokens = token_ids(sum(CHUNK_SIZES), 97, seed=12)[None]
    i = 0
    for n_new in CHUNK_SIZES:
        predicted = [c.make_mask(n_new, return_array=True) for c in cache]
        model(tokens[:, i : i + n_new], cache=cache)
        i += n_new
        for c, arr in zip(cache, predicted):
            assert arr.dtype == mx.bool_
            assert arr.shape == (n_new, c.size()), (
                f"layer {c.layer}, step of {n_new}: make_mask predicted {arr.shape[1]} keys, "
                f"the step attended {c.size()}"
            )
            assert mx.array_equal(arr, explicit_mask(n_new, c.size() - n_new))


@pytest.mark.parametrize("method", METHODS)
def test_models_that_build_array_masks_match_causal(method, monkeypatch):
    """Some mlx-lm models (gemma2, deepseek_v3, ...) build one array mask per forward with
    ``create_attention_mask(h, cache[0], return_array=True)`` and hand it to every layer. After
    eviction such a model must give the logits the ``"causal"`` string gives."""
    from mlx_lm.models import llama

    model, cache, _, _ = _evicted_two_layer(method, 1, seed=13)
    twin = [CompressedKVCache.from_state(c.state) for c in cache]  # same contents, one new group
    assert twin[0].group is twin[1].group and twin[0].group is not cache[0].group
    for a, b in zip(cache, twin):
        assert b.budget == a.budget and b.state[-1] == a.state[-1]  # budgets and states travel
    tokens = token_ids(sum(CHUNK_SIZES), 97, seed=14)[None]
    causal = []
    i = 0
    for n_new in CHUNK_SIZES:
        causal.append(model(tokens[:, i : i + n_new], cache=cache))
        i += n_new
    original = llama.create_attention_mask
    monkeypatch.setattr(llama, "create_attention_mask", lambda h, c, **kw: original(h, c, return_array=True))
    i = 0
    for n_new, ref in zip(CHUNK_SIZES, causal):
        out = model(tokens[:, i : i + n_new], cache=twin)
        i += n_new
        assert maxdiff(out, ref) <= 1e-5


# ------------------------------------------------------------------------------------------------
# 3. Deferred eviction
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_chunk_longer_than_budget_is_attended_exactly(method):
    model = fresh_tiny()
    cache = make_caches(model, method, 8)
    ref = [KVCache() for _ in model.layers]
    chunk = 2 * max(c.budget for c in cache) + 3
    tokens = token_ids(2 * chunk + 1, 97, seed=9)[None]

    a = model(tokens[:, :chunk], cache=cache)
    b = model(tokens[:, :chunk], cache=ref)
    assert maxdiff(a, b) <= ATOL_FUSED  # every token of the long chunk saw all its predecessors
    for c in cache:
        assert c.size() == chunk > c.budget and c.evictions == 0 and c.offset == chunk

    # the next update evicts first (keeping at most budget-1 old tokens), then appends
    before = [(held_tokens(c), c.evictions) for c in cache]
    model(tokens[:, chunk : 2 * chunk], cache=cache)
    for c, (n, e) in zip(cache, before):
        assert c.offset == 2 * chunk and c.evictions > 0
        assert_step_accounting(c, n, e, chunk)

    # a decode step brings the cache back within the budget
    before = [(held_tokens(c), c.evictions) for c in cache]
    model(tokens[:, 2 * chunk :], cache=cache)
    for c, (n, e) in zip(cache, before):
        assert c.offset == 2 * chunk + 1 and c.size() <= c.budget
        assert_step_accounting(c, n, e, 1)
