"""``kvcompress generate``: the KV-cache line compares the bytes held with what mlx-lm's own
``KVCache`` would hold."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

import kvcompress
from kvcompress.generate import cache_report, full_cache_bytes


# ------------------------------------------------------------------------------------------
# The KV cache line: bytes held vs mlx-lm's KVCache
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, dk, dv", [(mx.float32, 16, 16), (mx.float16, 8, 12)])
@pytest.mark.parametrize("prefill", [1, 200, 256, 300, 600])
def test_full_cache_bytes_is_what_mlx_lm_kvcache_holds(dtype, dk, dv, prefill):
    c = KVCache()
    B, H = 2, 3
    c.update_and_fetch(mx.zeros((B, H, prefill, dk), dtype), mx.zeros((B, H, prefill, dv), dtype))
    for _ in range(300):  # decode one token at a time across a step boundary
        assert full_cache_bytes(c.offset, c.keys, c.values) == c.nbytes, c.offset
        c.update_and_fetch(mx.zeros((B, H, 1, dk), dtype), mx.zeros((B, H, 1, dv), dtype))


def test_cache_report_compares_held_bytes_with_mlx_lm_kvcache(tiny_model):
    caches = kvcompress.make_prompt_cache(tiny_model, "h2o", budget=16)
    full = [KVCache() for _ in caches]
    tokens = mx.arange(1, 41)[None]
    steps = [tokens[:, :30], *(tokens[:, t:t + 1] for t in range(30, 40))]  # prefill, then decode
    for step in steps:
        mx.eval(tiny_model(step, cache=caches), tiny_model(step, cache=full))
    report = cache_report(caches)
    assert report["held_bytes"] == sum(c.nbytes for c in caches)
    assert report["full_bytes"] == sum(c.nbytes for c in full)
