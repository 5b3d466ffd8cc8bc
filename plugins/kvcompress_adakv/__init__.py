"""AdaKV: head-wise budgets that really free memory (selector ``adaptive``); method ``adakv`` is
AdaKV's allocation over SnapKV scores, as kvpress pairs them."""

from kvcompress import ComponentSpec, MethodSpec, hookimpl

from .selector import AdaptiveSelector, head_best

__all__ = ["AdaptiveSelector", "head_best"]

PAPER = "https://arxiv.org/abs/2407.11550"


@hookimpl
def kvcompress_selectors():
    return [
        ComponentSpec(
            "selector", "adaptive", AdaptiveSelector,
            "head-wise budgets: the lowest scores of a layer's heads together leave (each head keeps "
            "alpha x C); heads hold different counts within uniform bytes", PAPER,
        )
    ]


@hookimpl
def kvcompress_methods():
    return [
        MethodSpec(
            name="adakv",
            scorer="snapkv",
            selector="adaptive",
            disposition="drop",
            budget="uniform",
            summary="AdaKV: SnapKV scores, the layer's top H x C (head, token) pairs kept, alpha x C per head",
            params={"budget": 1024, "recent": 32, "kernel": 7, "pooling": "max", "interval": 0, "n_sink": 0,
                    "alpha": 0.2, "heads": 0, "step": 0},
            paper=PAPER,
        )
    ]
