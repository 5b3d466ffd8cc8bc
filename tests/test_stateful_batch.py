"""Which methods the batch rules of the stateful cache programs (``test_stateful_programs.py``)
skip: only kivi / h2o_kivi, while their caches cannot batch rows that free different numbers of
slots in one step."""

from __future__ import annotations

from _regression_helpers import batches_uneven
from _stateful_helpers import METHODS


def test_kivi_batches_rows_with_different_eviction_counts_or_is_known_not_to():
    """The batch rules are skipped only for kivi / h2o_kivi, and only while their disposition
    refuses rows that free different numbers of tokens (being fixed separately)."""
    skipped = {m for m in METHODS if not batches_uneven(m)}
    assert skipped <= {"kivi", "h2o_kivi"}, f"batch rules skipped for {sorted(skipped)}"
