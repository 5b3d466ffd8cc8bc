"""kvcompress-knorm: an example third-party kvcompress plugin.

Registers through the ``kvcompress`` entry-point group (see ``pyproject.toml``):

* scorer ``"knorm"`` -- ``-||k||_2`` per slot (:class:`KeyNormScorer`);
* method ``"knorm"`` -- knorm scorer + ``lowest`` selector + ``drop`` + ``uniform`` budget.
"""

from kvcompress import ComponentSpec, MethodSpec, hookimpl

from .scorer import KeyNormScorer, key_norm_score

__all__ = ["KeyNormScorer", "key_norm_score"]
__version__ = "0.1.0"

PAPER = "https://arxiv.org/abs/2406.11430"


@hookimpl
def kvcompress_scorers():
    return [
        ComponentSpec(
            "scorer", "knorm", KeyNormScorer,
            "negative L2 norm of each stored key (low-norm keys are kept)", PAPER,
        )
    ]


@hookimpl
def kvcompress_methods():
    return [
        MethodSpec(
            name="knorm",
            scorer="knorm",
            selector="lowest",
            disposition="drop",
            budget="uniform",
            summary="keep the lowest-L2-norm keys, drop the rest (Devoto et al., 2024)",
            # The paper ranks every token by key norm. Ours: keep 4 attention sinks and the most
            # recent half of the budget too (as H2O does), so the cache holds up while it is kept
            # at budget through decode; n_sink=0, recent_ratio=0 is the paper's rule.
            params={"budget": 512, "n_sink": 4, "recent_ratio": 0.5},
            paper=PAPER,
        )
    ]
