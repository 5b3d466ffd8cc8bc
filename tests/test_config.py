"""Configuration errors name the field, the value and the valid choices; incompatible
compositions are refused; the design note's KVCacheConfig / KVCacheBuilder API works (files:
``test_config_files.py``)."""

from __future__ import annotations

from typing import ClassVar

import attrs
import mlx.core as mx
import numpy as np
import pytest

import kvcompress
from conftest import tiny_llama
from kvcompress import (
    ComponentSpec,
    CompositionError,
    CompressedKVCache,
    ConfigError,
    KVCacheBuilder,
    KVCacheConfig,
    build_method,
    hookimpl,
    make_prompt_cache,
)
from kvcompress.registry import Registry

COMPOSED = dict(scorer="h2o", selector="lowest", disposition="drop", budget="uniform")
MERGE_MODES = ("sim_weighted", "mean", "drop")


def _error(fn, *args, exc=ConfigError, **kw) -> str:
    with pytest.raises(exc) as info:
        fn(*args, **kw)
    return str(info.value)


# ------------------------------------------------------------------------------------------
# Names: methods, components, parameters
# ------------------------------------------------------------------------------------------


def test_unknown_method_lists_the_registered_ones():
    msg = _error(build_method, "nope")
    assert "unknown method 'nope'" in msg
    for name in kvcompress.get_registry().methods:
        assert name in msg


@pytest.mark.parametrize("kind", ["scorer", "selector", "disposition", "budget"])
def test_unknown_component_lists_the_registered_ones_of_its_kind(kind):
    msg = _error(build_method, **{**COMPOSED, kind: "nope"})
    assert f"unknown {kind} 'nope'" in msg
    registered = kvcompress.get_registry().components[kind]
    assert registered and all(name in msg for name in registered)


def test_missing_component_kind_lists_methods_and_choices():
    msg = _error(build_method, scorer="h2o", selector="lowest")
    assert "missing ['disposition', 'budget']" in msg
    assert "cam" in msg and "gated_merge" in msg and "uniform" in msg


@pytest.mark.parametrize("method, kind, name, own, foreign", [
    ("selfinfo", "selector", "chunk", dict(chunk=8), "span"),
    ("chunkkv", "selector", "span", dict(span=8), "chunk"),
    ("cam", "disposition", "drop", {}, "merge"),
])
def test_a_swapped_component_drops_the_methods_defaults_it_does_not_take(method, kind, name, own, foreign):
    """``build_method("selfinfo", selector="chunk")``: the method's defaults for the replaced
    component (``span``) go with it; the new component's parameters apply; naming a parameter
    of the replaced component explicitly is still an error."""
    m = build_method(method, **{kind: name}, **own)
    comp = getattr(m, kind)
    assert type(comp) is kvcompress.get_registry().component(kind, name).cls and getattr(m.config, kind).name == name
    assert all(getattr(comp, k) == v for k, v in own.items())
    assert _error(build_method, method, **{kind: name, foreign: 3}).startswith(f"unknown parameter {foreign!r}")


@pytest.mark.parametrize("method", ["cam", "h2o"])
def test_unknown_parameter_lists_the_valid_ones(method):
    msg = _error(build_method, method, budgte=64)
    assert "unknown parameter 'budgte'" in msg and repr(method) in msg
    reg = kvcompress.get_registry()
    spec = reg.method(method)
    kinds = ("scorer", "selector", "disposition", "budget")
    valid = {p for kind in kinds for p in reg.component(kind, getattr(spec, kind)).params()}
    assert valid and all(repr(p) in msg for p in valid)


def test_component_table_rejects_a_parameter_it_does_not_have():
    msg = _error(build_method, "cam", selector={"name": "lowest", "merge": "mean"})
    assert "selector 'lowest'" in msg and "'merge'" in msg and "valid parameters: ['n_sink'" in msg


# ------------------------------------------------------------------------------------------
# Types and ranges
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, field, choices",
    [
        ({"budget": 0}, "budget", ">= 1"),
        ({"budget": -5}, "budget", ">= 1"),
        ({"budget": "x"}, "budget 'x'", "registered budgets: "),
        ({"budget": 2.5}, "budget", "expected int, got 2.5"),
        ({"budget": True}, "budget", "expected int, got True"),
        ({"n_sink": -1}, "n_sink", ">= 0"),
        ({"n_sink": "4"}, "n_sink", "expected int, got '4'"),
        ({"merge": "bogus"}, "merge", "'sim_weighted', 'mean', 'drop'"),
        ({"merge_gate": "false"}, "merge_gate", "expected bool, got 'false'"),
        ({"merge_gate": 1}, "merge_gate", "expected bool, got 1"),
        ({"target": "far"}, "target", "'nearest', 'window'"),
        ({"merge_window": 0}, "merge_window", ">= 1"),
        ({"recent_ratio": 1.5}, "recent_ratio", "< 1.0"),
        ({"seed": "a"}, "seed", "expected int"),
    ],
)
def test_bad_value_names_field_value_and_choices(params, field, choices):
    msg = _error(build_method, "cam", **params)
    value = next(iter(params.values()))
    assert field in msg and choices in msg and str(value) in msg, msg
    if "registered budgets" in choices:
        assert "uniform" in msg.split("registered budgets: ")[1]


def test_numpy_scalars_are_accepted():
    m = build_method("cam", budget=np.int64(32), n_sink=np.int32(2), recent_ratio=np.float32(0.25))
    assert (m.budget.budget, m.selector.n_sink, m.selector.recent_ratio) == (32, 2, 0.25)
    assert type(m.budget.budget) is int


def test_budget_that_leaves_no_room_fails_before_any_decode(tiny_model):
    reserved = build_method("cam", budget=4, n_sink=4).selector.reserved(4)  # sinks + recent window
    assert reserved >= 4
    msg = _error(make_prompt_cache, tiny_model, "cam", budget=4, n_sink=4)
    assert "budget 4" in msg and f"keeps {reserved} tokens" in msg and "smallest budget that builds is 9" in msg


# ------------------------------------------------------------------------------------------
# Incompatible compositions are refused at build time
# ------------------------------------------------------------------------------------------


@attrs.frozen
class QueryFreeScorer:
    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset({"key_norm"})

    def observe(self, scores, obs):
        return scores


@attrs.frozen
class NeedyScorer:
    requires: ClassVar[frozenset] = frozenset({"gradients"})
    provides: ClassVar[frozenset] = frozenset({"attention_mass"})

    def observe(self, scores, obs):
        return scores


class _TestPlugin:
    @hookimpl
    def kvcompress_scorers(self):
        return [
            ComponentSpec("scorer", "query_free", QueryFreeScorer, "test: provides key_norm only"),
            ComponentSpec("scorer", "needy", NeedyScorer, "test: requires gradients"),
        ]


@pytest.fixture(scope="module")
def test_registry():
    return Registry(plugins=[("testplugin", _TestPlugin())])


def _scorers_without_attention_mass(test_registry):
    out = [("query_free", test_registry)]
    if "knorm" in kvcompress.get_registry().components["scorer"]:
        out.append(("knorm", kvcompress.get_registry()))
    return out


def test_gated_merge_needs_attention_mass(test_registry, tiny_model):
    for scorer, reg in _scorers_without_attention_mass(test_registry):
        comp = {**COMPOSED, "scorer": scorer, "disposition": "gated_merge"}
        msg = _error(build_method, registry=reg, exc=CompositionError, **comp)
        assert "disposition 'gated_merge' requires ['attention_mass']" in msg
        assert f"scorer={scorer}" in msg
        # The same composition through the cache factory fails before a cache exists.
        _error(make_prompt_cache, tiny_model, None, registry=reg, exc=CompositionError, **comp)
        # A method's components can be swapped too; the check still runs.
        _error(build_method, "cam", registry=reg, scorer=scorer, exc=CompositionError)
        # With a drop disposition the query-free scorer is fine.
        assert build_method(registry=reg, **{**COMPOSED, "scorer": scorer}).scorer is not None


def test_requirement_nobody_provides(test_registry):
    msg = _error(build_method, registry=test_registry, exc=CompositionError, **{**COMPOSED, "scorer": "needy"})
    assert "scorer 'needy' requires ['gradients']" in msg


# ------------------------------------------------------------------------------------------
# The design note's API
# ------------------------------------------------------------------------------------------


def _design_note_config(head_dim, **over):
    opts = dict(cam_budget=512, cam_n_sink=4, cam_merge="sim_weighted", cam_merge_gate=True,
                cam_merge_keys=False, seed=0)
    opts.update(over)
    return KVCacheConfig(method="cam", head_dim=head_dim, **opts)


def test_kvcacheconfig_for_model_gives_one_compressed_cache_per_layer(tiny_model):
    head_dim = kvcompress.model_info(tiny_model).head_dim
    caches = KVCacheBuilder.for_model(tiny_model, _design_note_config(head_dim))
    assert len(caches) == len(tiny_model.layers)
    assert [c.layer for c in caches] == list(range(len(caches)))
    for c in caches:
        assert type(c) is CompressedKVCache
        d = c.method.disposition
        assert (c.budget, d.merge, d.merge_gate, d.merge_keys, d.n_sink, d.seed) == (
            512, "sim_weighted", True, False, 4, 0)
        assert c.method.selector.n_sink == 4 and c.method.name == "cam"


@pytest.mark.parametrize(
    "over, want",
    [
        (dict(cam_merge="mean", cam_merge_gate=False, cam_merge_keys=True, seed=7),
         ("mean", False, True, 7)),
        (dict(cam_merge="drop"), ("drop", True, False, 0)),
    ],
)
def test_kvcacheconfig_options_reach_the_caches(tiny_model, over, want):
    cfg = _design_note_config(kvcompress.model_info(tiny_model).head_dim, cam_budget=32, **over)
    for c in KVCacheBuilder.for_model(tiny_model, cfg):
        d = c.method.disposition
        assert c.budget == 32 and (d.merge, d.merge_gate, d.merge_keys, d.seed) == want


def test_design_note_quick_start_generates():
    """``model.make_cache = lambda *_a, **_k: caches`` then plain mlx-lm generation."""
    from mlx_lm.generate import generate_step

    model = tiny_llama(seed=3)  # a private model: its make_cache is patched
    caches = KVCacheBuilder.for_model(model, _design_note_config(16, cam_budget=16))
    model.make_cache = lambda *_a, **_k: caches
    prompt = mx.array(np.arange(3, 33), dtype=mx.uint32)
    out = [int(t) for t, _ in generate_step(prompt, model, max_tokens=6)]
    assert len(out) == 6
    assert all(c.size() == 16 and 30 + 5 <= c.offset <= 30 + 6 for c in caches)
    assert all(c.score_source == "queries" and c.evictions > 0 for c in caches)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="cam", cam_budget=64, budget=64), r"unknown KVCacheConfig option\(s\) \['budget'\].*'cam_<parameter>'"),
        (dict(method="cam", h2o_budget=64), r"\['h2o_budget'\]"),
        (dict(method="cam", cam_budgte=64), r"unknown parameter 'budgte'.*valid parameters: \['budget'"),
        (dict(method="cam", cam_merge="bogus"), r"merge.*bogus.*'sim_weighted', 'mean', 'drop'"),
        (dict(method="cam", cam_budget=0), r"budget.*>= 1"),
        (dict(method="nope"), r"unknown method 'nope'; registered methods: .*cam"),
        (dict(method=3), "method must be a method name"),
        (dict(method="cam", seed="0"), r"seed.*expected int"),
    ],
)
def test_bad_kvcacheconfig_options_error_clearly(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        KVCacheConfig(**kwargs)


def test_head_dim_mismatch(tiny_model):
    real = kvcompress.model_info(tiny_model).head_dim
    cfg = _design_note_config(real * 2)
    msg = _error(KVCacheBuilder.for_model, tiny_model, cfg)
    assert f"head_dim={real * 2}" in msg and f"head_dim is {real}" in msg
    assert len(KVCacheBuilder.for_model(tiny_model, _design_note_config(None))) == len(tiny_model.layers)


# ------------------------------------------------------------------------------------------
# make_prompt_cache with mlx_lm.generate
# ------------------------------------------------------------------------------------------


def test_make_prompt_cache_with_mlx_lm_generate(stories_model, stories_text):
    import mlx_lm

    model, tokenizer = stories_model
    prompt = stories_text[:700]
    n_prompt = len(tokenizer.encode(prompt))
    assert n_prompt > 64
    cache = make_prompt_cache(model, method="cam", budget=64)
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=12, prompt_cache=cache)
    assert isinstance(text, str) and text
    for c in cache:
        assert isinstance(c, CompressedKVCache) and c.size() == 64
        assert n_prompt < c.offset <= n_prompt + 12
        assert c.score_source == "queries" and c.method.disposition.merge == "sim_weighted"
