"""kvcompress's reusable contract tests (``kvcompress.testing``) on this plugin's scorer and method.

Run from this folder after ``pip install -e .``: ``python -m pytest -q``. Each check raises a
``ContractFailure`` naming the contract a component broke; the returned report lists what passed.
"""

from __future__ import annotations

import pytest

from kvcompress.testing import ContractFailure, check_method, check_scorer, contract_cases

DIST = "kvcompress-knorm"


def test_the_cases_are_what_this_package_registers():
    assert {c.id for c in contract_cases(dist=DIST)} == {"scorer:knorm", "method:knorm"}


@pytest.mark.parametrize("case", contract_cases(dist=DIST), ids=str)
def test_contract(case):
    """Unit contracts of the kind, then a generation run on a tiny random Llama."""
    case.check()


def test_knorm_scorer_is_query_free_and_float32():
    report = check_scorer("knorm", run=False)
    # "declared requirements": knorm requires nothing, and the check proves it ignores the queries
    assert {"float32 scores", "finite scores", "declared requirements", "batch rows independent"} <= set(
        report.passed
    )


def test_knorm_method_in_generation():
    report = check_method("knorm")
    assert {"budget held", "exact without eviction", "save/load", "float16", "deterministic", "batched",
            "sinks kept (n_sink=4)", "protected kept"} <= set(report.passed)  # the paper's rule: no sinks


def test_knorm_composes_with_other_plugins_components():
    # StreamingLLM's position shift: survivors attended at contiguous positions
    report = check_scorer("knorm", compose={"disposition": "shift"})
    assert {"run: save/load", "run: batched"} <= set(report.passed)
    with pytest.raises(ContractFailure, match="contract 'composition' broken: CompositionError"):
        check_scorer("knorm", compose={"disposition": "gated_merge"})  # needs attention mass
