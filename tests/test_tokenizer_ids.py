"""Token ids named by the tokenizer: a component's ``with_tokenizer`` hook resolves symbolic
parameters (selfinfo's ``floor_ids="digits"``, ``keep_ids="special"``) when a cache is built with
the model's tokenizer, records the ids in the cache's config (saved and loaded), and without a
tokenizer either falls back loudly (a warning) or refuses before anything changes."""

from __future__ import annotations

import warnings

import attrs
import mlx.core as mx
import pytest

import kvcompress
from kvcompress import ComponentSpec, CompressedKVCache, build_method, hookimpl, make_prompt_cache
from kvcompress.tune.search import model_cache_factory
from kvcompress_selfinfo import digit_ids, special_ids

from conftest import tiny_llama


class FakeTokenizer:
    """A vocabulary with single- and multi-digit tokens (GPT-2's space marker) and three specials."""

    all_special_ids = [2, 0, 1]

    def get_vocab(self):
        return {"<s>": 0, "</s>": 1, "<pad>": 2, "7": 12, "\u01201990": 40, "x1": 5, "the": 30, "3": 61}


DIGITS, SPECIAL = (12, 40, 61), (0, 1, 2)


def _scorer(cache):
    return next(c for c in cache if isinstance(c, CompressedKVCache)).method.scorer


def test_the_method_keeps_the_names_until_a_cache_is_built_with_the_tokenizer():
    m = build_method("selfinfo", budget=64)
    assert m.scorer.floor_ids == "digits" and m.scorer.floor == 7.0
    assert digit_ids(FakeTokenizer()) == DIGITS and special_ids(FakeTokenizer()) == SPECIAL
    cache = make_prompt_cache(tiny_llama(), m, tokenizer=FakeTokenizer())
    for c in cache:
        assert c.method.scorer.floor_ids == DIGITS
        assert c.method.config.scorer.params["floor_ids"] == DIGITS  # what the cache records and saves
    r = m.with_tokenizer(FakeTokenizer())
    assert r.with_tokenizer(None) is r and r.with_tokenizer(FakeTokenizer()) is r  # resolved once, then fixed
    assert "floor_ids=(12, 40, 61)" in r.describe()
    long = build_method("selfinfo", floor_ids=list(range(1110)))  # e.g. Llama 3's 1-3 digit tokens
    assert "floor_ids=(0, 1, 2, ..., 1109: 1110 values)" in long.describe()


def test_without_a_tokenizer_the_digit_floor_is_dropped_with_a_warning():
    with pytest.warns(UserWarning, match="floor_ids='digits' needs the model's tokenizer"):
        cache = make_prompt_cache(tiny_llama(), "selfinfo", budget=64)
    assert _scorer(cache).floor_ids == ()
    with pytest.warns(UserWarning, match="floor_ids='digits'"):  # a tokenizer without a vocabulary
        assert _scorer(make_prompt_cache(tiny_llama(), "selfinfo", budget=64, tokenizer=object())).floor_ids == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _scorer(make_prompt_cache(tiny_llama(), "selfinfo", budget=64, floor_ids=[3])).floor_ids == (3,)
    with pytest.warns(UserWarning):  # a cache built directly from the method resolves too
        c = CompressedKVCache(build_method("selfinfo", budget=64), 64)
    assert c.method.scorer.floor_ids == ()


def test_special_ids_without_a_tokenizer_are_refused_before_the_model_changes():
    model = tiny_llama()
    with pytest.raises(kvcompress.ConfigError, match="keep_ids='special' needs the model's tokenizer"):
        kvcompress.attach(model, "selfinfo", budget=64, keep_ids="special")
    assert "make_cache" not in vars(model)
    m = kvcompress.attach(model, "selfinfo", budget=64, keep_ids="special", tokenizer=FakeTokenizer())
    assert m.scorer.keep_ids == SPECIAL and m.scorer.floor_ids == DIGITS
    assert _scorer(model.make_cache()) == m.scorer
    kvcompress.detach(model)


@pytest.mark.parametrize("bad", ["numbers", [1, -2], [1.5], "special"])
def test_unknown_names_and_bad_ids_are_one_line_errors(bad):
    with pytest.raises(kvcompress.ConfigError, match="floor_ids must be token ids"):
        build_method("selfinfo", floor_ids=bad)


def test_resolved_ids_save_and_load_without_a_tokenizer(tmp_path):
    model = tiny_llama()
    cache = make_prompt_cache(model, "selfinfo", budget=16, recent=4, step=4, span=4, tokenizer=FakeTokenizer())
    ids = mx.array([[5, 12, 40, 61, 9, 3, 12, 12, 70, 61] * 6], dtype=mx.int32)
    for a in range(0, 60, 8):
        mx.eval(model(ids[:, a : a + 8], cache=cache))
    path = str(tmp_path / "c.safetensors")
    kvcompress.save_prompt_cache(path, cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left to resolve
        loaded = kvcompress.load_prompt_cache(path)
    assert _scorer(loaded).floor_ids == DIGITS
    tok = ids[0].tolist()
    for a, b in zip(cache, loaded):
        arrays = [(x, y) for x, y in zip(a.state, b.state) if isinstance(x, mx.array)]
        assert arrays and all(mx.array_equal(x, y) for x, y in arrays)
        pos, score = a.state[-3][0].reshape(-1).tolist(), a.state[-2][0].reshape(-1).tolist()
        held = [x for p, x in zip(pos, score) if p > 0 and tok[p] in DIGITS]
        assert held and min(held) >= 7.0  # the floor acted on the digits the cache holds


def test_tune_builds_its_candidates_with_the_workloads_tokenizer():
    model = tiny_llama()
    make = model_cache_factory(model, tokenizer=FakeTokenizer())(
        {"method": "selfinfo", "params": {"budget": 64}})
    assert _scorer(make()).floor_ids == DIGITS


@attrs.frozen
class _Swapping:
    """A scorer whose ``with_tokenizer`` returns something else: a plugin bug, named."""

    requires = frozenset()
    provides = frozenset()

    def observe(self, scores, obs):
        return scores

    def with_tokenizer(self, tokenizer):
        return 3


def test_a_with_tokenizer_that_returns_another_type_is_refused():
    class Plugin:
        @hookimpl
        def kvcompress_scorers(self):
            return [ComponentSpec("scorer", "swapping", _Swapping, "test")]

    reg = kvcompress.Registry(plugins=[("swapping_test", Plugin())])
    m = build_method(None, registry=reg, scorer="swapping", selector="lowest", disposition="drop",
                     budget={"name": "uniform", "budget": 8})
    with pytest.raises(kvcompress.CompositionError, match="with_tokenizer returned a int"):
        m.with_tokenizer(FakeTokenizer())


def test_generate_resolves_the_digits_with_the_models_tokenizer(stories_model, monkeypatch, tmp_path):
    """``kvcompress generate --method selfinfo``: the saved cache holds the tokenizer's digit ids."""
    import mlx_lm

    from kvcompress.cli import main

    model, tok = stories_model
    monkeypatch.setattr(mlx_lm, "load", lambda name: (model, tok))
    saved = tmp_path / "c.safetensors"
    assert main(["generate", "--model", "stories", "--method", "selfinfo", "--budget", "64", "--max-tokens", "4",
                 "--prompt", "Tom had 3 red balls and 12 blue ones.", "--save-prompt-cache", str(saved)]) == 0
    want = digit_ids(tok)
    assert len(want) == 10
    assert _scorer(kvcompress.load_prompt_cache(str(saved))).floor_ids == want


def test_serve_resolves_the_digits_with_each_loaded_models_tokenizer():
    """``kvcompress serve``'s model provider attaches the method with the tokenizer it loads."""
    from kvcompress.bench import _serving as srv
    from kvcompress.mlxlm.server import model_provider
    from kvcompress.serve.options import parse_server_args

    cli = parse_server_args(["--model", str(srv.ASSET)])
    provider = model_provider(build_method("selfinfo", budget=32, recent=4, step=4, span=4))(cli)
    want = digit_ids(provider.tokenizer)
    assert len(want) == 10  # the retrieval model's words "0" .. "9"
    assert _scorer(provider.model.make_cache()).floor_ids == want


def test_chat_resolves_the_digits_with_the_models_tokenizer(stories_model, monkeypatch):
    import builtins

    import mlx_lm.chat

    from kvcompress.cli import main

    model, tok = stories_model
    monkeypatch.setattr(tok._tokenizer, "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    monkeypatch.setattr(mlx_lm.chat, "load", lambda *a, **k: (model, tok))
    lines = iter(["Tom had 3 balls", "q"])
    monkeypatch.setattr(builtins, "input", lambda *a: next(lines))
    seen = []

    def spy(model, tokenizer, prompt, prompt_cache=None, **kw):
        seen.append(_scorer(prompt_cache).floor_ids)
        yield from ()

    monkeypatch.setattr(mlx_lm.chat, "stream_generate", spy)
    try:
        assert main(["chat", "--model", "stories", "--method", "selfinfo", "--budget", "64", "--max-tokens", "4"]) == 0
    finally:
        kvcompress.detach(model)  # the shared fixture's model gets its own caches back
    assert seen == [digit_ids(tok)]


def test_the_long_context_benches_build_caches_with_the_tokenizer(tmp_path_factory, monkeypatch):
    """``bench longctx`` and ``bench longppl`` give selfinfo the tokenizer's digits (bytes 0-9)."""
    from _longctx_helpers import ByteTokenizer, text_source
    from kvcompress.bench import longctx as lc
    from kvcompress.bench import longctx_ppl as lp

    src = text_source(tmp_path_factory)
    model = tiny_llama(n_layers=2, hidden=64, heads=4, kv_heads=2, vocab=258, seed=3)
    real, seen = kvcompress.make_prompt_cache, []

    def spy(*a, **k):
        cache = real(*a, **k)
        seen.append(_scorer(cache).floor_ids)
        return cache

    monkeypatch.setattr(kvcompress, "make_prompt_cache", spy)
    settings = {"recent": 4, "step": 4, "span": 4}  # selfinfo at a 150-token budget
    lc.run_longctx({"lengths": (600,), "ratios": (4,), "episodes": 1, "chunk": 128, "methods": ("selfinfo",),
                    "protocols": ("blind",), "min_full": 0.0, "text_dir": src.where, "extra": (("selfinfo", settings),)},
                   model=model, tokenizer=ByteTokenizer(True), progress=False)
    lp.run_longppl({"window": 400, "windows": 1, "decode": 8, "chunk": 128, "ratios": (4,), "methods": ("selfinfo",),
                    "text_dir": src.where}, model=model, tokenizer=ByteTokenizer(), progress=False)
    digits = tuple(range(48, 58))
    assert len(seen) >= 3 and all(ids == digits for ids in seen)


def test_the_design_note_builder_passes_the_tokenizer():
    cfg = kvcompress.KVCacheConfig(method="selfinfo", selfinfo_budget=64)
    assert _scorer(kvcompress.KVCacheBuilder.for_model(tiny_llama(), cfg, tokenizer=FakeTokenizer())).floor_ids == DIGITS
