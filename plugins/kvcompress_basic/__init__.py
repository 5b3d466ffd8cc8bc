"""Shared building blocks: the lowest-score selector, the drop disposition, the uniform budget."""

from kvcompress import ComponentSpec, hookimpl

from .budgets import UniformBudget
from .dispositions import Drop
from .selectors import LowestScoreSelector

__all__ = ["LowestScoreSelector", "Drop", "UniformBudget"]


@hookimpl
def kvcompress_selectors():
    return [
        ComponentSpec(
            "selector", "lowest", LowestScoreSelector,
            "evict the lowest-score slots; sinks and an optional recent window are protected",
        )
    ]


@hookimpl
def kvcompress_dispositions():
    return [ComponentSpec("disposition", "drop", Drop, "evicted tokens are discarded")]


@hookimpl
def kvcompress_budgets():
    return [ComponentSpec("budget", "uniform", UniformBudget, "the same token budget in every layer")]
