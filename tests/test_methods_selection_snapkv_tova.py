"""Selection contracts of SnapKV and TOVA, each against a naive NumPy reference.

* SnapKV: the cache's scores equal the reference's pooled observation-window attention (max,
  avg, none; GQA; batch 2), and the kept set is the top ``C - 1 - w`` prefix plus the window;
  a short chunk uses its own queries; decode re-scoring pools slots in *position* order.
* TOVA: one score per layer (identical across heads), equal to the head-averaged last-query
  attention; the kept set is its top ``C - 1``; slot layouts stay identical across heads.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvcompress
from _methods_selection_helpers import D, SCALE, Driver
from kvcompress import CompressedKVCache, ConfigError


# ------------------------------------------------------------------------------------------------
# NumPy references
# ------------------------------------------------------------------------------------------------


def np_softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def np_pool(x, k, mode):
    """torch.nn.functional.{max,avg}_pool1d(kernel k, stride 1, padding k // 2)."""
    if mode == "none" or k == 1:
        return x
    r = k // 2
    pad = np.full(r, 0.0 if mode == "avg" else -np.inf)
    win = np.lib.stride_tricks.sliding_window_view(np.concatenate([pad, x, pad]), k)
    return win.mean(-1) if mode == "avg" else win.max(-1)


def np_snapkv(q_win, keys, pos, p0, kernel, pooling):
    """SnapKV per query head (window attention summed, prefix pooled), then mean per KV head."""
    b_, hq, m, _ = q_win.shape
    hkv, t = keys.shape[1], keys.shape[2]
    g = hq // hkv
    out = np.zeros((b_, hkv, t))
    q_pos = p0 + np.arange(m)
    for b in range(b_):
        for h in range(hq):
            kv = h // g
            logits = q_win[b, h].astype(np.float64) @ keys[b, kv].T.astype(np.float64) * SCALE
            logits = np.where(pos[b, kv][None, :] <= q_pos[:, None], logits, -np.inf)
            a = np_softmax(logits).sum(0)
            order = np.argsort(pos[b, kv])
            a_sorted = a[order]
            prefix = pos[b, kv][order] < p0  # the leading part in position order
            res = a_sorted.copy()
            res[prefix] = np_pool(a_sorted[prefix], kernel, pooling)
            out[b, kv, order] += res / g
    return out


def np_tova(q_last, keys):
    """Attention of the last query, averaged over all query heads: ``[B, T]``."""
    b_, hq = q_last.shape[:2]
    g = hq // keys.shape[1]
    out = np.zeros((b_, keys.shape[2]))
    for b in range(b_):
        for h in range(hq):
            logits = keys[b, h // g].astype(np.float64) @ q_last[b, h, 0].astype(np.float64) * SCALE
            out[b] += np_softmax(logits) / hq
    return out


# ------------------------------------------------------------------------------------------------
# SnapKV
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["max", "avg", "none"])
@pytest.mark.parametrize("b,hq,hkv", [(1, 4, 2), (2, 2, 2), (2, 8, 2)], ids=["gqa2", "mha-b2", "gqa4-b2"])
def test_snapkv_scores_and_kept_set_match_reference(pooling, b, hq, hkv):
    budget, w, kernel, t = 24, 6, 5, 40
    d = Driver("snapkv", budget, b=b, hq=hq, hkv=hkv, seed=1, recent=w, kernel=kernel, pooling=pooling)
    keys = d.step(t)  # one prefill chunk, longer than the budget: scored, not yet evicted
    ref = np_snapkv(d.last_queries(w), keys, d.pos, t - w, kernel, pooling)
    np.testing.assert_allclose(d.scores, ref, rtol=1e-5, atol=1e-6)

    d.step(1)  # the first decode step evicts down to budget - 1 old tokens, then appends
    n_keep = budget - 1 - w
    for bi in range(b):
        for h in range(hkv):
            kept = set(d.pos[bi, h].tolist()) - {t}
            window = set(range(t - w, t))
            assert window <= kept and len(kept) == budget - 1
            pre = ref[bi, h, : t - w]
            kept_pre = np.array(sorted(kept - window))
            if pooling == "max":  # max pooling makes plateaus: any top-k of the plateau is valid
                lost = np.setdiff1d(np.arange(t - w), kept_pre)
                assert pre[kept_pre].min() >= pre[lost].max() - 1e-6
            else:
                assert set(kept_pre.tolist()) == set(np.argsort(-pre)[:n_keep].tolist())


def test_snapkv_short_chunk_uses_its_own_queries():
    d = Driver("snapkv", 200, recent=8, kernel=3, pooling="avg")
    d.step(30)
    keys = d.step(5)  # N < w: the window is this chunk's 5 queries
    ref = np_snapkv(d.last_queries(5), keys, d.pos, 30, 3, "avg")
    np.testing.assert_allclose(d.scores, ref, rtol=1e-5, atol=1e-6)


def test_snapkv_decode_interval_rescores_in_position_order():
    """interval=3: every 3rd decode offset re-scores with the last w queries across steps; slot
    reuse has scrambled slot order, so the pooling must follow positions."""
    w, kernel, budget = 5, 3, 20
    d = Driver("snapkv", budget, b=2, seed=3, recent=w, kernel=kernel, pooling="avg", interval=3)
    d.step(30)
    events = 0
    for _ in range(12):
        keys = d.step(1)
        off = d.cache.offset
        pos = d.pos
        new_slot = pos == off - 1
        if off % 3 == 0:
            ref = np_snapkv(d.last_queries(w), keys, pos, off - w, kernel, "avg")
            np.testing.assert_allclose(d.scores, ref, rtol=1e-5, atol=1e-6)
            events += 1
        else:
            assert (d.scores[new_slot] == 0).all()  # a new token waits, protected, for an event
        assert (np.sort(pos, -1)[..., -w:] == np.arange(off - w, off)).all()  # window kept
    assert events == 4
    assert not (np.diff(d.pos, axis=-1) > 0).all(), "slot reuse should have scrambled slot order"


def test_snapkv_row_events_follow_the_row_not_the_batch():
    """In a right-padded batch chunk a row that brings one real token has a decode step (no
    re-scoring with interval 0), one that brings several has a chunk: each row scores exactly as
    it does alone."""
    from kvcompress import BatchCompressedKVCache

    m = kvcompress.build_method("snapkv", budget=64, recent=4, kernel=3, pooling="avg")
    rng = np.random.default_rng(7)

    def rand(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    k1, v1, q1 = rand(2, 2, 12, D), rand(2, 2, 12, D), rand(2, 4, 12, D)
    k2, v2, q2 = rand(2, 2, 5, D), rand(2, 2, 5, D), rand(2, 4, 5, D)
    batch = BatchCompressedKVCache.merge([CompressedKVCache(m, 64), CompressedKVCache(m, 64)])
    batch.update_and_fetch(k1, v1)
    batch.observe(q1, SCALE)
    batch.prepare(lengths=[5, 1], right_padding=[0, 4])
    batch.update_and_fetch(k2, v2)
    batch.observe(q2, SCALE)
    batch.finalize()
    assert batch.offset.tolist() == [17, 13]
    for r, n in ((0, 5), (1, 1)):
        solo = CompressedKVCache(m, 64)
        solo.update_and_fetch(k1[r : r + 1], v1[r : r + 1])
        solo.observe(q1[r : r + 1], SCALE)
        before = np.array(solo.slot_scores)
        solo.update_and_fetch(k2[r : r + 1, :, :n], v2[r : r + 1, :, :n])
        solo.observe(q2[r : r + 1, :, :n], SCALE)
        if n == 1:  # a decode step leaves the chunk's scores, the new token enters at 0
            np.testing.assert_array_equal(np.array(solo.slot_scores)[..., :12], before)
        pos, score = np.array(batch.slot_positions[r]), np.array(batch.slot_scores[r])
        for h in range(2):
            got = dict(zip(pos[h].tolist(), score[h].tolist()))
            got.pop(-1, None)
            want = dict(zip(np.array(solo.slot_positions[0, h]).tolist(), np.array(solo.slot_scores[0, h]).tolist()))
            assert sorted(got) == sorted(want)
            np.testing.assert_allclose([got[p] for p in sorted(want)], [want[p] for p in sorted(want)],
                                       rtol=1e-5, atol=1e-6)


def test_snapkv_rejects_even_kernel():
    with pytest.raises(ConfigError, match="kernel"):
        kvcompress.build_method("snapkv", kernel=4)


# ------------------------------------------------------------------------------------------------
# TOVA
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b,hq,hkv", [(2, 4, 2), (1, 4, 4)], ids=["gqa-b2", "mha"])
def test_tova_head_shared_scores_and_top_k(b, hq, hkv):
    budget = 12
    d = Driver("tova", budget, b=b, hq=hq, hkv=hkv, seed=4)
    keys = d.step(20)
    for _ in range(15):
        ref = np_tova(d.last_queries(1), keys)  # the step's last query, mean over all heads
        scores = d.scores
        assert (scores == scores[:, :1]).all(), "one score per layer: identical across heads"
        np.testing.assert_allclose(scores[:, 0], ref, rtol=1e-5, atol=1e-7)
        before = d.pos
        keys = d.step(1)
        pos = d.pos
        assert (pos == pos[:, :1]).all(), "slots must stay aligned across heads"
        for bi in range(b):
            kept_old = set(pos[bi, 0].tolist()) - {d.cache.offset - 1}
            top = set(before[bi, 0, np.argsort(-ref[bi])[: budget - 1]].tolist())
            assert kept_old == top
