"""Regression tests for the component contract plugins write against: keyword-only contexts and
misspelled optional hooks rejected at registration. Each test's docstring names the bug it catches."""

from __future__ import annotations

import inspect
import types
import warnings

import attrs
import mlx.core as mx
import pytest

import kvcompress


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


@attrs.define
class _Tag:
    layer: int = -1


@pytest.mark.parametrize("returned, ok", [("each", True), ("none", True), ("short", False)])
def test_bind_returns_the_states_instead_of_writing_the_cache(returned, ok):
    """Issue 24: ``bind`` wrote ``cache._states[...]`` from two plugins. It now gets each
    compressed layer's LayerInfo and its state there and returns the new states (None: kept);
    a wrong count is refused with the component's name."""
    from conftest import tiny_llama

    def bind(self, model, layers, states):
        assert all(isinstance(s, _Tag) for s in states) and len(layers) == len(model.layers)
        new = [attrs.evolve(s, layer=info.layer) for info, s in zip(layers, states)]
        return {"each": new, "none": None, "short": new[:1]}[returned]

    cls = _scorer(init_state=lambda self, layer: _Tag(), bind=bind)
    reg = kvcompress.Registry(entry_points=False, plugins=[
        ("basic", __import__("kvcompress_basic")), ("tagger", _plugin("scorer", "tagger", cls))])
    spec = {"scorer": "tagger", "selector": "lowest", "disposition": "drop", "budget": "uniform"}
    model = tiny_llama(n_layers=3)
    if not ok:
        with pytest.raises(kvcompress.PluginError, match="bind returned 1 states for 3 layers"):
            kvcompress.make_prompt_cache(model, spec, budget=16, registry=reg)
        return
    cache = kvcompress.make_prompt_cache(model, spec, budget=16, registry=reg)
    want = [0, 1, 2] if returned == "each" else [-1, -1, -1]
    assert [c.component_state("scorer").layer for c in cache] == want


def test_optional_hooks_are_a_typed_record_with_defaults_filled_once():
    """Issue 24: the cache looked optional hooks up by string at ~19 sites, each re-stating the
    hook's default. ``Method.hook_set()`` is one typed record per kind: a component's hook is its
    bound method; a missing one is its default (``evict_count``: as asked; ``head_group``: one
    head per row) or None where the cache takes another path; unknown names do not exist."""
    from kvcompress.components import DispositionHookSet, ScorerHookSet, SelectorHookSet

    h2o, chunk, kvzip = (kvcompress.build_method(m, budget=64).hook_set() for m in ("h2o", "chunkkv", "kvzip"))
    assert isinstance(h2o.scorer, ScorerHookSet) and isinstance(h2o.selector, SelectorHookSet)
    assert isinstance(h2o.disposition, DispositionHookSet)
    assert h2o.selector.evict_count(7, 64) == 7 and h2o.selector.head_group(kvcompress.LayerInfo(), 4) == 1
    assert chunk.selector.evict_count(7, 64) == 10  # the chunk selector frees whole chunks of 10
    assert h2o.scorer.pass_tokens is None and kvzip.scorer.pass_tokens is not None
    assert h2o.disposition.attend is None and h2o.disposition.view_keys is None
    with pytest.raises(AttributeError):
        h2o.selector.evict_cont  # noqa: B018
