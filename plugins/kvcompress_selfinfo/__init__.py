"""Self-information: keep what the model did not expect (Selective Context, Li et al., 2023).

Component: scorer ``selfinfo`` (Eq. 1, ``-log P(x_t | x_<t)`` from the model's own predictions
in the same forward: no extra pass). Method ``selfinfo`` composes it with ``chunk`` (ChunkKV's
whole-chunk selector: Eq. 3's unit information as the sum over 16 consecutive tokens; 4 sinks
and the 32 most recent tokens kept), ``drop`` and ``uniform``. It needs the model hook (mlx-lm's
generation entry points and ``kvcompress.install`` give it) and a model that returns logits.
"""

from kvcompress import ComponentSpec, MethodSpec, hookimpl

from .scorer import UNKNOWN, SelfInfoScorer, SelfInfoState

__all__ = ["SelfInfoScorer", "SelfInfoState", "UNKNOWN"]

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
def kvcompress_methods():
    return [
        MethodSpec(
            name="selfinfo",
            scorer="selfinfo",
            selector="chunk",
            disposition="drop",
            budget="uniform",
            summary="Selective Context: keep the 16-token chunks the model found most informative (-log p)",
            params={"budget": 512, "chunk": 16, "n_sink": 4, "recent": 32, "reuse_layers": 1},
            paper=PAPER,
        )
    ]
