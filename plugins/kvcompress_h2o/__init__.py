"""H2O: heavy-hitter oracle eviction (cumulative attention mass, lowest evicted, dropped)."""

from kvcompress import ComponentSpec, MethodSpec, hookimpl

from .scorer import H2OScorer

__all__ = ["H2OScorer"]

PAPER = "https://arxiv.org/abs/2306.14048"


@hookimpl
def kvcompress_scorers():
    return [ComponentSpec("scorer", "h2o", H2OScorer, "cumulative attention mass of real queries", PAPER)]


@hookimpl
def kvcompress_methods():
    return [
        MethodSpec(
            name="h2o",
            scorer="h2o",
            selector="lowest",
            disposition="drop",
            budget="uniform",
            summary="H2O: evict the lowest cumulative attention mass; sinks kept",
            params={"budget": 512, "n_sink": 4, "recent_ratio": 0.5},
            paper=PAPER,
        )
    ]
