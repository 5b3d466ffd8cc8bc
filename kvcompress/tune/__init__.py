"""``kvcompress tune``: a bounded search over registered methods and their main parameters.

* :mod:`~kvcompress.tune.space`: :data:`SEARCH_SPACE` and the candidates built from it;
* :mod:`~kvcompress.tune.workloads`: what a candidate is measured on (the benchmarks' code);
* :mod:`~kvcompress.tune.search`: the order, the bounds, the estimates, the held-out finalists;
* :mod:`~kvcompress.tune.report`: the ranking, ``tune.toml``, ``tune.json``, ``tune.png``;
* :mod:`~kvcompress.tune.cli`: the command's options.
"""

from .search import COST_FACTOR, MEMORY_SLACK, run_search
from .space import SEARCH_SPACE, Candidate, method_space
from .workloads import LongctxWorkload, Measurement, RetrievalWorkload, TextWorkload, paired_gap

__all__ = ["SEARCH_SPACE", "MEMORY_SLACK", "COST_FACTOR", "Candidate", "method_space", "run_search",
           "Measurement", "paired_gap", "TextWorkload", "RetrievalWorkload", "LongctxWorkload"]
