"""ChunkKV: keep or drop whole chunks of consecutive tokens (Liu et al., 2025).

Component: selector ``chunk``. Method ``chunkkv`` = scorer ``snapkv`` (observation-window
attention, no pooling: Algorithm 1 sums raw window attention per chunk) + ``chunk`` + ``drop``
+ ``uniform``; chunk size 10 (the paper's robust default), window 32, no index reuse by default
(``reuse_layers=2`` turns layer-wise index reuse on).
"""

from kvcompress import ComponentSpec, MethodSpec, hookimpl

from .selector import ChunkSelector

__all__ = ["ChunkSelector"]

PAPER = "https://arxiv.org/abs/2502.00299"


@hookimpl
def kvcompress_selectors():
    return [
        ComponentSpec(
            "selector", "chunk", ChunkSelector,
            "evict whole chunks of c consecutive positions with the lowest summed score", PAPER,
        )
    ]


@hookimpl
def kvcompress_methods():
    return [
        MethodSpec(
            name="chunkkv",
            scorer="snapkv",
            selector="chunk",
            disposition="drop",
            budget="uniform",
            summary="ChunkKV: SnapKV window attention summed per 10-token chunk; whole chunks kept",
            params={
                "budget": 1024, "recent": 32, "pooling": "none", "interval": 0,
                "chunk": 10, "n_sink": 0, "reuse_layers": 1,
            },
            paper=PAPER,
        )
    ]
