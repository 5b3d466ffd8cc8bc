"""Smoke tests of the ``kvcompress bench`` command line at tiny sizes: each workload writes its
results where asked (by default under ``./kvcompress-results``), and bad settings stop it with one
error line before anything is written."""

from __future__ import annotations

import json
import warnings

import pytest

from kvcompress.bench import speed as speed_mod
from kvcompress.bench import synthetic as syn


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
