"""SqueezeAttention: per-layer budgets from how much each layer's attention changes the prompt.

Budget component ``squeeze`` (any token policy inside a layer); method ``squeeze`` = H2O scores,
lowest-score eviction, drop, squeeze budgets.
"""

from kvcompress import ComponentSpec, MethodSpec, hookimpl

from .allocate import kmeans_1d, squeeze_budgets
from .budget import SqueezeBudget, SqueezeState

__all__ = ["SqueezeBudget", "SqueezeState", "kmeans_1d", "squeeze_budgets"]

PAPER = "https://arxiv.org/abs/2404.04793"


@hookimpl
def kvcompress_budgets():
    return [
        ComponentSpec(
            "budget", "squeeze", SqueezeBudget,
            "layer budgets from k-means on cos(input, input + attention) over the prompt; "
            "least important cluster squeezed, total kept = uniform total",
            PAPER,
        )
    ]


@hookimpl
def kvcompress_methods():
    return [
        MethodSpec(
            name="squeeze",
            scorer="h2o",
            selector="lowest",
            disposition="drop",
            budget="squeeze",
            summary="SqueezeAttention: H2O inside each layer, layer budgets re-split after the prompt",
            # squeeze_ratio = 0.7 is ours (the paper's configurations give 0.38-0.625; 0.4 is
            # 1.11x the full cache's perplexity at 4x on stories260K, 0.7 1.04x: docs/methods/squeeze.md)
            params={"budget": 512, "n_sink": 4, "recent_ratio": 0.5, "squeeze_ratio": 0.7, "seed": 0},
            paper=PAPER,
        )
    ]
