"""Regression tests (issue 22, part 1): mlx-lm's ``BatchGenerator`` given rows that cannot share
one batch refuses them at ``insert`` with one ConfigError naming the layer and the two cache kinds,
before anything is queued or any cache changes; rows that can share a batch, loaded caches
included, run exactly. Each test's docstring names the bug it catches."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

import kvcompress
from _regression_helpers import caches_for, prompt_tokens
from conftest import tiny_llama

PROMPTS = [prompt_tokens(30, salt=1), prompt_tokens(37, salt=2)]


def _model(seed=5):
    return tiny_llama(n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=97, seed=seed)


def _run(gen, steps=40) -> dict:
    """Every token each uid got, driving ``gen`` until it is done (at most ``steps`` calls)."""
    out: dict = {}
    for _ in range(steps):
        responses = gen.next_generated()
        if not responses:
            break
        for r in responses:
            out.setdefault(r.uid, []).append(int(r.token))
    return out


def _state(caches) -> list:
    return [(c.offset, c.tokens_kept, c.evictions) for c in caches]


def _queued(gen) -> int:
    return len(gen._unprocessed_sequences) + len(gen._prompt_batch) + len(gen._generation_batch)


@pytest.mark.parametrize("order", ["plain first", "compressed first"])
@pytest.mark.parametrize("history", [False, True])
def test_a_compressed_row_and_a_plain_row_are_not_batched_together(order, history):
    """Bug: ``insert(caches=[None, compressed])`` (any batch whose first row holds an mlx-lm cache)
    took the compressed row in through mlx-lm's ``BatchKVCache``: an empty row silently ran
    uncompressed, a row with history got the positions of every token seen (not the ones kept).
    It is now refused at insert, nothing queued and the cache unchanged."""
    model = _model()
    comp = caches_for(model, "h2o", 12)
    if history:
        model(mx.array([prompt_tokens(20)]), cache=comp)
    before = _state(comp)
    rows = [None, comp] if order == "plain first" else [comp, None]
    gen = BatchGenerator(model, max_tokens=4)
    try:
        with pytest.raises(kvcompress.ConfigError, match=r"layer 0 holds .*kvcompress 'h2o' cache.*mlx-lm KVCache|"
                                                         r"layer 0 holds an mlx-lm KVCache and a kvcompress 'h2o'"):
            gen.insert(PROMPTS, caches=rows)
        assert _queued(gen) == 0 and _state(comp) == before
    finally:
        gen.close()


@pytest.mark.parametrize("running,joining,kind", [
    ("plain", "h2o", "mlx-lm BatchKVCache"),
    ("h2o", "plain", "mlx-lm KVCache"),
    ("h2o", "tova", "kvcompress 'tova' cache"),
])
def test_a_row_joining_a_running_batch_of_another_kind_is_refused_at_insert(running, joining, kind):
    """Bug: a compressed row joining a running batch of plain rows died inside ``next()`` with a
    raw ``AttributeError: ... '_idx'`` (and a plain or other-method row joining a compressed batch
    with a ConfigError raised mid-step, after the batch had been prepared). Both are refused at
    insert, naming the kinds; the running rows go on to finish."""
    model = _model()

    def rows(kind, n):
        return [None] * n if kind == "plain" else [caches_for(model, kind, 12) for _ in range(n)]

    gen = BatchGenerator(model, max_tokens=6)
    try:
        uids = gen.insert(PROMPTS, caches=rows(running, 2))
        first = [gen.next_generated() for _ in range(3)]
        assert any(first)
        with pytest.raises(kvcompress.ConfigError, match=f"cannot batch new row 0 with the running batch: .*{kind}"):
            gen.insert([prompt_tokens(12, salt=7)], caches=rows(joining, 1))
        assert len(gen._unprocessed_sequences) == 0
        done = _run(gen)
        assert set(done) <= set(uids)
    finally:
        gen.close()


def test_rows_that_share_a_method_batch_with_model_made_rows_and_loaded_caches(tmp_path):
    """The check lets through what works: ``caches=None`` rows of a model attached with the same
    method as the given rows, and caches loaded from a file in a model that was never prepared
    (the generator installs the model hook itself: kvzip gets its token ids). Each row's tokens
    equal its solo run."""
    model = _model()
    kvcompress.attach(model, "kvzip", budget=16)
    try:
        path = str(tmp_path / "kvzip.safetensors")
        kvcompress.save_prompt_cache(path, model.make_cache())
        solo = []
        for p in PROMPTS:
            gen = BatchGenerator(model, max_tokens=5)
            uid = gen.insert([p])[0]
            solo.append(_run(gen)[uid])
            gen.close()
        fresh = _model()  # the same weights, never given a hook
        gen = BatchGenerator(fresh, max_tokens=5)
        try:
            uids = gen.insert(PROMPTS, caches=[kvcompress.load_prompt_cache(path) for _ in PROMPTS])
            got = _run(gen)
        finally:
            gen.close()
        assert [got[u] for u in uids] == solo
        gen = BatchGenerator(model, max_tokens=5)
        try:
            uids = gen.insert(PROMPTS, caches=[None, kvcompress.load_prompt_cache(path)])
            got = _run(gen)
        finally:
            gen.close()
        assert [got[u] for u in uids] == solo
    finally:
        kvcompress.detach(model)
