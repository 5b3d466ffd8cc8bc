"""TOVA: token omission via attention -- drop the token the current query attends least,
judged over all heads of the layer (Oren et al., 2024).

Component: scorer ``tova``. Method ``tova`` composes it with ``lowest`` (no sinks, no window),
``drop`` and ``uniform``; default budget 512 (the reference's example ``cache_size``).
"""

from kvcompress import ComponentSpec, MethodSpec, hookimpl

from .scorer import TOVAScorer

__all__ = ["TOVAScorer"]

PAPER = "https://arxiv.org/abs/2401.06104"


@hookimpl
def kvcompress_scorers():
    return [
        ComponentSpec(
            "scorer", "tova", TOVAScorer,
            "attention of the step's last query, averaged over all heads of the layer", PAPER,
        )
    ]


@hookimpl
def kvcompress_methods():
    return [
        MethodSpec(
            name="tova",
            scorer="tova",
            selector="lowest",
            disposition="drop",
            budget="uniform",
            summary="TOVA: evict the token the last query attends least (mean over all heads)",
            params={"budget": 512, "n_sink": 0, "recent": 0},
            paper=PAPER,
        )
    ]
