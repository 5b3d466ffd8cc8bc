"""CaM: cache merging -- H2O's choice of loser, merged into survivors behind the Eq. 14 gate."""

from kvcompress import ComponentSpec, MethodSpec, hookimpl

from .merge import GatedMerge, MergeState

__all__ = ["GatedMerge", "MergeState"]

PAPER = "https://proceedings.mlr.press/v235/zhang24n.html"


@hookimpl
def kvcompress_dispositions():
    return [
        ComponentSpec(
            "disposition", "gated_merge", GatedMerge,
            "merge evicted tokens into survivors behind CaM's Bernoulli gate (Eq. 14)", PAPER,
        )
    ]


@hookimpl
def kvcompress_methods():
    return [
        MethodSpec(
            name="cam",
            scorer="h2o",
            selector="lowest",
            disposition="gated_merge",
            budget="uniform",
            summary="CaM: H2O's loser merged into its most similar survivor behind a seeded gate",
            params={
                "budget": 512,
                "n_sink": 4,
                "recent_ratio": 0.5,
                "merge": "sim_weighted",
                "merge_gate": True,
                "merge_keys": False,
                "transfer_mass": False,
                "seed": 0,
            },
            paper=PAPER,
        )
    ]
