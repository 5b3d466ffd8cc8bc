"""Smoke tests of the synthetic benchmark at tiny sizes (seconds): it covers every registered
method, budget and scenario, and produces sane, reproducible numbers, JSON, tables and a plot."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest

from kvcompress import MethodSpec, Registry, hookimpl
from kvcompress.bench import _report
from kvcompress.bench import synthetic as syn

TINY_SYN = dict(
    seq_lens=(96,),
    budgets=(24, 128),  # 128 >= seq_len: nothing is ever evicted
    n_decode=24,
    n_probe=8,
    n_clusters=4,
    batch=2,  # the harness and caches are vectorised over batch
    scenarios=("structured", "iid"),
)


class _ToyPlugin:
    """An in-process plugin adding a method, to check the sweep picks up new methods."""

    @hookimpl
    def kvcompress_methods(self):
        return [
            MethodSpec(
                name="toy_recent", scorer="h2o", selector="lowest", disposition="drop",
                budget="uniform", summary="test method", params={"recent_ratio": 0.5},
            )
        ]


@pytest.fixture(scope="module")
def toy_registry():
    return Registry(plugins=[("toy_recent_plugin", _ToyPlugin())])


@pytest.fixture(scope="module")
def syn_payload(toy_registry):
    with warnings.catch_warnings():
        # methods that cannot run model-free warn; their records carry the error (tested below)
        warnings.simplefilter("ignore", RuntimeWarning)
        return syn.run_synthetic(syn.SyntheticSettings(**TINY_SYN), registry=toy_registry)


CORE = ("h2o", "cam", "toy_recent", "full", "rotating")


def test_synthetic_covers_every_method_budget_and_scenario(syn_payload, toy_registry):
    # every registered method has a record for every (scenario, budget): a number, or the
    # reason it cannot run model-free / at that budget
    got = {(r["scenario"], r["budget"], r["method"]) for r in syn_payload["results"]}
    for scenario in TINY_SYN["scenarios"]:
        for budget in TINY_SYN["budgets"]:
            for name in [*toy_registry.methods, "full", "rotating"]:
                assert (scenario, budget, name) in got, (scenario, budget, name)
    for r in syn_payload["results"]:
        assert ("perturbation" in r) != ("error" in r), r
        if r["method"] in CORE:
            assert "error" not in r, r
    res = [r for r in syn_payload["results"] if "error" not in r]
    # CaM's merge modes x gate are all swept
    cam = {r["label"] for r in res if r["method"] == "cam"}
    assert cam == {f"cam:{m}{g}" for m in ("sw", "mean", "drop") for g in ("+g", "-g")}
    assert set(syn_payload["methods"]) == set(toy_registry.methods)


def test_synthetic_values_are_sane(syn_payload):
    res = [r for r in syn_payload["results"] if "error" not in r]
    for r in res:
        assert math.isfinite(r["perturbation"]) and 0.0 <= r["perturbation"] <= 2.0, r
        if r["method"] == "full":
            assert r["perturbation"] == pytest.approx(0.0, abs=1e-6)
        if r["kind"] == "method":
            assert r["score_source"] == "queries", r  # the real scoring path ran
            assert r["tokens_kept"] <= r["cache_budget"]
    # without eviction, dropping/merging methods reproduce the full cache
    for r in res:
        if r["budget"] >= r["seq_len"] and r["method"] in CORE:
            assert r["perturbation"] < 1e-4, r
            assert r.get("evictions", 0) == 0
    # with eviction the compressed caches really lose information
    for r in res:
        if r["budget"] < r["seq_len"] and r["method"] in ("h2o", "rotating"):
            assert r["perturbation"] > 1e-3, r


def test_synthetic_cam_drop_equals_h2o(syn_payload):
    by = {(r["scenario"], r["budget"], r["label"]): r.get("perturbation") for r in syn_payload["results"]}
    for (scenario, budget, label), p in by.items():
        if label in ("cam:drop+g", "cam:drop-g"):
            assert p is not None and p == by[(scenario, budget, "h2o")]


def test_structured_data_has_peaked_attention_and_is_seeded():
    s = syn.SyntheticSettings(**TINY_SYN)
    a = syn.make_data(s, 96, seed=3)
    b = syn.make_data(s, 96, seed=3)
    c = syn.make_data(s, 96, seed=4)
    assert np.array_equal(np.array(a.keys), np.array(b.keys))
    assert np.array_equal(np.array(a.probes), np.array(b.probes))
    assert not np.array_equal(np.array(a.keys), np.array(c.keys))
    iid = syn.make_data(s, 96, seed=3, scenario="iid")
    peaked, diffuse = syn.probe_stats(a), syn.probe_stats(iid)
    # "some tokens matter": structured probes concentrate on far fewer tokens than i.i.d. ones
    assert peaked["effective_support"] < 0.5 * diffuse["effective_support"]
    assert peaked["top1_weight"] > 2 * diffuse["top1_weight"]


def test_synthetic_outputs_json_table_and_plot(syn_payload, tmp_path):
    path = _report.write_json(tmp_path / "synthetic.json", syn_payload)
    data = json.loads(path.read_text())
    for key in ("platform", "cpu_count", "mlx", "ld_preload", "openblas_preloaded", "date_utc"):
        assert key in data["machine"]
    assert data["settings"]["budgets"] == list(TINY_SYN["budgets"])
    cols, rows = syn.results_table(syn_payload)
    assert len(rows) == len(TINY_SYN["scenarios"]) * len(TINY_SYN["budgets"])
    text = _report.print_table("t", cols, rows, plain=True)
    assert "cam:sw+g" in text and "h2o" in text
    pytest.importorskip("matplotlib")
    png = syn.plot_synthetic(syn_payload, tmp_path / "synthetic.png")
    assert png.stat().st_size > 10_000


def test_write_json_requires_metadata(tmp_path):
    with pytest.raises(ValueError, match="machine"):
        _report.write_json(tmp_path / "x.json", {"settings": {}})
