"""SnapKV: keep the prefix tokens the last window of queries attends to (Li et al., 2024).

Component: scorer ``snapkv`` (observation-window attention, pooled). Method ``snapkv`` composes
it with ``lowest`` (the window protected as ``recent = w``), ``drop`` and ``uniform``.
Defaults are the reference's LongBench configuration (``ablation_c1024_w32_k7_maxpool.json``):
C = 1024, w = 32, k = 7, max pooling, compression at prefill only.
"""

from kvcompress import ComponentSpec, MethodSpec, hookimpl

from .scorer import SnapKVScorer, pool1d, pool_by_position, window_mass

__all__ = ["SnapKVScorer", "pool1d", "pool_by_position", "window_mass"]

PAPER = "https://arxiv.org/abs/2404.14469"


@hookimpl
def kvcompress_scorers():
    return [
        ComponentSpec(
            "scorer", "snapkv", SnapKVScorer,
            "attention of the last w queries over the prefix, 1-D pooled (avg/max) in position order",
            PAPER,
        )
    ]


@hookimpl
def kvcompress_methods():
    return [
        MethodSpec(
            name="snapkv",
            scorer="snapkv",
            selector="lowest",
            disposition="drop",
            budget="uniform",
            summary="SnapKV: top (C - w) prefix tokens by pooled window attention, plus the window",
            params={"budget": 1024, "recent": 32, "kernel": 7, "pooling": "max", "interval": 0, "n_sink": 0},
            paper=PAPER,
        )
    ]
