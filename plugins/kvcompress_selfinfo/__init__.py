"""Self-information: keep what the model did not expect (Selective Context, Li et al., 2023).

Components: scorer ``selfinfo`` (Eq. 1, ``-log P(x_t | x_<t)`` from the model's own
predictions in the same forward: no extra pass) and selector ``span`` (Eq. 3's unit information
over every 16-token window; a token scores the best window holding it). Method ``selfinfo``
composes them with ``drop`` and ``uniform`` (4 sinks and the 32 most recent tokens kept) and
scores numbers' digits at least 7 nats (``floor_ids="digits"``, resolved with the tokenizer the
cache is built with; see :mod:`.scorer`). It
needs the model hook (mlx-lm's generation entry points and ``kvcompress.install`` give it) and a
model that returns logits.
"""

from kvcompress import ComponentSpec, MethodSpec, hookimpl

from .scorer import UNKNOWN, SelfInfoScorer, SelfInfoState, digit_ids, special_ids
from .selector import SpanSelector

__all__ = ["SelfInfoScorer", "SelfInfoState", "SpanSelector", "UNKNOWN", "digit_ids", "special_ids"]

PAPER = "https://arxiv.org/abs/2310.06201"


@hookimpl
def kvcompress_scorers():
    return [
        ComponentSpec(
            "scorer", "selfinfo", SelfInfoScorer,
            "self-information -log p(token | prefix) from the model's own predictions (no extra pass)", PAPER,
        )
    ]


@hookimpl
def kvcompress_selectors():
    return [
        ComponentSpec(
            "selector", "span", SpanSelector,
            "evict the tokens whose best w-token window (any start) has the lowest summed score", PAPER,
        )
    ]


@hookimpl
def kvcompress_methods():
    return [
        MethodSpec(
            name="selfinfo",
            scorer="selfinfo",
            selector="span",
            disposition="drop",
            budget="uniform",
            summary="Selective Context: keep the tokens of the 16-token spans the model found most informative (-log p)",
            params={"budget": 512, "span": 16, "step": 16, "n_sink": 4, "recent": 32, "floor_ids": "digits", "floor": 7.0},
            paper=PAPER,
        )
    ]
