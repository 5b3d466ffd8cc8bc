"""The long-context workloads' command lines and ``kvcompress tune --workload longctx``.

Bad settings are one error line before anything loads; ``bench longctx --quick`` and ``tune
--workload longctx`` run end to end on stories260K (seconds; skipped with the reason when it is
absent); tune searches on the workload's episodes with a tiny random model.
"""

from __future__ import annotations

import argparse
import json

import pytest

from _longctx_helpers import TEXT, ByteTokenizer, text_source
from conftest import models_dir, tiny_llama
from kvcompress.bench import longctx as lc


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return text_source(tmp_path_factory)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(n_layers=2, hidden=64, heads=4, kv_heads=2, vocab=258, seed=3)


def test_command_line_errors_are_one_line(capsys, tmp_path):
    from kvcompress.cli import main

    rc = main(["bench", "longctx", "--model", str(tmp_path / "none"), "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "no mlx-lm model folder" in err
    rc = main(["bench", "longctx", "--ratios", "0", "--out", str(tmp_path)])
    assert rc == 2 and "ratios must be" in capsys.readouterr().err


def test_cli_lists_the_workloads():
    from kvcompress.cli import BENCH_WORKLOADS

    assert BENCH_WORKLOADS["longctx"] == "kvcompress.bench.longctx"
    assert BENCH_WORKLOADS["longppl"] == "kvcompress.bench.longctx_ppl"
    ap = argparse.ArgumentParser()
    lc.add_arguments(ap)
    args = ap.parse_args(["--quick", "--tasks", "qa", "--methods", "h2o", "cam", "--variant", "cam:merge=mean"])
    s = lc.settings_from_args(args)
    assert s["lengths"] == (512,) and s["tasks"] == ("qa",) and s["methods"] == ("h2o", "cam")
    assert s["extra"] == [("cam", {"merge": "mean"})]


def test_cli_quick_run_on_stories260k_writes_results(tmp_path, capsys, monkeypatch):
    """``kvcompress bench longctx --quick`` end to end on the small trained model (seconds): model
    loading, the filler folder, both tables, the JSON and the plot."""
    pytest.importorskip("matplotlib")
    from kvcompress.cli import main

    path = models_dir() / "stories260K"
    if not (path / "config.json").is_file():
        pytest.skip(f"stories260K not found at {path}; set KVCOMPRESS_MODELS_DIR to run this test")
    monkeypatch.setenv("KVCOMPRESS_NO_BLAS_REEXEC", "1")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "t.txt").write_text(TEXT)
    rc = main(["bench", "longctx", "--quick", "--model", str(path), "--text-dir", str(tmp_path / "text"),
               "--methods", "h2o,tova", "--plain", "--out", str(tmp_path / "out")])
    out = capsys.readouterr()
    assert rc == 0, out.err
    data = json.loads((tmp_path / "out" / "longctx.json").read_text())
    assert (tmp_path / "out" / "longctx.png").stat().st_size > 0
    assert {r["label"] for r in data["results"]} == {"full", "rotating", "h2o", "tova"}
    assert data["settings"]["lengths"] == [512] and data["machine"].get("git_commit")
    assert "Full cache per task" in out.out and "rotating" in out.out


def test_tune_searches_on_the_longctx_workload(tiny, source):
    from kvcompress.tune import LongctxWorkload, run_search

    w = LongctxWorkload(tiny, ByteTokenizer(chatml=True), length=600, episodes=2, heldout=1, text_dir=source.where,
                        chunk=128, min_full=0.0)
    assert len(w.items["search"]) == 2 and len(w.items["heldout"]) == 1
    assert w.items["search"][0].seed != w.items["heldout"][0].seed  # held-out episodes are other episodes
    res = run_search(w, 150, methods=["h2o", "streaming_llm"], candidates=2, finalists=2, max_seconds=600,
                     progress=False, log=lambda line: None)
    done = [r for r in res["candidates"] if r.get("gap") is not None]
    assert {r["label"] for r in done} == {"h2o", "streaming_llm"}
    assert all(len(r["losses"]) == 2 and 0.0 <= min(r["losses"]) <= max(r["losses"]) <= 1.0 for r in done)
    assert res["winner"]["label"] in {"h2o", "streaming_llm"} and w.describe()["workload"] == "longctx"


@pytest.mark.parametrize("argv, says", [
    (["--workload", "longctx"], "--workload longctx needs --model"),
    (["--workload", "retrieval", "--model", "m"], "leave --model out"),
    (["--workload", "longctx", "--model", "m", "--data", "/nonexistent"], "no folder at /nonexistent"),
])
def test_tune_longctx_flags_are_one_line_errors(monkeypatch, argv, says, capsys):
    from kvcompress.cli import main

    monkeypatch.setenv("KVCOMPRESS_NO_BLAS_REEXEC", "1")
    rc = main(["tune", "--budget", "64", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and says in err, err


def test_tune_cli_on_the_longctx_workload_writes_its_files(tmp_path, capsys, monkeypatch):
    """``kvcompress tune --workload longctx`` end to end on stories260K (seconds)."""
    pytest.importorskip("matplotlib")
    from kvcompress.cli import main

    path = models_dir() / "stories260K"
    if not (path / "config.json").is_file():
        pytest.skip(f"stories260K not found at {path}; set KVCOMPRESS_MODELS_DIR to run this test")
    monkeypatch.setenv("KVCOMPRESS_NO_BLAS_REEXEC", "1")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "t.txt").write_text(TEXT)
    out = tmp_path / "res"
    rc = main(["tune", "--workload", "longctx", "--model", str(path), "--data", str(tmp_path / "text"),
               "--budget", "128", "--window", "512", "--windows", "1", "--held-out", "1", "--candidates", "2",
               "--finalists", "1", "--methods", "h2o,tova", "--out", str(out), "--no-progress", "--plain"])
    text = capsys.readouterr()
    assert rc == 0, text.err
    data = json.loads((out / "tune.json").read_text())
    assert data["workload"]["workload"] == "longctx" and data["workload"]["length"] == 512
    assert data["settings"]["workload"] == "longctx" and (out / "tune.toml").is_file()
    assert "winner: " in text.out and "accuracy lost" in text.out
