"""Expected Attention: keep the keys future queries are expected to attend (Devoto et al., 2025).

Component: scorer ``expected_attention`` (Gaussian statistics of recent pre-RoPE queries,
rotated to the next positions, optionally weighted by the value norm). Method
``expected_attention`` composes it with ``lowest`` (sinks and a recent window protected),
``drop`` and ``uniform``. Defaults are ours (measured held through decode on stories260K);
kvpress's are reachable as parameters: ``n_future_positions=512``, ``query_window=128``,
``interval=0`` (see ``docs/methods/expected_attention.md``).
"""

from kvcompress import ComponentSpec, MethodSpec, hookimpl

from .scorer import DEFAULT_ROPE, ExpectedAttentionScorer, QueryWindow, averaged_rotation

__all__ = ["ExpectedAttentionScorer", "QueryWindow", "averaged_rotation", "DEFAULT_ROPE"]

PAPER = "https://arxiv.org/abs/2510.00636"


@hookimpl
def kvcompress_scorers():
    return [
        ComponentSpec(
            "scorer", "expected_attention", ExpectedAttentionScorer,
            "expected attention of future queries (mean/covariance of recent pre-RoPE queries, "
            "RoPE-averaged over the next positions), times the value norm",
            PAPER,
        )
    ]


@hookimpl
def kvcompress_methods():
    return [
        MethodSpec(
            name="expected_attention",
            scorer="expected_attention",
            selector="lowest",
            disposition="drop",
            budget="uniform",
            summary="Expected Attention: evict the keys future queries are expected to attend least",
            params={"budget": 512, "n_sink": 4, "recent": 16, "interval": 16, "query_window": 32,
                    "n_future_positions": 32},
            paper=PAPER,
        )
    ]
