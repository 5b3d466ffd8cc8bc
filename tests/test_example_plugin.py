"""The third-party plugin example (examples/kvcompress-knorm) works once pip-installed.

Proves that ``pip install -e examples/kvcompress-knorm`` alone -- no change to kvcompress --
adds the ``knorm`` scorer through the ``kvcompress`` entry-point group, and that a composition
built from it runs inside ``mlx_lm`` generation, keeping exactly the slots the paper's rule keeps.
"""

from __future__ import annotations

import importlib.metadata as md

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import kvcompress
from kvcompress import build_method, make_prompt_cache
from kvcompress.registry import Registry

DIST = "kvcompress-knorm"

try:
    _VERSION = md.version(DIST)
except md.PackageNotFoundError:
    _VERSION = None

pytestmark = pytest.mark.skipif(
    _VERSION is None,
    reason=f"{DIST} is not installed; run `pip install -e examples/kvcompress-knorm` to test the "
    "third-party plugin example",
)


def test_pip_install_registered_the_scorer():
    eps = [ep for ep in md.distribution(DIST).entry_points if ep.group == "kvcompress"]
    assert [(ep.name, ep.value) for ep in eps] == [("knorm", "kvcompress_knorm")]

    reg = kvcompress.get_registry()
    prov = reg.provider("scorer", "knorm")
    assert (prov.plugin, prov.dist, prov.version) == ("knorm", DIST, _VERSION)
    assert reg.component("scorer", "knorm").cls.provides == frozenset({"key_norm"})
    assert reg.component("scorer", "knorm").cls.requires == frozenset()
    info = {p.name: p for p in reg.plugins()}["knorm"]
    assert (info.dist, info.status) == (DIST, "active")
    assert set(info.components) == {"scorer:knorm", "method:knorm"}
    # The built-ins keep coming from kvcompress itself.
    assert reg.provider("scorer", "h2o").dist == "kvcompress"


def test_component_comes_from_the_entry_point_only():
    """Disabling the entry point removes it: nothing else registers the scorer."""
    reg = Registry(disabled={"knorm"})
    assert "knorm" not in reg.components["scorer"]
    assert {p.name: p.status for p in reg.plugins()}["knorm"] == "disabled"
    with pytest.raises(kvcompress.ConfigError, match=r"^scorer 'knorm' comes from plugin 'knorm', which is disabled; "
                       r"remove 'knorm' from KVCOMPRESS_DISABLE_PLUGINS"):
        build_method(
            scorer="knorm", selector="lowest", disposition="drop", budget="uniform", registry=reg
        )


def _record_keys(caches):
    """Wrap each cache's ``update_and_fetch`` to log the keys the model hands it."""
    logs = []
    for cache in caches:
        log, orig = [], cache.update_and_fetch

        def wrapped(keys, values, _log=log, _orig=orig):
            _log.append(np.array(keys))
            return _orig(keys, values)

        cache.update_and_fetch = wrapped
        logs.append(log)
    return logs


@pytest.mark.parametrize("n_sink", [0, 3])
@pytest.mark.parametrize("prefill_step", [7, 512], ids=["chunked-prefill", "one-prefill"])
def test_knorm_composition_keeps_the_lowest_norm_keys_in_generation(tiny_model, n_sink, prefill_step):
    budget, n_prompt, n_gen = 12, 29, 9
    method = build_method(
        scorer="knorm", selector="lowest", disposition="drop",
        budget={"name": "uniform", "budget": budget}, n_sink=n_sink,
    )
    assert build_method("knorm", budget=budget, n_sink=n_sink).scorer == method.scorer
    caches = make_prompt_cache(tiny_model, method)
    logs = _record_keys(caches)
    prompt = mx.array(np.random.default_rng(0).integers(3, 90, n_prompt), dtype=mx.uint32)
    steps = generate_step(
        prompt, tiny_model, max_tokens=n_gen, prompt_cache=caches, prefill_step_size=prefill_step
    )
    assert len([tok for tok, _ in steps]) == n_gen

    for cache, log in zip(caches, logs):
        assert log[-1].shape[2] == 1  # the last step was a decode step
        K = np.concatenate(log, axis=2)  # [1, H, N, D], position = index
        N = K.shape[2]
        assert N == cache.offset and cache.size() == budget and cache.evictions == N - budget
        score = -np.linalg.norm(K.astype(np.float32), axis=-1)  # NumPy reference of -||k||
        *_, keys, _, pos, scores, _ = cache.state
        keys, pos, scores = np.array(keys), np.array(pos), np.array(scores)
        for h in range(K.shape[1]):
            p = pos[0, h]
            # Drop leaves every kept key bit-identical, and the scorer state is -||k||.
            np.testing.assert_array_equal(keys[0, h], K[0, h, p])
            np.testing.assert_allclose(scores[0, h], score[0, h, p], rtol=1e-5)
            # Sinks and the newest token (not yet scored against) stay; of the other slots
            # exactly the budget - 1 - n_sink highest -||k|| are kept. Repeated tokens give
            # tied norms, so compare the kept scores (tie-free) rather than positions.
            assert set(range(n_sink)) | {N - 1} <= set(p.tolist())
            cand = np.arange(n_sink, N - 1)
            kept = np.isin(cand, p)
            assert kept.sum() == budget - 1 - n_sink
            s = score[0, h, cand]
            top = np.sort(s)[::-1][: budget - 1 - n_sink]
            np.testing.assert_array_equal(np.sort(s[kept])[::-1], top)
            assert s[kept].min() >= s[~kept].max()
