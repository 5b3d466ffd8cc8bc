"""KeyDiff: evict the keys most similar to the mean key direction (Park et al., 2025).

Component: scorer ``keydiff`` (negative cosine similarity to the mean normalised key; needs no
queries and no attention pass). Method ``keydiff`` composes it with ``lowest``, ``drop`` and
``uniform``; our defaults protect 4 sinks and 16 recent tokens (kvpress's ``n_sink=0, recent=0``
are reachable as parameters; see ``docs/methods/keydiff.md``).
"""

from kvcompress import ComponentSpec, MethodSpec, hookimpl

from .scorer import KeyDiffScorer, KeyDiffState

__all__ = ["KeyDiffScorer", "KeyDiffState"]

PAPER = "https://arxiv.org/abs/2504.15364"


@hookimpl
def kvcompress_scorers():
    return [
        ComponentSpec(
            "scorer", "keydiff", KeyDiffScorer,
            "negative cosine similarity of each key to the mean normalised held key (query-free)",
            PAPER,
        )
    ]


@hookimpl
def kvcompress_methods():
    return [
        MethodSpec(
            name="keydiff",
            scorer="keydiff",
            selector="lowest",
            disposition="drop",
            budget="uniform",
            summary="KeyDiff: evict the keys closest to the mean key direction (query-free)",
            params={"budget": 512, "n_sink": 4, "recent": 16},
            paper=PAPER,
        )
    ]
