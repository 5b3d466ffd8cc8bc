"""Smoke tests of the benchmark library at tiny sizes (seconds): the harnesses run end to end,
cover every registered method and budget, and produce sane, reproducible numbers."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest

import kvcompress
from kvcompress import MethodSpec, Registry, hookimpl
from kvcompress.bench import _harness, _profile, _profile_report, _report
from kvcompress.bench import speed as speed_mod
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


# ------------------------------------------------------------------------------------------------
# speed
# ------------------------------------------------------------------------------------------------

TINY_SPEED = dict(
    context=160, budget=64, decode_tokens=4, decode_block=2, rounds=2, prefill_step_size=64, n_layers=2,
    hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, intermediate=256, vocab=256,
    profile_steps=3, dtype_probe=False,
)


@pytest.fixture(scope="module")
def speed_payload():
    return speed_mod.run_speed(speed_mod.SpeedSettings(**TINY_SPEED))


def test_speed_covers_methods_and_baselines_with_finite_ratios(speed_payload):
    s = speed_mod.SpeedSettings(**TINY_SPEED)
    summ = speed_payload["summary"]
    assert set(summ) == {"h2o", "cam", "rotating", "full"}
    for kind, rec in summ.items():
        assert len(rec["decode_tok_s"]) == s.rounds
        assert len(rec.get("decode_ratio_by_block", [])) in (0, s.rounds * s.decode_tokens // s.decode_block)
        assert rec["prefill_s_median"] > 0 and math.isfinite(rec["prefill_s_median"])
        assert rec["decode_tok_s_median"] > 0 and math.isfinite(rec["decode_tok_s_median"])
        if kind != "rotating":
            for key in ("decode_ratio", "prefill_ratio", "decode_ratio_cpu", "prefill_ratio_cpu"):
                assert rec[key] > 0 and math.isfinite(rec[key]), (kind, key)
    for m in ("h2o", "cam"):
        assert summ[m]["decode_target_met"] == (summ[m]["decode_ratio"] >= 0.9)
        assert summ[m]["prefill_target_met"] == (summ[m]["prefill_ratio"] <= 1.3)
    # round-robin order: each round starts with a different kind
    starts = [r["order"][0] for r in speed_payload["rounds"]]
    assert len(set(starts)) == len(starts)
    # the bounded caches really are bounded; the full one holds everything
    r0 = speed_payload["rounds"][0]["by_kind"]
    for kind in ("h2o", "cam", "rotating"):
        assert r0[kind]["stored_tokens"] <= s.budget
    # generate_step runs one step ahead of what it yields: the prompt, the first token and
    # decode_tokens more fed back
    assert r0["full"]["stored_tokens"] == s.context + s.decode_tokens + 1
    # decode was timed block by block for every kind
    for kind in summ:
        assert len(r0[kind]["decode_s_per_token"]) == s.decode_tokens // s.decode_block


def test_speed_profile_counts_cache_ops(speed_payload):
    prof = speed_payload["profile"]
    ops = prof["ops_per_layer_step"]
    assert ops["rotating"]["update_and_fetch"] >= 1
    for m in ("h2o", "cam"):
        assert ops[m]["update_and_fetch"] > ops["rotating"]["update_and_fetch"]
        assert ops[m]["decoder_layer_total"] > ops[m]["update_and_fetch"]
        # a compressing decode step: one softmax gives the output and the scorer's mass
        assert ops[m]["attend_observe_by_op"].get("Softmax") == 1
        # (CaM's step also plans the next step's merge: the loser's cosine to every key)
        assert ops[m]["attend_observe_by_op"].get("Matmul") == (3 if m == "cam" else 2)
        for v in prof["component_ms"][m].values():
            assert v > 0 and math.isfinite(v)
    for var in ("rotating", "h2o", "h2o[no_evict]", "h2o[no_evict,no_score]", "cam", "cam[no_evict]"):
        assert prof["model_step_ms"][var]["step_ms_median"] > 0
        assert prof["layer_step_ms"][var]["ms"] > 0
    for var in ("rotating", "h2o", "h2o[no_score]", "cam", "cam[no_score]"):
        assert prof["layer_prefill_chunk_ms"][var]["ms"] > 0
    assert {"sdpa", "attention_mass"} <= set(prof["prefill_component_ms"])
    cols, rows = _profile_report.profile_table(speed_payload)
    assert len(rows) == len(prof["model_step_ms"])


def test_speed_json_and_tables(speed_payload, tmp_path):
    data = json.loads(_report.write_json(tmp_path / "speed.json", speed_payload).read_text())
    assert data["settings"]["context"] == TINY_SPEED["context"]
    assert data["machine"]["openblas_preloaded"] in (True, False)
    cols, rows = speed_mod.summary_table(speed_payload)
    assert [r[0] for r in rows] == ["h2o", "cam", "rotating", "full"]
    pytest.importorskip("matplotlib")
    assert speed_mod.plot_speed(speed_payload, tmp_path / "speed.png").stat().st_size > 10_000


def test_count_ops_counts_primitives():
    import mlx.core as mx

    a = mx.ones((4, 4))
    mx.eval(a)
    out = _profile.count_ops((a @ a + 1).sum())
    assert out["by_op"].get("Matmul") == 1
    assert out["n_ops"] == sum(out["by_op"].values()) >= 3


def test_dtype_probe_reports_each_dtype():
    s = speed_mod.SpeedSettings(**TINY_SPEED)
    probe = speed_mod.dtype_probe(s, prefill_tokens=8, decode_steps=4)
    assert set(probe) == {"float32", "bfloat16", "float16"}
    for rec in probe.values():
        assert rec["prefill_s"] > 0 and rec["decode_step_s"] > 0


def test_interleave_rotates_order_and_times_every_stepper():
    calls = []
    steppers = {n: (lambda n=n: calls.append(n)) for n in "abc"}
    out = _harness.interleave(steppers, n_blocks=3, k=2)
    assert {n: len(v) for n, v in out.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for v in out.values() for t in v)
    # blocks of k calls, the starting stepper rotated each block
    assert calls[::2] == list("abc") + list("bca") + list("cab")


def test_speed_settings_validation():
    with pytest.raises(ValueError, match="decode_block"):
        speed_mod.SpeedSettings(decode_block=1)
    with pytest.raises(ValueError, match="rotating"):
        speed_mod.SpeedSettings(baselines=("full",))
    with pytest.raises(ValueError, match="context"):
        speed_mod.SpeedSettings(context=64, budget=64)
    assert kvcompress.CompressedKVCache  # the library under test is importable alongside


@pytest.mark.parametrize(
    "workload, argv, outputs",
    [
        ("synthetic", ["--quick", "--seq-lens", "64", "--budgets", "16", "--methods", "h2o", "cam",
                       "--scenarios", "structured", "--plain"], ["synthetic.json", "synthetic.png"]),
        ("speed", ["--quick", "--rounds", "1", "--context", "96", "--budget", "32",
                   "--prefill-step-size", "32", "--no-profile", "--plain", "--out-name", "s"],
         ["s.json", "s.png"]),
        ("scaling", ["--quick", "--contexts", "96,128", "--budgets", "64", "--methods", "h2o,cam",
                     "--decode-tokens", "2", "--prefill-step-size", "32", "--plain"],
         ["scaling.json", "scaling.png"]),
    ],
)
def test_command_line_writes_results(workload, argv, outputs, tmp_path, capsys):
    """``kvcompress bench <workload>`` (and the benchmarks/ scripts, which share add_arguments and
    run) parse their options and write the JSON (+ PNG) where --out says."""
    import argparse

    pytest.importorskip("matplotlib")
    from kvcompress.bench import scaling

    mod = {"synthetic": syn, "speed": speed_mod, "scaling": scaling}[workload]
    ap = argparse.ArgumentParser()
    mod.add_arguments(ap)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        payload = mod.run(ap.parse_args([*argv, "--out", str(tmp_path)]))
    for name in outputs:
        assert (tmp_path / name).stat().st_size > 0
    data = json.loads((tmp_path / outputs[0]).read_text())
    assert data["benchmark"] == payload["benchmark"]
    if workload == "synthetic":
        assert {r["method"] for r in data["results"]} == {"h2o", "cam", "full", "rotating"}
        assert data["settings"]["seq_lens"] == [64]
    elif workload == "speed":
        assert data["settings"]["context"] == 96 and set(data["summary"]) == {"h2o", "cam", "rotating", "full"}
    else:
        assert data["settings"]["contexts"] == [96, 128] and data["settings"]["budgets"] == [64]
        assert {r["kind"] for r in data["summary"]} == {"h2o", "cam", "rotating", "full"}
    assert "rotating" in capsys.readouterr().out


def test_bench_writes_only_under_kvcompress_results_and_names_each_file(tmp_path, monkeypatch, capsys):
    """Without ``--out``, ``kvcompress bench`` writes under ``./kvcompress-results`` (the user's
    folder, never a checkout's committed docs/results) and prints one ``wrote <path>`` per file."""
    from pathlib import Path

    from kvcompress.cli import main

    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert main(["bench", "synthetic", "--quick", "--seq-lens", "64", "--budgets", "16", "--methods", "h2o",
                     "--scenarios", "structured", "--plain"]) == 0
    written = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert tmp_path / "kvcompress-results" / "synthetic.json" in written
    assert all(p.parent == tmp_path / "kvcompress-results" for p in written), written
    err = capsys.readouterr().err
    wrote = [line.removeprefix("wrote ") for line in err.splitlines() if line.startswith("wrote ")]
    assert sorted(tmp_path / Path(w) for w in wrote) == written
    assert all(not Path(w).is_absolute() for w in wrote)  # as the user would type them


def test_every_workload_defaults_to_kvcompress_results():
    from kvcompress.cli import BENCH_WORKLOADS, build_parser

    parser = build_parser()
    for workload in BENCH_WORKLOADS:
        assert parser.parse_args(["bench", workload]).out == "kvcompress-results", workload


# ------------------------------------------------------------------------------------------------
# scaling (speed and memory against context)
# ------------------------------------------------------------------------------------------------

TINY_SCALING = dict(
    contexts=(160, 320), budgets=(64,), decode_tokens=4, decode_block=2, sync_tokens=2, prefill_step_size=32,
    n_layers=2,
    hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, intermediate=128, vocab=128, warmup=False,
)


@pytest.fixture(scope="module")
def scaling_payload():
    from kvcompress.bench import scaling

    return scaling.run_scaling(scaling.ScalingSettings(**TINY_SCALING))


def test_scaling_covers_every_method_context_and_baseline(scaling_payload):
    reg = kvcompress.get_registry()
    res = scaling_payload["results"]
    assert scaling_payload["errors"] == []
    kinds = {r["kind"] for r in res}
    assert kinds == set(reg.methods) | {"rotating", "full"}
    for kind in kinds:
        assert sorted(r["context"] for r in res if r["kind"] == kind) == [160, 320]
    for r in res:
        assert r["decode_ms"] > 0 and r["prefill_s"] > 0
        # every decoded token (the first token, 4 pipelined + 2 synchronous per checkpoint) stays
        # in the context
        assert r["tokens_seen"] == r["context"] + (7 if r["context"] == 160 else 14)
        assert r["decode_ms_sync"] > 0
        assert r["peak_bytes"] >= scaling_payload["weights_bytes"] + r["cache_bytes"]
        assert r["live_bytes"] <= r["cache_bytes"]
        if r["kind"] != "rotating":
            assert len(r["decode_ratio_blocks"]) == 2 and all(x > 0 for x in r["decode_ratio_blocks"])
            assert r["decode_ratio_sync"] > 0


def test_scaling_bounded_caches_stay_flat_and_full_grows(scaling_payload):
    reg = kvcompress.get_registry()
    by = {(r["kind"], r["context"]): r for r in scaling_payload["results"]}
    full_small, full_big = by[("full", 160)], by[("full", 320)]
    assert full_big["stored_tokens"] == full_big["tokens_seen"]
    assert full_big["live_bytes"] == full_small["live_bytes"] * 334 // 167
    for kind in [*reg.methods, "rotating"]:
        if kind in reg.methods and reg.methods[kind].spec.disposition == "kivi_quant":
            # quantized tokens are kept: bytes grow, but slower than the full cache's
            grow = by[(kind, 320)]["live_bytes"] - by[(kind, 160)]["live_bytes"]
            assert 0 < grow < full_big["live_bytes"] - full_small["live_bytes"], kind
            continue
        # past every layer's budget (pyramids give the first layer up to ~2x) the held bytes do
        # not grow with the context (chunk selectors hold a few tokens less, varying with the cut)
        assert 0.9 <= by[(kind, 320)]["cache_bytes"] / by[(kind, 160)]["cache_bytes"] <= 1.02, kind
        assert by[(kind, 320)]["live_bytes"] < full_small["live_bytes"], kind


def test_scaling_summary_ratios_and_table(scaling_payload, tmp_path):
    from kvcompress.bench import scaling

    summ = {r["kind"]: r for r in scaling_payload["summary"]}
    assert set(summ) == {r["kind"] for r in scaling_payload["results"]}
    for kind, r in summ.items():
        assert r["context"] == 320
        if kind == "rotating":
            continue
        for key in ("decode_ratio", "decode_ratio_sync", "prefill_ratio", "cache_ratio", "peak_ratio"):
            assert r[key] > 0 and math.isfinite(r[key]), (kind, key)
        if kind != "full":
            assert r["decode_target_met"] == (r["decode_ratio"] >= 0.9)
    assert summ["full"]["cache_ratio"] > 1.5  # 320 + 14 tokens against a 64-token window
    cols, rows = scaling.summary_table(scaling_payload)
    assert len(rows) == len(summ) and all(len(r) == len(cols) for r in rows)
    assert "| cache |" in scaling.markdown_report(scaling_payload)
    png = scaling.plot_scaling(scaling_payload, tmp_path / "scaling.png")
    assert png.stat().st_size > 10_000


def test_scaling_settings_reject_bad_input():
    from kvcompress.bench import scaling

    with pytest.raises(ValueError, match="increasing"):
        scaling.ScalingSettings(contexts=(2048, 1024))
    with pytest.raises(ValueError, match="full_budget"):
        scaling.ScalingSettings(budgets=(256,), full_budget=512)
    with pytest.raises(ValueError, match="unknown methods"):
        scaling.run_scaling(scaling.ScalingSettings(**{**TINY_SCALING, "methods": ("no_such_method",)}))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "scaling", "--quick", "--methods", "no_such_method"], "unknown methods ['no_such_method']; registered"),
        (["bench", "scaling", "--quick", "--contexts", "256,128"], "contexts must be increasing"),
        (["bench", "retrieval", "--quick", "--methods", "no_such_method"], "unknown methods ['no_such_method']"),
    ],
)
def test_bench_command_reports_bad_settings_without_a_traceback(argv, message, tmp_path, capsys):
    from kvcompress.cli import main

    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(
    "argv, message",
    [
        (["retrieval", "--ratios", "0"],
         "ratios must be a non-empty list of integers >= 1 (budget = context // ratio), got 0"),
        (["retrieval", "--ratios", "2,-4"], "ratios must be a non-empty list of integers >= 1"),
        (["retrieval", "--ratios", ""], "got nothing"),
        (["retrieval", "--context", "0"], "context must be an integer >= 1, got 0"),
        (["retrieval", "--samples", "0"], "samples must be an integer >= 1, got 0"),
        (["retrieval", "--prefill-chunks", "-1"], "prefill_chunks must be a non-empty list of integers >= 0, got -1"),
        (["retrieval", "--tasks", "copy"], "tasks must be among mqar, passkey, got copy"),
        (["perplexity", "--windows", "0"], "windows must be an integer >= 1, got 0"),
        (["perplexity", "--budgets", "0,64"], "budgets must be a non-empty list of integers >= 1, got 0,64"),
        (["perplexity", "--window", "64", "--prefill", "63"], "prefill must be in [1, window - 2] = [1, 62]"),
        (["synthetic", "--budgets", "0"], "budgets must be a non-empty list of integers >= 1, got 0"),
        (["synthetic", "--seq-lens", "-5"], "seq_lens must be a non-empty list of integers >= 2, got -5"),
        (["synthetic", "--batch", "0"], "batch must be an integer >= 1, got 0"),
        (["synthetic", "--methods", "no_such_method"], "unknown methods ['no_such_method']"),
        (["speed", "--budget", "0"], "budget must be an integer >= 1, got 0"),
        (["speed", "--rounds", "0"], "rounds must be an integer >= 1, got 0"),
        (["speed", "--context", "100", "--budget", "128"], "context must exceed the budget"),
        (["speed", "--prefill-step-size", "0"], "prefill_step_size must be an integer >= 1, got 0"),
        (["speed", "--methods", "no_such_method"], "unknown methods ['no_such_method']"),
        (["scaling", "--budgets", "0"], "budgets must be a non-empty list of integers >= 1, got 0"),
        (["scaling", "--decode-tokens", "-1"], "decode_tokens must be >= decode_block (8), got -1"),
        (["scaling", "--n-layers", "0"], "n_layers must be an integer >= 1, got 0"),
        (["scaling", "--full-budget", "-1"], "full_budget must be an integer >= 0, got -1"),
    ],
)
def test_impossible_settings_are_one_error_line(argv, message, tmp_path, capsys):
    """Zero or negative sizes, budgets, ratios and counts stop ``kvcompress bench`` before anything
    runs or is written, with one line naming the setting, what is valid and the value."""
    from kvcompress.cli import main

    assert main(["bench", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvcompress bench {argv[0]}: error: ") and "\n" not in err, err
    assert message in err, err
    assert not list(tmp_path.iterdir())


def test_speed_targets_follow_what_a_method_keeps():
    """A method whose disposition keeps and attends the tokens it frees (KIVI) is judged as a
    full cache's replacement (decode >= 0.8x rotating, prefill <= 2x full); an eviction method
    by the bounded-cache targets (decode >= 0.9x, prefill <= 1.3x rotating)."""
    from kvcompress.bench import speed

    rec = {"decode_ratio": 0.85, "prefill_ratio": 1.8, "prefill_ratio_full": 0.9}
    kivi, h2o = speed._targets("kivi", rec), speed._targets("h2o", rec)
    assert (kivi["decode_target_met"], kivi["prefill_target_met"]) == (True, True)
    assert (h2o["decode_target_met"], h2o["prefill_target_met"]) == (False, False)
    assert speed._targets("kivi", {**rec, "prefill_ratio_full": 2.5})["prefill_target_met"] is False
    assert speed._targets("kivi", {"decode_ratio": 0.7, "prefill_ratio": 1.8})["prefill_target_met"] is None
    payload = {"summary": {"kivi": {**rec, **kivi, "prefill_s_median": 1.0, "decode_tok_s_median": 1.0}}}
    row = speed.summary_table(payload)[1][0]
    assert row[-1] == "decode yes, prefill (vs full) yes"
