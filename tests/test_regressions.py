"""One regression test per bug of the review "Core contracts, one attention path, and the bugs a
review found" (each fails on commit 104e127 and passes since the engine rewrite), plus the bugs
these tests found afterwards. Each test's docstring names the bug it catches.
"""

from __future__ import annotations

import copy
import functools
import gc
import inspect
import json
import os
import re
import subprocess
import sys
import types
import warnings
import weakref
from pathlib import Path
from unittest import mock

import attrs
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models import cache as mlx_cache

import kvcompress
from conftest import REPO, tiny_llama

METHODS = sorted(kvcompress.get_registry().methods)
#: small windows / chunks so that small budgets evict (the methods' defaults are 32 / 10)
PARAMS = {
    "snapkv": dict(recent=4),
    "pyramidkv": dict(recent=4),
    "snapkv_merge": dict(recent=4),
    "chunkkv": dict(recent=4, chunk=4),
    "tova_chunk": dict(chunk=4),
}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=97, seed=0)


def caches_for(model, method: str, want: int = 12, **params) -> list:
    """``make_prompt_cache`` with the smallest budget >= ``want`` the method accepts."""
    params = {**PARAMS.get(method, {}), **params}
    b = max(want, kvcompress.build_method(method, **params).selector.reserved(want) + 1)
    for _ in range(64):
        try:
            return kvcompress.make_prompt_cache(model, method, budget=b, **params)
        except kvcompress.ConfigError:
            b += 1
    raise AssertionError(f"no budget accepted by {method}")


def prompt_tokens(n: int, salt: int = 0) -> list:
    return [(7 * i + 3 + salt) % 96 + 1 for i in range(n)]


def greedy(model, caches, token: int, n: int):
    """``n`` greedy steps from ``token``: (tokens, float32 logits of each step)."""
    toks, logits = [], []
    for _ in range(n):
        out = model(mx.array([[token]]), cache=caches)[0, -1].astype(mx.float32)
        token = int(mx.argmax(out).item())
        toks.append(token)
        logits.append(np.array(out))
    return toks, logits


def held(c, row: int = 0) -> np.ndarray:
    """``[H, W]`` sorted positions each KV head holds, padded with -1 (head-wise budgets let
    heads hold different counts)."""
    pos = np.array(c.head_view()[2])[row]
    rows = [np.sort(p[p >= 0]) for p in pos]
    w = max(len(r) for r in rows)
    return np.stack([np.pad(r, (0, w - len(r)), constant_values=-1) for r in rows])


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


@functools.lru_cache(maxsize=None)
def batchable(method: str) -> bool:
    """Whether the method's caches batch rows that free different numbers of slots in one step
    (kivi's disposition could not when these tests were written; it is being fixed)."""
    m = tiny_llama(n_layers=1, hidden=32, heads=4, kv_heads=2, vocab=97, seed=1)
    a, b = caches_for(m, method), caches_for(m, method)
    m(mx.array([prompt_tokens(30)]), cache=a)
    m(mx.array([prompt_tokens(3)]), cache=b)
    batch = [type(x).merge([x, y]) for x, y in zip(a, b)]
    try:
        mx.eval(m(mx.array([[5], [6]]), cache=batch))
    except kvcompress.ConfigError:
        return False
    return True


class FakeTokenizer:
    """What ``mlx_lm.batch_generate`` needs from a tokenizer."""

    eos_token_ids = [10_000]  # never generated: every row runs max_tokens steps

    def decode(self, ids):
        return " ".join(map(str, ids))


# ------------------------------------------------------------------------------------------
# SqueezeAttention: budgets live in the caches, not in the model
# ------------------------------------------------------------------------------------------


def _caches_reachable_from(root) -> list:
    """kvcompress caches / prompt groups reachable from ``root`` through object references
    (weak references followed; module globals, classes of builtins and arrays not entered)."""
    from kvcompress._engine import _Engine
    from kvcompress.group import PromptGroup

    module_dicts = {id(vars(m)) for m in list(sys.modules.values()) if m is not None and hasattr(m, "__dict__")}
    seen, stack, found = set(), [root], []
    while stack and len(seen) < 400_000:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, (_Engine, PromptGroup)):
            found.append(o)
            continue
        if isinstance(o, weakref.ref):
            target = o()
            if target is not None:
                stack.append(target)
            continue
        if isinstance(o, (types.ModuleType, mx.array, str, bytes, int, float)) or id(o) in module_dicts:
            continue
        if isinstance(o, type) and o.__module__ == "builtins":
            continue
        stack.extend(gc.get_referents(o))
    return found


def test_squeeze_two_caches_on_one_model_each_resplit_like_a_single_cache():
    """Bug: SqueezeAttention installed a per-call prompt recorder into the model (class swap,
    state keyed on the caches' ``id``). A second ``make_prompt_cache`` on the same model rebound
    it, so the FIRST cache list kept uniform budgets; a deep copy of a cache list was not
    recorded either; and the model kept references to the caches after generation."""
    prompt = mx.array(prompt_tokens(40))
    kw = dict(budget=16)

    alone_model = tiny_llama(n_layers=4, hidden=32, seed=5)
    alone = kvcompress.make_prompt_cache(alone_model, "squeeze", **kw)
    alone_tokens = [int(t) for t, _ in generate_step(prompt, alone_model, prompt_cache=alone, max_tokens=8)]
    budgets = [c.budget for c in alone]
    assert len(set(budgets)) > 1, f"the prompt did not re-split the budgets: {budgets}"

    model = tiny_llama(n_layers=4, hidden=32, seed=5)
    first = kvcompress.make_prompt_cache(model, "squeeze", **kw)
    pristine = copy.deepcopy(first)  # copied before the prompt
    second = kvcompress.make_prompt_cache(model, "squeeze", **kw)
    first_tokens = [int(t) for t, _ in generate_step(prompt, model, prompt_cache=first, max_tokens=8)]
    assert [c.budget for c in first] == budgets
    assert first_tokens == alone_tokens

    copy_tokens = [int(t) for t, _ in generate_step(prompt, model, prompt_cache=pristine, max_tokens=8)]
    assert [c.budget for c in pristine] == budgets and copy_tokens == alone_tokens
    second_tokens = [int(t) for t, _ in generate_step(prompt, model, prompt_cache=second, max_tokens=8)]
    assert [c.budget for c in second] == budgets and second_tokens == alone_tokens

    found = _caches_reachable_from(model)
    assert not found, f"the model holds references to {len(found)} cache object(s): {found[:3]}"


# ------------------------------------------------------------------------------------------
# ChunkKV layer-wise index reuse survives save/load
# ------------------------------------------------------------------------------------------


def test_chunkkv_index_reuse_survives_save_and_load(model, tmp_path):
    """Bug: ChunkKV's layer-wise index reuse shared layer 0's eviction indices through a dict
    held by the caches of one ``make_prompt_cache`` call; a loaded cache list lost it, so after
    a reload layer 1 chose its own chunks and the run diverged from the unsaved one."""
    kw = dict(budget=16, recent=4, chunk=4, n_sink=0)
    caches = kvcompress.make_prompt_cache(model, "chunkkv", reuse_layers=2, **kw)
    own = kvcompress.make_prompt_cache(model, "chunkkv", reuse_layers=1, **kw)
    prompt = mx.array([prompt_tokens(40)])
    model(prompt, cache=caches)
    model(prompt, cache=own)
    greedy(model, caches, 5, 6)
    greedy(model, own, 5, 6)
    assert (held(caches[0]) == held(caches[1])).all()
    # without reuse the layers choose differently here (so the comparison below means something)
    assert not np.array_equal(held(own[0]), held(own[1]))

    path = str(tmp_path / "chunk.safetensors")
    kvcompress.save_prompt_cache(path, caches)
    loaded = kvcompress.load_prompt_cache(path)
    # a chunk, then decode steps: the step after the chunk frees several chunks at once
    steps = [prompt_tokens(20, salt=9)] + [[11 + i] for i in range(10)]
    for step, tokens in enumerate(steps):
        a = model(mx.array([tokens]), cache=caches)
        b = model(mx.array([tokens]), cache=loaded)
        assert mx.array_equal(a, b).item(), f"step {step}: the loaded cache diverged"
        for x, y in zip(caches, loaded):
            np.testing.assert_array_equal(held(x), held(y))
        np.testing.assert_array_equal(held(loaded[0]), held(loaded[1]), err_msg="layer 1 no longer reuses layer 0")
    assert loaded[0].evictions == caches[0].evictions > 0


# ------------------------------------------------------------------------------------------
# Compression figures
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["kivi", "h2o"])
def test_diagnostics_report_token_and_byte_compression(method):
    """Bug: diagnostics reported one ``compression_ratio`` (tokens seen / tokens held), which
    for KIVI -- whose evicted tokens stay in a quantized store -- overstated the memory saved.
    Now ``compression_tokens`` (offset / held tokens) and ``compression_bytes`` (the bytes
    mlx-lm's KVCache holds for the same tokens / ``cache.nbytes``) are both reported."""
    model = tiny_llama(n_layers=2, hidden=64, heads=4, kv_heads=2, vocab=97, seed=2, dtype=mx.float16)
    caches = kvcompress.make_prompt_cache(model, method, budget=16)
    plain = [mlx_cache.KVCache() for _ in model.layers]
    tokens = mx.array([prompt_tokens(512)])
    for c in (caches, plain):
        model(tokens[:, :448], cache=c)  # two prompt chunks, then a decode step
        model(tokens[:, 448:511], cache=c)
        model(tokens[:, 511:], cache=c)
    for c, p in zip(caches, plain):
        d = c.diagnostics
        kept = held(c).shape[1]
        assert d["offset"] == p.offset == 512
        assert d["tokens_kept"] == kept == c.tokens_kept
        assert d["compression_tokens"] == pytest.approx(512 / kept)
        state_bytes = sum(x.nbytes for x in c.state if not isinstance(x, str))
        assert d["nbytes"] == c.nbytes >= state_bytes  # nothing the cache holds is left out
        assert d["compression_bytes"] == pytest.approx(p.nbytes / c.nbytes)
        if method == "kivi":
            assert d["quantized_tokens"] > 0
            assert d["compression_bytes"] < d["compression_tokens"] / 4, d
        else:
            assert d["compression_bytes"] > 1


# ------------------------------------------------------------------------------------------
# Prefill work: the fused attention + mass only where a scorer needs the step mass
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method, fused", [("snapkv", False), ("tova", False), ("chunkkv", False), ("h2o", True)])
def test_fused_attention_mass_only_for_step_mass_scorers(model, monkeypatch, method, fused):
    """Bug: every query-based scorer made a compressing prefill chunk run the float32
    attention-with-mass instead of mlx-lm's attention, although SnapKV / TOVA / ChunkKV only
    read the last queries' attention: wasted prefill work. Only scorers that require
    ``step_mass`` (H2O) get it."""
    calls = []
    ops = getattr(kvcompress, "ops", None)
    if ops is not None:
        real = ops.attention

        def spy(queries, keys, values, *args, **kwargs):
            calls.append(values is not None and kwargs.get("mass") is not None)
            return real(queries, keys, values, *args, **kwargs)

        monkeypatch.setattr(ops, "attention", spy)
    else:  # before the rewrite: the fused call lived in kvcompress.cache
        import kvcompress.cache as old

        real_old = old.attention_with_mass

        def spy_old(*args, **kwargs):
            calls.append(True)
            return real_old(*args, **kwargs)

        monkeypatch.setattr(old, "attention_with_mass", spy_old)
    caches = caches_for(model, method, 12)
    tokens = mx.array([prompt_tokens(48)])
    for i in range(0, 48, 16):  # chunked prefill: the 2nd and 3rd chunks compress
        mx.eval(model(tokens[:, i : i + 16], cache=caches))
    assert caches[0].evictions > 0
    assert any(calls) == fused, f"{method}: fused attention+mass calls {sum(calls)}"


# ------------------------------------------------------------------------------------------
# Sliding-window masks are refused when the cache is built
# ------------------------------------------------------------------------------------------


def _cohere2(pattern: int):
    from mlx_lm.models import cohere2

    mx.random.seed(0)
    args = cohere2.ModelArgs(
        model_type="cohere2", hidden_size=32, head_dim=8, num_hidden_layers=2 * pattern, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=97, sliding_window=8, sliding_window_pattern=pattern,
    )
    return cohere2.Model(args)


def test_window_mask_over_full_attention_layers_is_refused_at_build():
    """Bug: a model that asks a full-attention layer's cache for a sliding-window mask (Cohere 2
    with ``sliding_window_pattern=1``: every layer is a KVCache and the window mask is made from
    layer 0's cache) built its compressed caches fine and then failed in the middle of
    generation. It is now a ConfigError from ``make_prompt_cache``.

    (A Llama with ``sliding_window`` and no ``layer_types`` is not such a model in mlx-lm 0.32:
    its ``ModelArgs`` fills ``layer_types`` with full attention and it never windows them, so it
    is -- rightly -- accepted; see the next test.)"""
    with pytest.raises(kvcompress.ConfigError, match="sliding"):
        kvcompress.make_prompt_cache(_cohere2(1), "h2o", budget=12)


def test_models_whose_window_has_rotating_caches_are_compressed():
    """Bug (found by these tests, fixed in kvcompress/factory.py): the build-time window check
    refused every model with a ``sliding_window`` and no ``layer_types`` -- Gemma 3 and Cohere 2,
    whose windowed layers have their own RotatingKVCache and whose full-attention layers are not
    windowed -- which 104e127 compressed correctly. A Llama with ``sliding_window`` but only
    full-attention layers is accepted too."""
    from mlx_lm.models import gemma3_text, llama

    mx.random.seed(0)
    gemma = gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=32, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        head_dim=8, num_key_value_heads=2, vocab_size=97, sliding_window=8, sliding_window_pattern=2,
    ))
    plain_llama = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97, sliding_window=8,
    ))
    for m in (gemma, _cohere2(2), plain_llama):
        caches = kvcompress.make_prompt_cache(m, "h2o", budget=12)
        kinds = [type(c).__name__ for c in caches]
        assert "CompressedKVCache" in kinds, kinds
        toks = [int(t) for t, _ in generate_step(mx.array(prompt_tokens(30)), m, prompt_cache=caches, max_tokens=4)]
        assert len(toks) == 4
        offsets = {c.offset for c in caches if isinstance(c, kvcompress.CompressedKVCache)}
        assert len(offsets) == 1 and offsets.pop() >= 33


# ------------------------------------------------------------------------------------------
# cache.state does not sync the device
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_cache_state_makes_no_host_sync(model, method):
    """Bug: ``cache.state`` (which mlx-lm evaluates after every prefill chunk, for every layer)
    called ``.item()`` on CaM's merge counter, a device->host sync per layer per chunk. The
    metadata must be built from host values only: reading ``state`` with ``mx.array.item`` /
    ``tolist`` / conversions to Python numbers patched to fail must work."""
    caches = caches_for(model, method, 12)
    model(mx.array([prompt_tokens(30)]), cache=caches)
    greedy(model, caches, 3, 3)
    boom = AssertionError("cache.state synchronised the device")
    patches = [mock.patch.object(mx.array, name, side_effect=boom)
               for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")]
    for p in patches:
        p.start()
    try:
        states = [c.state for c in caches]
    finally:
        for p in patches:
            p.stop()
    mx.eval(states)
    for c, s in zip(caches, states):
        assert isinstance(s[-1], str) and json.loads(s[-1])["rows_off"] == [c.offset]


# ------------------------------------------------------------------------------------------
# A cache loaded in a fresh process continues like the uninterrupted run
# ------------------------------------------------------------------------------------------

_GREEDY_SRC = '''
def greedy_digest(model, caches, token, n):
    """n greedy steps: the tokens and a digest of every step's logits (bit-exact)."""
    import hashlib
    import mlx.core as mx
    import numpy as np
    out, h = [], hashlib.sha256()
    for _ in range(n):
        logits = model(mx.array([[token]]), cache=caches)[0, -1].astype(mx.float32)
        token = int(mx.argmax(logits).item())
        out.append(token)
        h.update(np.array(logits).tobytes())
    return out, h.hexdigest()
'''

_CHILD = '''
import json, sys
sys.path.insert(0, {tests!r})
from conftest import tiny_llama
import kvcompress
{greedy}
model = tiny_llama(**{model_kw!r})
out = {{}}
for method, path, token in {jobs!r}:
    installed = kvcompress.is_installed(model)
    caches = kvcompress.load_prompt_cache(path)
    toks, digest = greedy_digest(model, caches, token, {steps})
    out[method] = dict(tokens=toks, digest=digest, sources=[c.score_source for c in caches], installed_before=installed,
                       offsets=[c.offset for c in caches])
print("RESULT" + json.dumps(out))
'''


def test_cache_loaded_in_a_fresh_process_continues_like_the_uninterrupted_run(tmp_path):
    """Bug: the query-observing attention wrapper was installed only by ``make_prompt_cache`` /
    ``kvcompress.install``, so a cache loaded in a fresh process scored with the key-as-query
    proxy and evicted other tokens than the uninterrupted run. It is now installed on the first
    update of any kvcompress cache: 40 greedy steps after loading equal the uninterrupted run's
    (tokens and bit-exact logits), with real-query scores."""
    model_kw = dict(n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=97, seed=7)
    model = tiny_llama(**model_kw)
    steps = 40
    scope: dict = {}
    exec(_GREEDY_SRC, scope)
    jobs, expected = [], {}
    for method in ("h2o", "cam", "snapkv"):
        # no recent window for h2o / cam: every eviction is decided by the scores
        caches = caches_for(model, method, 16, **({} if method == "snapkv" else {"recent_ratio": 0.0}))
        model(mx.array([prompt_tokens(30, salt=3)]), cache=caches)
        toks, _ = greedy(model, caches, 5, 4)
        path = str(tmp_path / f"{method}.safetensors")
        kvcompress.save_prompt_cache(path, caches)
        expected[method] = scope["greedy_digest"](model, caches, toks[-1], steps)
        assert caches[0].evictions > 0
        jobs.append((method, path, toks[-1]))
    code = _CHILD.format(tests=str(REPO / "tests"), greedy=_GREEDY_SRC, model_kw=model_kw, jobs=jobs, steps=steps)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(kvcompress.__file__).parents[1]),
                                         str(Path(kvcompress.__file__).parents[1] / "plugins"),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.split("RESULT", 1)[1])
    for method in expected:
        assert (got[method]["tokens"], got[method]["digest"]) == expected[method], method
        assert got[method]["sources"] == ["queries"] * 2, (method, got[method])
        assert got[method]["offsets"] == [30 + 4 + steps] * 2


# ------------------------------------------------------------------------------------------
# Saved files: damage is detected; mlx-lm's own loader reads them
# ------------------------------------------------------------------------------------------


def _saved(model, tmp_path):
    caches = caches_for(model, "cam", 12)
    model(mx.array([prompt_tokens(30)]), cache=caches)
    greedy(model, caches, 3, 3)
    path = tmp_path / "cache.safetensors"
    kvcompress.save_prompt_cache(str(path), caches)
    return caches, path


def _header(data: bytes) -> tuple[int, str]:
    n = int.from_bytes(data[:8], "little")
    return n, data[8 : 8 + n].decode()


def test_damaged_cache_files_raise_corrupt_cache_file(model, tmp_path):
    """Bug: a prompt-cache file damaged in its header or its tensor data loaded silently (or
    failed with an unrelated exception), so a cache that was not the saved one could continue a
    generation. Every such file now raises :class:`kvcompress.CorruptCacheFile` naming it."""
    _, path = _saved(model, tmp_path)
    data = path.read_bytes()
    n, header = _header(data)
    flips = {}
    m = re.search(r'"data_offsets":\[\d+,(\d)', header)  # a tensor's end offset
    flips["data_offsets"] = 8 + m.start(1)
    m = re.search(r"CompressedKVCache", header)  # a layer's class name
    flips["class name"] = 8 + m.start() + 3
    m = re.search(r'kvcompress_digest":"([0-9a-f])', header)  # the digest itself
    if m:
        flips["digest"] = 8 + m.start(1)
    flips["first tensor byte"] = 8 + n
    flips["middle tensor byte"] = 8 + n + (len(data) - 8 - n) // 2
    flips["last byte"] = len(data) - 1
    for what, at in flips.items():
        bad = bytearray(data)
        if at >= 8 + n:
            bad[at] ^= 0x01
        else:  # a digit stays a digit, a letter a letter: the header is still valid JSON
            old = chr(bad[at])
            bad[at] = ord(str((int(old) + 1) % 10) if old.isdigit() else ("a" if old == "f" else chr(ord(old) + 1)))
        target = tmp_path / f"bad-{what.replace(' ', '_')}.safetensors"
        target.write_bytes(bytes(bad))
        with pytest.raises(kvcompress.CorruptCacheFile, match=re.escape(str(target))):
            kvcompress.load_prompt_cache(str(target))


def test_mlx_lm_loader_reads_kvcompress_files(model, tmp_path):
    """Bug: mlx-lm's own ``load_prompt_cache`` could not read a file with compressed layers (it
    only knows its own classes), so ``mlx_lm.generate --prompt-cache-file`` and other tools
    failed on them. The classes are registered with mlx-lm; its loader's caches continue
    bit-identically."""
    caches, path = _saved(model, tmp_path)
    loaded = mlx_cache.load_prompt_cache(str(path))
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    a_toks, a_logits = greedy(model, caches, 9, 12)
    b_toks, b_logits = greedy(model, loaded, 9, 12)
    assert a_toks == b_toks
    for x, y in zip(a_logits, b_logits):
        np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------------------------------------
# Component contract
# ------------------------------------------------------------------------------------------


def test_selection_and_eviction_are_keyword_only():
    """Bug: ``Selection`` / ``Eviction`` (and the other contexts) could be built positionally,
    so a plugin written against one field order silently passed scores as positions after a
    field was added. They are keyword-only now."""
    for cls in (kvcompress.Selection, kvcompress.Eviction, kvcompress.Observation):
        kinds = {p.kind for p in inspect.signature(cls).parameters.values()}
        assert kinds == {inspect.Parameter.KEYWORD_ONLY}, (cls.__name__, kinds)
    z = mx.zeros((1, 1, 4))
    with pytest.raises(TypeError):
        kvcompress.Selection(z, z.astype(mx.int32), z > 0, 1, 4, z, (4,), kvcompress.LayerInfo())
    sel = kvcompress.Selection(scores=z, positions=z.astype(mx.int32), protected=z > 0, n_evict=1, budget=4,
                               offset=z, offsets=(4,), layer=kvcompress.LayerInfo())
    assert sel.n_evict == 1


def _plugin(kind: str, name: str, cls) -> types.SimpleNamespace:
    hook = f"kvcompress_{kind}s"

    @kvcompress.hookimpl(specname=hook)
    def provide():
        return [kvcompress.ComponentSpec(kind, name, cls, "test component")]

    return types.SimpleNamespace(provide=provide)


def _scorer(**methods):
    return attrs.frozen(type("S", (), {"requires": frozenset(), "provides": frozenset(),
                                       "observe": lambda self, scores, obs: scores, **methods}))


def _selector(**methods):
    return attrs.frozen(type("L", (), {"requires": frozenset(), "provides": frozenset(),
                                       "reserved": lambda self, b: 0, "protected": lambda self, p, o, b: p < 0,
                                       "select": lambda self, sel: None, **methods}))


def _disposition(**methods):
    return attrs.frozen(type("D", (), {"requires": frozenset(), "provides": frozenset(),
                                       "dispose": lambda self, ev: (ev.keys, ev.values, ev.scores), **methods}))


@pytest.mark.parametrize("kind, make, hook", [
    ("scorer", _scorer, "init_sate"),
    ("disposition", _disposition, "view_key"),
    ("selector", _selector, "evict_cont"),
    ("scorer", _scorer, "diagnostic"),
])
def test_misspelled_optional_hook_is_rejected_when_registered(kind, make, hook):
    """Bug: the cache looked optional hooks up with ``getattr``, so a component whose method was
    a near miss of a hook name (``init_sate``, ``view_key``, ``evict_cont``) registered fine and
    its hook was silently never called. Such a plugin is now reported as failed (a PluginError
    in strict mode); correctly named hooks are accepted."""
    bad = make(**{hook: lambda self, *a: None})
    with pytest.warns(RuntimeWarning, match=hook):
        reg = kvcompress.Registry(entry_points=False, plugins=[("bad", _plugin(kind, "bad_one", bad))], strict=False)
    assert [p.name for p in reg.failed()] == ["bad"]
    assert "bad_one" not in reg.components[kind]
    with pytest.raises(kvcompress.PluginError, match=hook):
        kvcompress.Registry(entry_points=False, plugins=[("bad", _plugin(kind, "bad_one", bad))], strict=True)

    good_hooks = {"scorer": ("init_state", "diagnostics"), "disposition": ("view_keys", "init_state"),
                  "selector": ("evict_count", "take_rows")}[kind]
    good = make(**{h: lambda self, *a: None for h in good_hooks}, _private_helper=lambda self: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg = kvcompress.Registry(entry_points=False, plugins=[("good", _plugin(kind, "good_one", good))], strict=True)
    assert "good_one" in reg.components[kind] and not reg.failed()


# ------------------------------------------------------------------------------------------
# make_prompt_cache: config files, a patched make_cache, mlx-lm's entry point
# ------------------------------------------------------------------------------------------


def test_make_prompt_cache_from_a_config_file_or_dict(tmp_path):
    """Bug: ``make_prompt_cache(model, config=...)`` did not exist: a TOML/JSON config (what the
    CLI and the docs use) had to be turned into a method by hand."""
    model = tiny_llama(n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=97, seed=4)
    toml = tmp_path / "method.toml"
    toml.write_text('method = "h2o"\n[params]\nbudget = 20\nn_sink = 2\n')
    for config in (str(toml), toml, {"method": "h2o", "params": {"budget": 20, "n_sink": 2}}):
        caches = kvcompress.make_prompt_cache(model, config=config)
        assert [type(c) for c in caches] == [kvcompress.CompressedKVCache] * 2
        assert [c.budget for c in caches] == [20, 20]
        assert caches[0].method.name == "h2o" and caches[0].method.selector.n_sink == 2


def test_patched_model_make_cache_does_not_recurse():
    """Bug: ``model.make_cache = lambda: kvcompress.make_prompt_cache(model, ...)`` recursed
    (kvcompress asked ``model.make_cache()`` for the default layers), so mlx-lm's own
    ``make_prompt_cache(model)`` -- used by ``generate_step`` without a prompt cache -- could
    not return compressed caches."""
    model = tiny_llama(n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=97, seed=4)
    model.make_cache = lambda: kvcompress.make_prompt_cache(model, "h2o", budget=12)
    caches = mlx_cache.make_prompt_cache(model)
    assert [type(c) for c in caches] == [kvcompress.CompressedKVCache] * 2
    toks = [int(t) for t, _ in generate_step(mx.array(prompt_tokens(30)), model, max_tokens=5)]
    direct = kvcompress.make_prompt_cache(model, "h2o", budget=12)
    assert toks == [int(t) for t, _ in generate_step(mx.array(prompt_tokens(30)), model, prompt_cache=direct, max_tokens=5)]


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
    ``kv_bits`` (the cache had no ``to_quantized``). It is now a clear ConfigError."""
    caches = kvcompress.make_prompt_cache(model, "h2o", budget=12)
    gen = generate_step(mx.array(prompt_tokens(20)), model, prompt_cache=caches, kv_bits=4, quantized_kv_start=0,
                        max_tokens=4)
    with pytest.raises(kvcompress.ConfigError, match="kv_bits"):
        list(gen)
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
    if not batchable(method):
        pytest.skip(f"{method}: the disposition cannot yet batch rows that free different numbers of tokens")
    prompts = [prompt_tokens(n, salt=i) for i, n in enumerate(PROMPT_LENGTHS)]
    caches = [caches_for(model, method, 12) for _ in prompts]
    r = mlx_lm.batch_generate(model, FakeTokenizer(), prompts, prompt_caches=caches, max_tokens=10,
                              return_token_ids=True)
    solo = [[int(t) for t, _ in generate_step(mx.array(p), model, prompt_cache=caches_for(model, method, 12),
                                              max_tokens=10)] for p in prompts]
    assert r.token_ids == solo


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
    if not batchable(method):
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
