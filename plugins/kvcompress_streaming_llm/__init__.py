"""StreamingLLM: attention sinks plus a sliding window of recent tokens (Xiao et al., ICLR 2024).

Components: scorer ``recency`` (score = token position) and disposition ``shift`` (drop, then
attend the survivors at contiguous RoPE positions, as the reference's ``pos_shift`` does).
Methods: ``streaming_llm`` (positions kept, like mlx-lm's ``RotatingKVCache``) and
``streaming_llm_shift`` (the reference's position shift). The selector is ``lowest`` and the
budget ``uniform``, reused from ``kvcompress_basic``.
"""

from kvcompress import ComponentSpec, MethodSpec, hookimpl

from .scorer import RecencyScorer
from .shift import PositionShift, RopeParams, rope_params

__all__ = ["RecencyScorer", "PositionShift", "RopeParams", "rope_params"]

PAPER = "https://arxiv.org/abs/2309.17453"


@hookimpl
def kvcompress_scorers():
    return [
        ComponentSpec(
            "scorer", "recency", RecencyScorer,
            "score = token position: the oldest unprotected token leaves first", PAPER,
        )
    ]


@hookimpl
def kvcompress_dispositions():
    return [
        ComponentSpec(
            "disposition", "shift", PositionShift,
            "drop evicted tokens; survivors are attended at contiguous RoPE positions", PAPER,
        )
    ]


@hookimpl
def kvcompress_methods():
    common = dict(scorer="recency", selector="lowest", budget="uniform", paper=PAPER)
    return [
        MethodSpec(
            name="streaming_llm",
            disposition="drop",
            summary="StreamingLLM: the first n_sink tokens plus the most recent ones; positions kept",
            params={"budget": 512, "n_sink": 4},
            **common,
        ),
        MethodSpec(
            name="streaming_llm_shift",
            disposition="shift",
            summary="StreamingLLM with the reference's position shift (keys at contiguous positions)",
            params={"budget": 512, "n_sink": 4},
            **common,
        ),
    ]
