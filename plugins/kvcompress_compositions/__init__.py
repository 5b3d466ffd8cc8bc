"""Cross compositions: named methods no single paper defines, built only from registered parts.

* ``snapkv_merge`` -- SnapKV's window score + CaM's gated merge + PyramidKV's budget: the SnapKV
  choice of loser, folded into its most similar survivor behind the Eq. 14 gate, under a budget
  pyramid.
* ``tova_chunk`` -- TOVA's head-averaged last-query score + ChunkKV's whole-chunk eviction: one
  set of chunks per layer, refreshed every step.
* ``h2o_pyramid`` -- H2O's cumulative attention mass + PyramidKV's per-layer budgets.

This plugin registers methods only; it needs the plugins that provide their components
(``kvcompress_snapkv``, ``kvcompress_tova``, ``kvcompress_chunkkv``, ``kvcompress_pyramidkv``,
``kvcompress_h2o``, ``kvcompress_cam``, ``kvcompress_basic``).
"""

from kvcompress import MethodSpec, hookimpl

SNAPKV = "https://arxiv.org/abs/2404.14469"
TOVA = "https://arxiv.org/abs/2401.06104"
H2O = "https://arxiv.org/abs/2306.14048"


@hookimpl
def kvcompress_methods():
    return [
        MethodSpec(
            name="snapkv_merge",
            scorer="snapkv",
            selector="lowest",
            disposition="gated_merge",
            budget="pyramid",
            summary="SnapKV loser merged (CaM gate) into its nearest survivor, pyramid budgets",
            # beta = 2 (PyramidKV's 20 starves the top layers of shallow models held at budget
            # through decode; docs/methods/compositions.md)
            params={
                "budget": 1024, "recent": 32, "kernel": 7, "pooling": "max", "interval": 0,
                "beta": 2.0, "n_sink": 0, "merge": "sim_weighted", "merge_gate": True,
                "merge_keys": False, "seed": 0,
            },
            paper=SNAPKV,
        ),
        MethodSpec(
            name="tova_chunk",
            scorer="tova",
            selector="chunk",
            disposition="drop",
            budget="uniform",
            summary="TOVA's head-averaged last-query score, evicting whole 10-token chunks",
            params={"budget": 512, "chunk": 10, "n_sink": 0, "recent": 0, "reuse_layers": 1},
            paper=TOVA,
        ),
        MethodSpec(
            name="h2o_pyramid",
            scorer="h2o",
            selector="lowest",
            disposition="drop",
            budget="pyramid",
            summary="H2O's cumulative attention mass under PyramidKV's per-layer budgets",
            # H2O's heavy/recent split (as the ``h2o`` method): half of each layer's budget is
            # the recent window, so the pyramid's own window w is 0. beta = 2 is ours (PyramidKV's
            # 20 starves the top layers of shallow models; docs/methods/compositions.md).
            params={"budget": 512, "n_sink": 4, "recent": 0, "recent_ratio": 0.5, "beta": 2.0},
            paper=H2O,
        ),
    ]
