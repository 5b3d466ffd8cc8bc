"""KVzip: query-agnostic compression by context reconstruction (Kim et al., 2025).

Component: scorer ``kvzip`` (Algorithm 1's chunked reconstruction score, from scoring passes).
Method ``kvzip`` composes it with ``lowest`` (4 sinks, a recent window of 4), ``drop`` and
``uniform``. Its reconstruction passes are extra forwards of the whole model: their count,
tokens and time are in every layer's ``cache.diagnostics`` (``scoring_passes``,
``scoring_pass_tokens``, ``scoring_pass_seconds``); ``interval = 0`` turns off decode-time passes.
"""

from kvcompress import ComponentSpec, MethodSpec, hookimpl

from .scorer import KVzipScorer, KVzipState, chat_reconstruction, pass_score, repeat_prompt

__all__ = ["KVzipScorer", "KVzipState", "chat_reconstruction", "pass_score", "repeat_prompt"]

PAPER = "https://arxiv.org/abs/2505.23416"


@hookimpl
def kvcompress_scorers():
    return [
        ComponentSpec(
            "scorer", "kvzip", KVzipScorer,
            "max attention each slot gets while the model reconstructs its context in chunks (extra forwards)",
            PAPER,
        )
    ]


@hookimpl
def kvcompress_methods():
    return [
        MethodSpec(
            name="kvzip",
            scorer="kvzip",
            selector="lowest",
            disposition="drop",
            budget="uniform",
            summary="KVzip: keep what the model needs to reconstruct its context (chunked reconstruction passes)",
            params={"budget": 512, "chunk": 128, "interval": 32, "n_sink": 4, "recent": 4},
            paper=PAPER,
        )
    ]
