"""Regression tests for generating with compressed caches beyond plain ``generate_step``:
speculative decoding (trim), ``kv_bits`` refused, and batched generation (merge / extract / filter /
extend, CaM's batch merge targets). Each test's docstring names the bug it catches."""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models import cache as mlx_cache

import kvcompress
from _regression_helpers import METHODS, PARAMS, batches_uneven, caches_for, greedy, held, prompt_tokens


def state_snapshot(caches) -> list:
    out = []
    for c in caches:
        for x in c.state:
            out.append(x if isinstance(x, str) else np.array(x.astype(mx.float32)))
    return out


def assert_same_snapshot(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, str):
            assert x == y
        else:
            np.testing.assert_array_equal(x, y)


class FakeTokenizer:
    """What ``mlx_lm.batch_generate`` needs from a tokenizer."""

    eos_token_ids = [10_000]  # never generated: every row runs max_tokens steps

    def decode(self, ids):
        return " ".join(map(str, ids))


# ------------------------------------------------------------------------------------------
# Speculative decoding
# ------------------------------------------------------------------------------------------


class FlakyDraft(nn.Module):
    """A draft model: the main model (with its own, uncompressed cache), except that every third
    call proposes a wrong token -- so rounds accept all, some or none of the drafts."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        self.layers = base.layers
        self.calls = 0

    def __call__(self, inputs, cache=None):
        out = self.base(inputs, cache=cache)
        self.calls += 1
        if self.calls % 3 == 0:
            wrong = (mx.argmax(out[:, -1:], axis=-1) + 1) % out.shape[-1]
            out = out + 100.0 * (mx.arange(out.shape[-1]) == wrong[..., None]).astype(out.dtype)
        return out


@pytest.fixture
def draft(model):
    return FlakyDraft(model)


def _rejections(res) -> int:
    """Rounds whose drafts were not all accepted (a main-model token after < 3 drafts)."""
    run, out = 0, 0
    for _, from_draft in res:
        if from_draft:
            run += 1
        else:
            out += run < 3
            run = 0
    return out


def _speculate(model, draft, main_caches, n=24, prompt=None):
    prompt = prompt if prompt is not None else prompt_tokens(24, salt=5)
    draft_caches = [mlx_cache.KVCache() for _ in draft.layers]
    out = speculative_generate_step(mx.array(prompt), model, draft, num_draft_tokens=3, max_tokens=n,
                                    prompt_cache=main_caches + draft_caches)
    res = [(int(t), bool(d)) for t, _, d in out]
    # the main cache holds the prompt and every token but the last, plus the last if it was an
    # accepted draft token (it went through the main model); rejected drafts are trimmed
    return res, len(prompt) - 1 + len(res) + (1 if res[-1][1] else 0)


@pytest.mark.parametrize("method", METHODS)
def test_speculative_decoding_with_a_compressed_main_cache(model, draft, method):
    """Bug: compressed caches refused ``trim`` once anything was evicted (or trimmed inexactly),
    so speculative decoding either failed or left rejected draft tokens in the cache. Now the
    main cache's offset after ``speculative_generate_step`` is what a KVCache's is for the same
    accepted tokens, only tokens up to the offset are held, a budget >= the sequence gives
    plain greedy decoding's tokens, and a trim beyond the last step raises without changing
    anything."""
    plain = [mlx_cache.KVCache() for _ in model.layers]
    res, want = _speculate(model, draft, plain)
    assert all(c.offset == want for c in plain)

    caches = caches_for(model, method, 12)
    res, want = _speculate(model, draft, caches)
    assert _rejections(res) >= 3 and any(d for _, d in res), res
    for c in caches:
        assert c.offset == want
        pos = held(c)
        assert (pos >= 0).sum(1).mean() == c.tokens_kept <= c.budget - 1 + 4  # the last step verified 3 drafts + 1
        assert all((np.diff(p[p >= 0]) > 0).all() for p in pos) and pos.max() == want - 1
    assert caches[0].evictions > 0

    before = state_snapshot(caches)
    for n in (caches[0].offset, 30):
        assert not caches[0].can_trim(n)
        with pytest.raises(kvcompress.KVCompressError):
            caches[0].trim(n)
    assert_same_snapshot(before, state_snapshot(caches))

    greedy_tokens = [int(t) for t, _ in generate_step(mx.array(prompt_tokens(24, salt=5)), model, max_tokens=24)]
    big = caches_for(model, method, 128)
    res, _ = _speculate(model, draft, big)
    assert [t for t, _ in res] == greedy_tokens


def test_kv_bits_with_a_compressed_cache_is_refused(model):
    """Bug: ``generate_step(..., kv_bits=4)`` with a compressed prompt cache silently ignored
    ``kv_bits`` (the cache had no ``to_quantized``). It is now a clear ConfigError, which points
    to kvcompress's own low-bit storage of the kept slots."""
    caches = kvcompress.make_prompt_cache(model, "h2o", budget=12)
    gen = generate_step(mx.array(prompt_tokens(20)), model, prompt_cache=caches, kv_bits=4, quantized_kv_start=0,
                        max_tokens=4)
    with pytest.raises(kvcompress.ConfigError, match="mlx-lm's kv_bits=4 cannot be combined") as err:
        list(gen)
    assert "kvcompress.make_prompt_cache(model, method, budget=..., kv_bits=4" in str(err.value)
    assert "--kv-bits on kvcompress generate/serve" in str(err.value) and "\n" not in str(err.value)
    assert all(isinstance(c, kvcompress.CompressedKVCache) for c in caches)


# ------------------------------------------------------------------------------------------
# Batched generation
# ------------------------------------------------------------------------------------------

PROMPT_LENGTHS = (21, 34, 9)


@pytest.mark.parametrize("method", METHODS)
def test_batch_generate_rows_equal_their_solo_runs(model, method):
    """Bug: compressed caches could not be batched (no merge/extract/filter/extend, one offset
    for all rows), so ``mlx_lm.batch_generate`` with ``prompt_caches`` failed. Each row's greedy
    tokens must equal its solo ``generate_step`` run, for prompts of different lengths (rows
    evict different numbers of tokens at different steps). Also caught: CaM's merge excluded a
    batch row's non-leaving entries from its merge targets (cam / snapkv_merge rows differed).
    kivi / h2o_kivi are skipped while their disposition cannot batch uneven evictions."""
    if not batches_uneven(method):
        pytest.skip(f"{method}: the disposition cannot yet batch rows that free different numbers of tokens")
    prompts = [prompt_tokens(n, salt=i) for i, n in enumerate(PROMPT_LENGTHS)]
    caches = [caches_for(model, method, 12) for _ in prompts]
    r = mlx_lm.batch_generate(model, FakeTokenizer(), prompts, prompt_caches=caches, max_tokens=10,
                              return_token_ids=True)
    solo = [[int(t) for t, _ in generate_step(mx.array(p), model, prompt_cache=caches_for(model, method, 12),
                                              max_tokens=10)] for p in prompts]
    assert r.token_ids == solo


@pytest.mark.parametrize("method", METHODS)
def test_requests_joining_a_running_batch_equal_their_solo_runs(model, method):
    """Bug (kvzip, found under ``kvcompress serve``): two fresh requests merged, then joined to
    a running batch whose row still waited for its next reconstruction, read rows out of bounds
    (a segfault, or another row's text): a component's ``stack_rows`` was not told how many rows
    a fresh state holds. Requests arriving while another runs generate what they would alone."""
    from mlx_lm.generate import BatchGenerator

    prompts = [prompt_tokens(n, salt=i) for i, n in enumerate((37, 11, 11))]
    solo = [[int(t) for t, _ in generate_step(mx.array(p), model, prompt_cache=caches_for(model, method, 12),
                                              max_tokens=6)] for p in prompts]
    gen = BatchGenerator(model, max_tokens=6)
    uids = gen.insert(prompts[:1], caches=[caches_for(model, method, 12)])
    toks = {uids[0]: []}
    for i in range(200):
        if i == 1:  # the first request is running: two more arrive together
            uids = uids + gen.insert(prompts[1:], caches=[caches_for(model, method, 12) for _ in prompts[1:]])
            toks.update({u: [] for u in uids[1:]})
        for r in gen.next()[1]:
            toks[r.uid].append(r.token)
        if len(uids) == 3 and all(len(toks[u]) >= 6 for u in uids):
            break
    gen.close()
    assert [toks[u] for u in uids] == solo


@pytest.mark.parametrize("target", ["nearest", "window"])
def test_cam_batch_rows_merge_into_the_same_targets_as_alone(model, target):
    """Bug (found by these tests, fixed in plugins/kvcompress_cam/merge.py): in a batch whose rows
    free different numbers of slots, CaM excluded every entry of ``ev.evict`` from the merge
    targets -- also the entries a row does not free (``ev.real`` False) -- so a row merged into
    other survivors than it would alone (its logits and ``batch_generate`` tokens differed)."""
    kw = dict(target=target, merge_window=4, merge_gate=False)
    solos = []
    for i, n in enumerate(PROMPT_LENGTHS):  # rows free 9, 22 and 0 slots at the next step
        c = caches_for(model, "cam", 12, **kw)
        model(mx.array([prompt_tokens(n, salt=i)]), cache=c)
        solos.append(c)
    batch = [type(layer[0]).merge(list(layer)) for layer in zip(*copy.deepcopy(solos))]
    got = _feed(model, batch, [[3], [4], [5]])
    for j, (t, solo) in enumerate(zip((3, 4, 5), solos)):
        np.testing.assert_allclose(got[j], _feed(model, solo, [[t]])[0], atol=2e-4, rtol=0)
    assert [s[0].diagnostics["merges"] for s in solos] == batch[0].diagnostics["merges"]
    assert batch[0].diagnostics["merges"][1] > 0


def _feed(model, caches, tokens):
    return np.array(model(mx.array(tokens), cache=caches)[:, -1].astype(mx.float32))


@pytest.mark.parametrize("method", METHODS)
def test_batch_rows_extract_filter_extend_follow_their_solo_caches(model, method):
    """Bug: no batch cache, so no ``extract`` / ``filter`` / ``extend`` (mlx-lm's BatchGenerator
    uses them when rows finish or join). A batch built from solo caches at different lengths
    keeps every row on its solo cache's course through decode steps, a ``filter`` and an
    ``extend`` mid-decode, and ``extract(i)`` continues like the solo cache: the same greedy
    tokens, the same kept positions, offsets and budgets, logits equal up to float rounding
    (a row's slots may sit in another order than the solo cache's)."""
    if not batches_uneven(method):
        pytest.skip(f"{method}: the disposition cannot yet batch rows that free different numbers of tokens")
    solos = []
    for i, n in enumerate(PROMPT_LENGTHS):
        c = caches_for(model, method, 12)
        model(mx.array([prompt_tokens(n, salt=i)]), cache=c)
        solos.append(c)
    rows = [0, 1, 2]
    batch = [type(layer[0]).merge(list(layer)) for layer in zip(*copy.deepcopy(solos))]
    nxt = [3, 4, 5]

    def step(k):
        for _ in range(k):
            got = _feed(model, batch, [[nxt[r]] for r in rows])
            for j, r in enumerate(rows):
                want = _feed(model, solos[r], [[nxt[r]]])[0]
                np.testing.assert_allclose(got[j], want, atol=2e-4, rtol=0)
                assert int(np.argmax(got[j])) == int(np.argmax(want))
                nxt[r] = int(np.argmax(want))
                for layer, s in zip(batch, solos[r]):
                    assert int(layer.offset.tolist()[j]) == s.offset
                    assert (layer.tokens_kept[j], layer.budget[j], layer.evictions[j]) == (s.tokens_kept, s.budget, s.evictions)
                    np.testing.assert_array_equal(held(layer, j), held(s))

    step(4)
    for c in batch:
        c.filter([0, 2])
    rows = [0, 2]
    step(3)
    more = [type(c).merge([c]) for c in copy.deepcopy(solos[1])]
    for c, m in zip(batch, more):
        c.extend(m)
    rows = [0, 2, 1]
    step(3)
    for j, r in enumerate(rows):
        ex = [c.extract(j) for c in batch]
        t = nxt[r]
        a_toks, a_logits = greedy(model, ex, t, 4)
        b_toks, b_logits = greedy(model, solos[r], t, 4)
        assert a_toks == b_toks
        for x, y in zip(a_logits, b_logits):
            np.testing.assert_allclose(x, y, atol=2e-4, rtol=0)
        for x, s in zip(ex, solos[r]):
            np.testing.assert_array_equal(held(x), held(s))
            assert (x.offset, x.tokens_kept, x.budget, x.evictions) == (s.offset, s.tokens_kept, s.budget, s.evictions)


@pytest.mark.model
@pytest.mark.parametrize("method", ["cam", "h2o", "snapkv"])
def test_batch_generate_on_the_trained_model(stories_model, method):
    """The batch_generate property on a trained model with its real tokenizer (decisive greedy
    choices, no near ties): every row equals its solo run."""
    model, tok = stories_model
    prompts = [tok.encode(t) for t in ("Once upon a time, there was a little girl named Lily.",
                                       "Tom had a red ball.",
                                       "One day, a big dog came to the park and saw a cat sitting on the bench.")]
    kw = dict(budget=16, **PARAMS.get(method, {}))
    caches = [kvcompress.make_prompt_cache(model, method, **kw) for _ in prompts]
    r = mlx_lm.batch_generate(model, tok, prompts, prompt_caches=caches, max_tokens=20, return_token_ids=True)
    solo = []
    for p in prompts:
        out = []
        for t, _ in generate_step(mx.array(p), model, prompt_cache=kvcompress.make_prompt_cache(model, method, **kw),
                                  max_tokens=20):
            out.append(int(t))
            if int(t) in tok.eos_token_ids:
                break
        solo.append([t for t in out if t not in tok.eos_token_ids])
    assert r.token_ids == solo
