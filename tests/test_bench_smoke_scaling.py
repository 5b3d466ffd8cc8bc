"""Smoke tests of the scaling benchmark (speed and memory against context) at tiny sizes: every
method, context and baseline runs, bounded caches stay flat while the full one grows, the
summary ratios and table are sane, and bad settings are refused."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

import kvcompress

# budget 80: every built-in method's defaults leave room to evict (selfinfo protects 78)
TINY_SCALING = dict(
    contexts=(192, 384), budgets=(80,), decode_tokens=4, decode_block=2, sync_tokens=2, prefill_step_size=32,
    n_layers=2,
    hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, intermediate=128, vocab=128, warmup=False,
)


@pytest.fixture(scope="module")
def scaling_payload():
    from kvcompress.bench import scaling

    return scaling.run_scaling(scaling.ScalingSettings(**TINY_SCALING))


def test_scaling_covers_every_method_context_and_baseline(scaling_payload):
    reg = kvcompress.get_registry()
    res = scaling_payload["results"]
    assert scaling_payload["errors"] == []
    kinds = {r["kind"] for r in res}
    assert kinds == set(reg.methods) | {"rotating", "full"}
    for kind in kinds:
        assert sorted(r["context"] for r in res if r["kind"] == kind) == [192, 384]
    for r in res:
        assert r["decode_ms"] > 0 and r["prefill_s"] > 0
        # every decoded token (the first token, 4 pipelined + 2 synchronous per checkpoint) stays
        # in the context; rotating decodes that next to every other kind
        per = 6 * (len(kinds) - 1) if r["kind"] == "rotating" else 6
        assert r["tokens_seen"] == r["context"] + (1 + per if r["context"] == 192 else 2 + 2 * per)
        assert r["decode_ms_sync"] > 0
        assert r["peak_bytes"] >= scaling_payload["weights_bytes"] + r["cache_bytes"]
        assert r["live_bytes"] <= r["cache_bytes"]
        if r["kind"] != "rotating":
            assert len(r["decode_ratio_blocks"]) == 2 and all(x > 0 for x in r["decode_ratio_blocks"])
            assert r["decode_ratio_sync"] > 0


def test_scaling_bounded_caches_stay_flat_and_full_grows(scaling_payload):
    reg = kvcompress.get_registry()
    by = {(r["kind"], r["context"]): r for r in scaling_payload["results"]}
    full_small, full_big = by[("full", 192)], by[("full", 384)]
    assert full_big["stored_tokens"] == full_big["tokens_seen"]
    assert full_big["live_bytes"] == full_small["live_bytes"] * 334 // 167
    for kind in [*reg.methods, "rotating"]:
        if kind in reg.methods and reg.methods[kind].spec.disposition == "kivi_quant":
            # quantized tokens are kept: bytes grow, but slower than the full cache's
            grow = by[(kind, 384)]["live_bytes"] - by[(kind, 192)]["live_bytes"]
            assert 0 < grow < full_big["live_bytes"] - full_small["live_bytes"], kind
            continue
        # past every layer's budget (pyramids give the first layer up to ~2x) the held bytes do
        # not grow with the context (chunk selectors hold a few tokens less, varying with the cut)
        assert 0.9 <= by[(kind, 384)]["cache_bytes"] / by[(kind, 192)]["cache_bytes"] <= 1.02, kind
        assert by[(kind, 384)]["live_bytes"] < full_small["live_bytes"], kind


def test_scaling_summary_ratios_and_table(scaling_payload, tmp_path):
    from kvcompress.bench import scaling

    summ = {r["kind"]: r for r in scaling_payload["summary"]}
    assert set(summ) == {r["kind"] for r in scaling_payload["results"]}
    for kind, r in summ.items():
        assert r["context"] == 384
        if kind == "rotating":
            continue
        for key in ("decode_ratio", "decode_ratio_sync", "prefill_ratio", "cache_ratio", "peak_ratio"):
            assert r[key] > 0 and math.isfinite(r[key]), (kind, key)
        if kind != "full":
            assert r["decode_target_met"] == (r["decode_ratio"] >= 0.9)
    assert summ["full"]["cache_ratio"] > 1.5  # 384 + 14 tokens against an 80-token window
    cols, rows = scaling.summary_table(scaling_payload)
    assert len(rows) == len(summ) and all(len(r) == len(cols) for r in rows)
    assert "| cache |" in scaling.markdown_report(scaling_payload)
    png = scaling.plot_scaling(scaling_payload, tmp_path / "scaling.png")
    assert png.stat().st_size > 10_000


def test_scaling_settings_reject_bad_input():
    from kvcompress.bench import scaling

    with pytest.raises(ValueError, match="increasing"):
        scaling.ScalingSettings(contexts=(2048, 1024))
    with pytest.raises(ValueError, match="full_budget"):
        scaling.ScalingSettings(budgets=(256,), full_budget=512)
    with pytest.raises(ValueError, match="unknown methods"):
        scaling.run_scaling(scaling.ScalingSettings(**{**TINY_SCALING, "methods": ("no_such_method",)}))


def test_scaling_runs_a_real_model(stories_model):
    """``--model``: the same protocol on an mlx-lm model from disk (the issue's 8k run on
    SmolLM2), its shape read from the model and its vocabulary used for the prompt; a method whose
    defaults name token ids (``selfinfo``'s digit floor) gets the model's tokenizer, as a user's
    cache does, so it runs at its defaults without a warning."""
    import warnings

    from conftest import models_dir

    from kvcompress.bench import scaling

    s = scaling.ScalingSettings(**{**TINY_SCALING, "model": str(models_dir() / "stories260K"),
                                   "methods": ("snapkv", "selfinfo")})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        payload = scaling.run_scaling(s)
    assert not [w for w in caught if "tokenizer" in str(w.message)]
    assert payload["errors"] == []
    assert payload["model_shape"] == {"n_layers": 5, "hidden": 64, "n_heads": 8, "n_kv_heads": 4, "head_dim": 8,
                                      "vocab": 512}
    assert {r["kind"] for r in payload["results"]} == {"snapkv", "selfinfo", "rotating", "full"}
    assert "stories260K" in scaling.caption(payload) and "intermediate" not in scaling.caption(payload)


def test_scaling_synthetic_fill_holds_every_kind_at_its_budget():
    """``fill='synthetic'``: each layer's cache is filled through the cache protocol (no model
    forward), the same keys and values for every kind, so a decode-speed run at long contexts
    takes minutes; the bounded kinds hold their budget, the full cache every token, a method
    that needs the model's forward is refused with the reason, and no prefill ratio is made."""
    from kvcompress.bench import scaling

    s = scaling.ScalingSettings(**{**TINY_SCALING, "fill": "synthetic", "methods": ("h2o", "adakv", "kvzip")})
    payload = scaling.run_scaling(s)
    assert [e["kind"] for e in payload["errors"]] == ["kvzip"]
    assert "synthetic fill" in payload["errors"][0]["error"] and "token ids" in payload["errors"][0]["error"]
    by = {(r["kind"], r["context"]): r for r in payload["results"]}
    assert {k for k, _ in by} == {"h2o", "adakv", "rotating", "full"}
    for n in (192, 384):
        assert by[("full", n)]["stored_tokens"] == by[("full", n)]["tokens_seen"]
        assert by[("rotating", n)]["stored_tokens"] == 80
        for kind in ("h2o", "adakv"):
            assert by[(kind, n)]["live_bytes"] <= by[("rotating", n)]["live_bytes"] * 1.1, kind
            assert by[(kind, n)]["live_bytes"] < by[("full", n)]["live_bytes"] / 2, kind
            assert len(by[(kind, n)]["decode_ratio_blocks"]) == 2
    summ = {r["kind"]: r for r in payload["summary"]}
    assert "prefill_ratio" not in summ["h2o"] and summ["h2o"]["decode_ratio"] > 0
    assert "fill=synthetic" in scaling.caption(payload)
    with pytest.raises(ValueError, match="fill"):
        scaling.ScalingSettings(fill="random")


@pytest.mark.parametrize("method", ["h2o", "snapkv"])
def test_synthetic_fill_gives_every_kind_the_same_tokens(method):
    """Below its budget a compressed cache filled synthetically holds exactly the keys and values
    a full KVCache filled the same way holds: the draws depend on the layer and the chunk's
    start only, and the chunks fall on the same boundaries."""
    from mlx_lm.models.cache import KVCache

    from kvcompress.bench._fill import synthetic_fill
    from kvcompress.bench._model import ModelShape, build_model

    shape = ModelShape(**{k: TINY_SCALING[k] for k in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim",
                                                       "intermediate", "vocab")})
    fill = synthetic_fill(shape, seed=3)
    full = [KVCache() for _ in range(shape.n_layers)]
    ours = kvcompress.make_prompt_cache(build_model(shape), method, budget=256)
    assert fill(full, 0, 100, 32) == 100
    assert fill(ours, 0, 64, 32) == 64 and fill(ours, 64, 100, 32) == 100  # a checkpoint on a chunk boundary
    for f, c in zip(full, ours):
        k, v = c.keys_and_values()
        order = mx.argsort(c.slot_positions[0, 0])
        assert mx.array_equal(k[:, :, order], f.keys[:, :, :100]) and mx.array_equal(v[:, :, order], f.values[:, :, :100])
    assert not mx.array_equal(full[0].keys[:, :, :100], full[1].keys[:, :, :100])  # each layer its own draw
