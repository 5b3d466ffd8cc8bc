"""Cache files saved by the version before the engine package (state version 2, commit
0239f97: ``tests/data/cache-state-v2-*.safetensors``, a 1-layer Llama with 2 KV heads of 8 after
70 prompt and 10 decode tokens at budget 40) load, save back bit for bit, and continue."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import kvcompress

DATA = Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize("method", ["h2o", "adakv", "kvzip"])
def test_a_previous_versions_file_loads_saves_back_and_continues(method, tmp_path):
    path = DATA / f"cache-state-v2-{method}.safetensors"
    (c,), meta = kvcompress.load_prompt_cache(str(path), return_metadata=True)
    assert c.method.name == method and meta.get("made_by", "").startswith("kvcompress 0.1.0")
    assert c.offset == 80 and c.budget == 40 and c.tokens_kept <= 40
    assert c.heads_per_row == (2 if method == "adakv" else 1)

    again = tmp_path / "again.safetensors"
    kvcompress.save_prompt_cache(str(again), [c], metadata=meta)
    old, new = mx.load(str(path), return_metadata=True), mx.load(str(again), return_metadata=True)
    assert sorted(old[0]) == sorted(new[0])
    for name in old[0]:
        assert np.array_equal(np.array(old[0][name]), np.array(new[0][name])), name
    assert {k: v for k, v in old[1].items() if "digest" not in k} == {k: v for k, v in new[1].items() if "digest" not in k}

    if method == "kvzip":  # its scorer needs the model hook's token ids: a model-free step is refused
        return
    k = mx.random.normal((1, 2, 1, 8), key=mx.random.key(1))
    c.update_and_fetch(k, -k)
    assert c.offset == 81 and c.tokens_kept <= 40
    assert 80 in np.array(c.slot_positions).reshape(-1).tolist()
