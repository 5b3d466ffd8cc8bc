"""PyramidKV: SnapKV scoring under a pyramid of per-layer budgets (Cai et al., 2024).

Component: budget ``pyramid``. Method ``pyramidkv`` = scorer ``snapkv`` + selector ``lowest``
(window protected) + ``drop`` + ``pyramid``, with KVCache-Factory's LongBench settings
(w = 8, k = 7, max pooling), except two defaults that are ours: ``beta = 2`` (paper 20: no layer
gets less than half the mean prefix) and ``interval = 1`` (paper 0: re-score during decode).
"""

from kvcompress import ComponentSpec, MethodSpec, hookimpl

from .budget import PyramidBudget, pyramid_budgets, smallest_budget

__all__ = ["PyramidBudget", "pyramid_budgets", "smallest_budget"]

PAPER = "https://arxiv.org/abs/2406.02069"


@hookimpl
def kvcompress_budgets():
    return [
        ComponentSpec(
            "budget", "pyramid", PyramidBudget,
            "per-layer budgets falling linearly with depth; same total as uniform", PAPER,
        )
    ]


@hookimpl
def kvcompress_methods():
    return [
        MethodSpec(
            name="pyramidkv",
            scorer="snapkv",
            selector="lowest",
            disposition="drop",
            budget="pyramid",
            summary="PyramidKV: SnapKV selection with a linear per-layer budget pyramid",
            # Ours: beta = 2 (paper 20) and interval = 1 (paper 0, compress once at prefill), so
            # the defaults hold up when the cache is held at budget through decode on shallow
            # models (docs/methods/pyramidkv.md, measured); the paper's values are parameters.
            params={
                "budget": 1024, "recent": 8, "kernel": 7, "pooling": "max", "interval": 1,
                "beta": 2.0, "n_sink": 0,
            },
            paper=PAPER,
        )
    ]
