"""PyramidKV budgets: per-layer budgets are non-increasing, within a token of the linear
schedule, and their mean is exactly the uniform budget."""

from __future__ import annotations

import pytest

import kvcompress
from kvcompress import ConfigError


@pytest.mark.parametrize("n_layers", [1, 2, 3, 5, 32, 80])
@pytest.mark.parametrize("budget,window", [(64, 0), (100, 8), (512, 32), (2048, 8), (160, 64)])
@pytest.mark.parametrize("beta", [2.0, 20.0])
def test_pyramid_mean_is_uniform_budget_and_linear(n_layers, budget, window, beta):
    info = kvcompress.ModelInfo(n_layers=n_layers)
    m = kvcompress.build_method("h2o_pyramid", budget=budget, recent=window, beta=beta, n_sink=4)
    got = m.budget.layer_budgets(info)
    uniform = kvcompress.build_method("h2o", budget=budget).budget.layer_budgets(info)
    assert len(got) == n_layers and sum(got) == sum(uniform) == n_layers * budget
    assert all(a >= b for a, b in zip(got, got[1:])), "budgets must not grow with depth"
    # every layer can evict past the selector's sinks and its recent window (recent_ratio=0.5)
    assert all(m.selector.reserved(b) < b for b in got)
    if n_layers > 1:
        from kvcompress_pyramidkv import smallest_budget

        p = budget - window
        lo = max(p / beta, smallest_budget(window, 4, 0.5) - window)
        hi = 2 * p - lo
        real = [window + hi - layer * (hi - lo) / (n_layers - 1) for layer in range(n_layers)]
        assert max(abs(g - r) for g, r in zip(got, real)) < 1.0 + 1e-9


@pytest.mark.parametrize("method", ["pyramidkv", "h2o_pyramid", "snapkv_merge"])
@pytest.mark.parametrize("n_layers", [5, 32])
@pytest.mark.parametrize("budget", [64, 128, 1024])
def test_pyramid_defaults_floor_every_layer_at_half_the_mean_prefix(method, n_layers, budget):
    """The registered pyramids default to beta = 2 (ours): the top layer keeps at least half the
    mean prefix (held through decode, PyramidKV's beta = 20 leaves a 5-layer model's top layer
    w + (C - w) / 20 tokens); the paper's beta stays a parameter."""
    info = kvcompress.ModelInfo(n_layers=n_layers)
    m = kvcompress.build_method(method, budget=budget)
    w = m.budget.recent
    got = m.budget.layer_budgets(info)
    assert m.budget.beta == 2.0 and sum(got) == n_layers * budget
    assert min(got) - w >= (budget - w) / 2 - 1 and max(got) - w <= 1.5 * (budget - w) + 1
    paper = kvcompress.build_method(method, budget=budget, beta=20.0).budget.layer_budgets(info)
    assert min(paper) < min(got)


def test_pyramid_needs_room_past_window_and_sinks():
    with pytest.raises(ConfigError, match="prefix tokens"):
        kvcompress.build_method("h2o_pyramid", budget=8, recent=4, n_sink=4).budget.layer_budgets(
            kvcompress.ModelInfo(n_layers=4)
        )
