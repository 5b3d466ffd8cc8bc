"""KVzip with head-wise budgets (``selector="adaptive"``): scoring passes over rows of several KV
heads score every (head, token) exactly as with one head per row, and the heads then keep
different counts within the layer's bytes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvcompress
from kvcompress_kvzip import pass_score

from conftest import tiny_llama


def _scores_by_head(cache, n_tokens: int) -> list:
    """Per layer ``[B, H_kv, n_tokens]``: each (head, position)'s running score (NaN: not stored)."""
    out = []
    for layer in cache:
        _, _, pos, score = layer.head_view()
        pos, score = np.array(pos), np.array(score)
        s = np.full(pos.shape[:2] + (n_tokens,), np.nan)
        for bi in range(pos.shape[0]):
            for k in range(pos.shape[1]):
                real = pos[bi, k] >= 0
                s[bi, k, pos[bi, k][real]] = score[bi, k][real]
        out.append(s)
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 3), (8, 2)])
@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_pass_scores_do_not_depend_on_the_row_layout(heads, kv_heads, b, dtype):
    """Nothing evicted (budget above the prompt): after three chunks and their reconstruction
    passes, every (head, token) holds the same KVzip score whether the heads share a row of
    slots (adaptive) or own one each (lowest)."""
    model = tiny_llama(n_layers=2, heads=heads, kv_heads=kv_heads, seed=5, dtype=dtype)
    kvcompress.install(model)
    ids = mx.array(np.random.default_rng(b).integers(1, 97, (b, 240)), dtype=mx.int32)
    got = {}
    for sel in ("lowest", "adaptive"):
        cache = kvcompress.make_prompt_cache(model, "kvzip", budget=400, chunk=32, selector=sel)
        for a in range(0, 240, 80):
            model(ids[:, a : a + 80], cache=cache)
        model(ids[:, -1:], cache=cache)  # the last chunk's pieces are reconstructed before this call
        assert cache[0].diagnostics["scoring_passes"] > 0
        got[sel] = _scores_by_head(cache, 241)
    assert cache[0].heads_per_row == kv_heads  # one row holds every head
    for plain, grouped in zip(got["lowest"], got["adaptive"]):
        assert not np.isnan(plain[..., :240]).any() and not np.isnan(grouped[..., :240]).any()
        # bfloat16: the layer's outputs round in another order, which reaches the next layer
        tol = 1e-5 if dtype == mx.float32 else 2e-2
        np.testing.assert_allclose(grouped[..., :240], plain[..., :240], rtol=tol, atol=tol * 1e-2)
        assert np.nanmax(plain[..., :240]) > 0.05  # real attention scores, not the provisional 1 or 0


@pytest.mark.parametrize("g", [1, 3])
def test_direct_pass_score_reads_each_slot_with_its_own_heads(g):
    """The direct score (models whose attention bypasses the cache) over a row of 2 KV heads
    tagged by owner equals the score over one row per head."""
    rng = np.random.default_rng(g)
    b, h, t, n, d = 2, 2, 12, 4, 8
    q = mx.array(rng.standard_normal((b, h * g, n, d)).astype(np.float32))
    k = mx.array(rng.standard_normal((b, h, t, d)).astype(np.float32))
    kpos = mx.broadcast_to(mx.arange(t, dtype=mx.int32), (b, h, t))
    qpos = mx.broadcast_to(mx.arange(t - n, t, dtype=mx.int32).reshape(1, 1, n), (b, 1, n))
    lo, hi = mx.full((b, 1, 1), 3, mx.int32), mx.full((b, 1, 1), 6, mx.int32)
    first = mx.full((b, 1, 1), t - n, mx.int32)
    plain = pass_score(q, k, kpos, qpos, 0.4, lo, hi, 2, first)
    row_k = k.reshape(b, 1, h * t, d)  # head-major row: head 0's slots, then head 1's
    owner = mx.broadcast_to(mx.repeat(mx.arange(h, dtype=mx.int32), t), (b, 1, h * t))
    grouped = pass_score(q, row_k, kpos.reshape(b, 1, h * t), qpos, 0.4, lo, hi, 2, first,
                         owner=owner, heads_per_row=h)
    np.testing.assert_allclose(np.array(grouped).reshape(b, h, t), np.array(plain), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kv_heads", [2, 3])
def test_kvzip_with_head_wise_budgets_holds_the_layer_bytes(kv_heads, tmp_path):
    """kvzip + adaptive: the heads keep different counts, the layer holds H_kv x C slots, decode
    continues and the cache saves and loads."""
    model = tiny_llama(n_layers=2, heads=2 * kv_heads, kv_heads=kv_heads, seed=7)
    kvcompress.install(model)
    cache = kvcompress.make_prompt_cache(model, "kvzip", budget=24, chunk=16, selector="adaptive", alpha=0.2)
    ids = mx.array(np.random.default_rng(7).integers(1, 97, (1, 160)), dtype=mx.int32)
    counts = (lambda c: (np.array(c.head_view()[2])[0] >= 0).sum(-1))
    for a in range(0, 128, 64):
        model(ids[:, a : a + 64], cache=cache)
    model(ids[:, 128:129], cache=cache)  # the last chunk's pieces are reconstructed first
    # the reconstruction scores differ between heads, and so do the counts they keep
    assert any(len(set(counts(c).tolist())) > 1 for c in cache)
    for i in range(129, 150):
        model(ids[:, i : i + 1], cache=cache)
    for c in cache:
        assert counts(c).sum() == kv_heads * 24 and c.evictions > 0
        assert counts(c).min() >= int(np.ceil(0.2 * 24))
    path = str(tmp_path / "kvzip-adaptive.safetensors")
    kvcompress.save_prompt_cache(path, cache)
    loaded = kvcompress.load_prompt_cache(path)
    for i in range(150, 160):  # the loaded cache continues exactly as the original
        a = model(ids[:, i : i + 1], cache=cache)
        b = model(ids[:, i : i + 1], cache=loaded)
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_batched_rows_with_head_wise_budgets_match_their_solo_runs():
    """Rows of different lengths in mlx-lm's ``BatchGenerator`` (left padding, passes over the
    batch): each row's tokens equal its run alone."""
    from mlx_lm.generate import BatchGenerator

    from _regression_helpers import prompt_tokens

    model = tiny_llama(n_layers=2, hidden=48, heads=6, kv_heads=3, seed=5)
    prompts = [prompt_tokens(70, salt=1), prompt_tokens(53, salt=2)]

    def run(rows):
        gen = BatchGenerator(model, max_tokens=8)
        try:
            caches = [kvcompress.make_prompt_cache(model, "kvzip", budget=16, chunk=16, interval=4,
                                                   selector="adaptive") for _ in rows]
            uids = gen.insert(rows, caches=caches)
            out: dict = {}
            for _ in range(60):
                responses = gen.next_generated()
                if not responses:
                    break
                for r in responses:
                    out.setdefault(r.uid, []).append(int(r.token))
            return [out[u] for u in uids]
        finally:
            gen.close()

    solo = [run([p])[0] for p in prompts]
    assert run(prompts) == solo
    assert all(len(s) == 8 for s in solo)
