"""mlx-lm generation for the contract runs, and the runs' checks that compare whole generations:

* the tiny random Llama the runs use (:func:`tiny_llama`), greedy generation through
  :func:`mlx_lm.generate.generate_step` and continuous batching through ``BatchGenerator``;
* **save/load** -- the loaded caches equal the saved ones and decode on with the same logits;
* **exact without eviction** -- with a budget above the sequence, mlx-lm's ``KVCache``'s tokens
  and log-probabilities;
* **batched** -- rows of different lengths batched generate what each generates alone.

(:mod:`kvcompress._contracts.runs` drives them; see its docstring for every check.)
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Protocol

import attrs
import mlx.core as mx
import numpy as np

from ..cache import CompressedKVCache
from ..components import KINDS
from ..errors import ConfigError
from ..persistence import load_prompt_cache, save_prompt_cache
from . import ensure, fail

__all__ = ["tiny_llama"]

_REFERENCE: dict = {}  # KVCache generations, by (vocab, prompt, step, decode)


class _Harness(Protocol):
    """What these checks use of the runs' harness (:mod:`kvcompress._contracts.runs`, which
    imports this module)."""

    method: Any

    def caches(self, model, float_storage: bool = False, **extra) -> list: ...

    def run(self, prompt, step, dtype=mx.float32, log: bool = True, **extra) -> tuple: ...


def tiny_llama(n_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 97,
               seed: int = 0, dtype=mx.float32):
    """A random-weight mlx-lm Llama (GQA, head_dim = hidden / heads), built in memory.

    Seeds MLX's global generator with ``seed`` so the same arguments give the same weights.
    """
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=n_layers,
        intermediate_size=2 * hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5, vocab_size=vocab, rope_theta=10000.0, tie_word_embeddings=True,
    )
    model = llama.Model(args)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def model_for(method, **kw):
    """The runs' tiny Llama for ``method``: head_dim 16, or one kv_group_size for low-bit storage."""
    st = method.storage
    return tiny_llama(hidden=4 * st.group_size if st.quantized else 64, **kw)


def _compressed(caches) -> list:
    return [c for c in caches if isinstance(c, CompressedKVCache)]


def _generate(model, prompt, caches, step: int, n: int):
    from mlx_lm.generate import generate_step

    toks, lps = [], []
    for t, lp in generate_step(prompt, model, prompt_cache=caches, prefill_step_size=step, max_tokens=n):
        toks.append(int(t))
        lps.append(lp)
    mx.eval(lps)
    return toks, lps


def _state_arrays(c) -> list:
    from mlx.utils import tree_flatten

    return [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]  # low-bit stores are (codes, scales, biases)


def _states_equal(a, b) -> bool:
    sa, sb = _state_arrays(a), _state_arrays(b)
    return len(sa) == len(sb) and all(
        x.shape == y.shape and x.dtype == y.dtype and bool(mx.array_equal(x, y, equal_nan=True)) for x, y in zip(sa, sb)
    )


def _meta(c) -> dict:
    return json.loads(c.state[-1])


def _check_save_load(model, caches, report, settings) -> None:
    s = report.subject
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cache.safetensors")
        save_prompt_cache(path, caches)
        loaded = load_prompt_cache(path)
    ensure(len(loaded) == len(caches), s, "save/load", f"{len(caches)} layers saved, {len(loaded)} loaded")
    for a, b in zip(caches, loaded):
        ensure(type(a) is type(b), s, "save/load", f"{type(a).__name__} came back as {type(b).__name__}")
        if isinstance(a, CompressedKVCache):
            ensure(_states_equal(a, b) and _meta(a) == _meta(b) and a.budget == b.budget, s, "save/load",
                   f"layer {a.layer}: the loaded state differs from the saved one")
    rng = np.random.default_rng(settings.seed + 1)
    for i, tok in enumerate(rng.integers(1, settings.vocab, 3)):
        x = mx.array([[int(tok)]], dtype=mx.int32)
        la, lb = model(x, cache=caches), model(x, cache=loaded)
        diff = float(mx.abs(la - lb).max())
        ensure(diff <= settings.atol, s, "save/load",
               f"decode step {i} after loading: logits differ by {diff:.3g} from the original cache")
    for a, b in zip(_compressed(caches), _compressed(loaded)):
        ensure(_states_equal(a, b), s, "save/load", f"layer {a.layer}: states diverge after decoding on")
    report.ok("save/load")


def _check_exact(h: _Harness, prompt, step, report, settings) -> None:
    s = report.subject
    seen = len(prompt) + settings.decode
    key = (settings.vocab, tuple(prompt.tolist()), step, settings.decode)
    if key not in _REFERENCE:
        from mlx_lm.models.cache import KVCache

        model = tiny_llama(vocab=settings.vocab)
        _REFERENCE[key] = _generate(model, prompt, [KVCache() for _ in model.layers], step, settings.decode)
    ref_toks, ref_lps = _REFERENCE[key]
    takes_budget = any("budget" in attrs.fields_dict(type(h.method.component(k))) for k in KINDS)
    if not takes_budget:
        report.skip("exact without eviction", "no component has a 'budget' parameter to raise")
        return
    if h.method.storage.quantized:
        report.skip("exact without eviction", "low-bit storage is not KVCache's float storage")
        return
    roomy = seen + 1
    for _ in range(12):
        try:
            _, caches, toks, lps = h.run(prompt, step, budget=roomy)
        except ConfigError:
            roomy *= 2
            continue
        if all(c.evictions == 0 for c in _compressed(caches)):
            break
        roomy *= 2
    else:
        raise fail(s, "exact without eviction", f"no budget up to {roomy} avoided eviction of {seen} tokens")
    ensure(toks == ref_toks, s, "exact without eviction",
           f"with budget {roomy} >= {seen} tokens the greedy tokens differ from KVCache's")
    worst = max(float(mx.abs(a - b).max()) for a, b in zip(lps, ref_lps))
    ensure(worst <= settings.atol, s, "exact without eviction",
           f"with budget {roomy} >= {seen} tokens log-probabilities differ from KVCache's by {worst:.3g}")
    report.ok("exact without eviction")
    report.details["exact_max_diff"] = worst


def _batch_generate(model, prompts, caches, step: int, n: int):
    """mlx-lm's continuous batching: ``BatchGenerator`` merges the per-sequence caches into one
    batch cache (``caches[0][i].merge(...)``) and right-pads the prompts chunk by chunk."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=n, prefill_step_size=step)
    try:
        uids = gen.insert(prompts, caches=caches)
        toks, lps = {u: [] for u in uids}, {u: [] for u in uids}
        for _ in range(sum(len(p) for p in prompts) + 10 * n):
            _, responses = gen.next()
            for r in responses:
                toks[r.uid].append(int(r.token))
                lps[r.uid].append(r.logprobs)
            if all(len(toks[u]) >= n for u in uids):
                break
    finally:
        gen.close()
    return [(toks[u][:n], lps[u][:n]) for u in uids]


def _check_batched(h: _Harness, prompt, step, report, settings, extra) -> None:
    s = report.subject
    n = len(prompt)
    # three rows: the prompt, a shorter one that still evicts, one that never reaches the budget
    lengths = [n, n - 7, max(step // 2, 3)]
    prompts = [prompt[-m:].tolist() for m in lengths]
    model = model_for(h.method, vocab=settings.vocab)
    alone = [_generate(model, mx.array(p), h.caches(model, **extra), step, settings.decode) for p in prompts]
    try:
        batched = _batch_generate(model, prompts, [h.caches(model, **extra) for _ in prompts], step, settings.decode)
    except Exception as exc:
        raise fail(s, "batched", f"mlx-lm's BatchGenerator failed on rows of lengths {lengths}: "
                   f"{type(exc).__name__}: {exc}") from exc
    tols = [1e-4] * len(prompts)
    if h.method.storage.quantized:
        # low-bit codes round: a 1e-6 float difference upstream (another matmul shape) can move a
        # value across a rounding boundary, so rows agree to a fraction of what the storage itself
        # changes (the same row with float storage), not to float rounding
        floats = [_generate(model, mx.array(p), h.caches(model, float_storage=True, **extra), step, settings.decode)
                  for p in prompts]
        tols = [max(1e-4, 0.25 * max(float(mx.abs(a - b).max()) for a, b in zip(f[1], q[1])))
                for f, q in zip(floats, alone)]
    for r, ((toks, lps), (ref_toks, ref_lps)) in enumerate(zip(batched, alone)):
        ensure(toks == ref_toks, s, "batched",
               f"row {r} (a {lengths[r]}-token prompt) batched with rows of lengths {lengths} generated "
               f"{toks}; alone it generates {ref_toks}")
        worst = max(float(mx.abs(a - b).max()) for a, b in zip(lps, ref_lps))
        ensure(worst <= tols[r], s, "batched",
               f"row {r} (a {lengths[r]}-token prompt) batched with rows of lengths {lengths}: "
               f"log-probabilities differ from its solo run by {worst:.3g}")
    report.ok("batched")
